"""One record per call of a recurrent mixer, and the one order checker every per-token strategy uses.

A worker reads in the order the model runs. A mixer's values of one call are served from its kernel call: its
arguments (read once, when the kernel starts, kept for values computed from several), the states inside it, its
return. `Call` keeps what the worker learnt of the call and what it read and wrote; its checks raise `OrderError`
naming the earlier read, where nnsight would drop a request for a moment already passed (warning "never reached").

A mixer builds its record as a call source: `entry` reads the forward's inputs at the mixer's input, `at_start`
the kernel call's arguments when it starts. The record then owns the kernel's named arguments: its signature table
is resolved once (`table`), the arguments are served once, tokens first (`serve_all`, the layouts of
`nnterp.recurrent.arguments`), and `serve` / `assign` read and write one by its table name. It also owns the state
entering and leaving the call (`state_input`, `state_output` and their writes), the runs between writes
(`segments`, over `runs_between_writes`) and token positions (`position`), for every strategy. A call source ends or
replaces the call with a result (`skip`, `replace`): a kernel call's by default; lightning attention, whose recurrence
is its forward's own operations, is that call source's subclass (`forward_call.ForwardCall`).

Every kind's order checks are the methods below (`Call.check_reachable` the one test they share), the MiniMax
record's and a call's entry's included: a kind raises `OrderError`, never nnsight's raw ``OutOfOrderError``, and no
other module raises it for a write's order. The record lives on the worker (`nnterp.core.calls.per_call`): two
invokes never share one, and it is freed with its run.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..core import indices
from ..core.calls import mediator
from ..core.errors import OrderError, SignatureError, Unavailable
from ..core.values import check_expected, check_tensor, replace_in, select_from
from . import arguments
from .gradients import add_zero, graft, recording
from .kernels import signature_binding
from .no_cache import no_cache_reason


def order_hint(asked: str, passed: str) -> str:
    """The `OrderError` sentence: what was asked for, what had already passed, and the order that works."""
    return (
        f"{asked} was asked for after {passed}: a worker reads in the order the model runs, so in one trace "
        "read the kernel's arguments first, then per-token positions in increasing order (positions before a "
        "write, the write, then positions after it; `states` before any write), then `state_output` / "
        "`attention_output`, and a block's reads before any write to a later block"
    )


#: Why a prompt's kernel returned no final state.
NO_CACHE = (
    "this call runs without a cache, so its kernel returns no final state: run it with use_cache=True "
    "(the default of a trace and of generate)"
)
#: What had passed when a per-token state is asked for after its call's kernel ran.
KERNEL_RAN = "this call's kernel had already run (state_output, attention_output or a later value was read first)"
#: What had passed when a call's first value is asked for after the mixer's call started.
MIXER_RAN = "the mixer's call had started (attention_output, state_output or a later value was read first)"


def runs_between_writes(writes: dict, seq: int, initial: Any, stop: int | None = None) -> list[tuple[int, int, Any]]:
    """``(lo, hi, start)`` runs of tokens ``[lo, hi)`` of a ``seq``-token call up to ``stop``, cut after every write
    (``writes``: ``{position: state}``): the first from ``initial`` (the state entering the call), each later one
    from the state written before it."""
    stop = seq if stop is None else stop
    runs, lo = [], 0
    for t in sorted(writes):
        if t >= stop:
            break
        runs.append((lo, t + 1, initial))
        lo, initial = t + 1, writes[t]
    if lo < stop:
        runs.append((lo, stop, initial))
    return runs


class Call:
    """What a worker knows of one call of a mixer: its kernel call, its arguments, what was read and written.

    Attributes:
        kernel, op: the label of the kernel call that fires (``CHUNK_KERNEL`` or ``RECURRENT_KERNEL``) and its envoy.
        decodes: whether it is the one-token decode kernel.
        table: that kernel's signature table (``RECURRENT_ARGUMENTS`` on a decode step, else ``CHUNK_ARGUMENTS``).
        args, kwargs, seq: the kernel call's arguments, as written so far by the worker; its number of tokens.
        expected: ``(shape, dtype, device)`` of one state of this call.
        output_at: how often the kernel had returned when the record was made.
        furthest: ``(position, what)``: the latest token a read or write reached.
        writes: ``{position: state}`` written by ``set_state_after``.
        states_read: whether ``states`` (every position) was read.
        strategy: a per-token strategy's own per-call data (its state op, boundaries, ...).
    """

    __slots__ = (
        "mixer", "kernel", "op", "decodes", "table", "args", "kwargs", "seq", "expected", "started", "output_at",
        "furthest", "writes", "states_read", "strategy", "served", "served_under",
    )

    def __init__(self, mixer: Any, kernel: str, op: Any, decodes: bool, started: int) -> None:
        self.mixer, self.kernel, self.op, self.decodes, self.started = mixer, kernel, op, decodes, started
        self.table: arguments.Signature = type(mixer).RECURRENT_ARGUMENTS if decodes else type(mixer).CHUNK_ARGUMENTS
        self.args, self.kwargs = (), {}  # the kernel call's, ``(args, kwargs)``
        self.seq = self.output_at = 0
        self.expected: tuple = ((), torch.float32, None)
        self.furthest: tuple[int, str] | None = None
        self.writes: dict[int, torch.Tensor] = {}
        self.states_read = False
        self.strategy, self.served = {}, {}  # per-strategy data; the served arguments, tokens first, by name
        self.served_under: bool | None = None  # autograd's mode when `served` was made (None: not yet)

    @staticmethod
    def entry(mixer: Any, kernels: tuple) -> dict:
        """What a call source reads at the mixer's input, once per call: the call's length, its cache, whether it
        continues it, the forward's bound arguments, and how often each of ``kernels`` (labels in the forward) has
        started before this call (a later request for its arguments past that count would land in the next call)."""
        # Instrument the forward before it runs, whatever value is read first (a convolution window reads
        # no kernel op): otherwise a first trace runs it uninstrumented and a later kernel read is lost.
        mixer.source
        med = mediator()
        Call.check_entry(mixer, med=med)
        args, kwargs = mixer.inputs
        module = mixer.hf_module()
        bound = signature_binding(type(module).forward, module, args, kwargs)
        hidden = bound.get("hidden_states", args[0] if args else None)
        # The cache under this release's keyword: ``cache`` (5.24), ``cache_params`` or ``past_key_values`` before.
        cache = next((bound[name] for name in ("cache", "cache_params", "past_key_values") if bound.get(name) is not None), None)
        started = {label: med.occurrence(f"{mixer.path}.source.{label}.input") for label in kernels}
        return {
            "seq": hidden.shape[1], "cache": cache, "continues": mixer.continues_cache(cache), "kernels": started,
            "arguments": bound,  # the forward's own arguments (RWKV's state list, which it carries instead of a cache)
        }

    @classmethod
    def at_start(cls, mixer: Any, kernel: str, op: Any, decodes: bool, started: int, tokens: str) -> Call:
        """The record of kernel call ``op`` (label ``kernel``), made while the worker waits at its start: its
        arguments, its length (axis 1 of argument ``tokens``) and one state's ``expected`` shape, dtype, device."""
        call = cls(mixer, kernel, op, decodes, started)
        med = mediator()
        call.check_reachable(f"{op.path}.input", started, "a kernel argument", KERNEL_RAN, med)  # `check_not_started`
        call.args, call.kwargs = op.inputs
        if type(mixer).SHARED_ARGUMENTS and arguments.own_nodes(call, call.table):
            Mediator.swap(f"{op.path}.input", call.arguments)
        call.output_at = med.occurrence(f"{op.path}.output")
        served = call.serve(tokens)  # positional or keyword (the mLSTM's backend takes keywords only)
        call.seq = served.shape[1]
        call.expected = (mixer.state_shape(call), torch.float32, served.device)
        return call

    @property
    def arguments(self) -> tuple:  # ``(args, kwargs)`` of the kernel call
        return self.args, self.kwargs

    def occurrences(self, location: str) -> int:  # how often the run passed ``location`` (``….input`` / ``….output``)
        return mediator().occurrence(location)

    def kernel_waiting(self) -> bool:  # whether the kernel call has not started (its arguments can still be rewritten)
        return self.occurrences(f"{self.op.path}.input") <= self.started

    # -- the kernel's arguments by name --------------------------------------------------

    def serve(self, name: str) -> Any:
        """Argument ``name`` of the kernel call, tokens first; ``None`` where the kernel has no such argument."""
        return self.serve_all().get(name)

    def serve_all(self) -> dict:
        """Every argument of the table by name, tokens first (`arguments.serve_all`), in one pass when first asked (again
        where autograd's mode changed: a view's ``requires_grad`` follows it), kept current by `assign`; copy to change."""
        grad = torch.is_grad_enabled()
        if self.served_under is not grad:
            self.served, self.served_under = arguments.serve_all(self.table, self.arguments), grad
        return self.served

    def assign(self, name: str, view: Any) -> None:
        """Replace argument ``name`` by ``view`` (served tokens first, laid back in the kernel's layout), before the kernel runs."""
        what = f"`linear_attn.{name}`"
        slot = self.table.get(name)
        if slot is None:
            raise Unavailable(f"a write to {what}", f"it is not an argument of this call's kernel ({self.kernel})")
        self.check_not_started(f"a write to {what}")
        where, layout = slot
        current = select_from(self.arguments, where)
        if isinstance(current, torch.Tensor):
            check_tensor(what, view, layout.read(current))
            element = layout.write(view, current)
        else:
            element = view
        self.args, self.kwargs = replace_in(self.arguments, where, element)
        if self.served_under is not None:
            self.served[name] = arguments.tokens_first(element, layout, self.served_under)
        # Later values of this call (betas from dt, ...) read the record, which now holds the write.
        Mediator.swap(f"{self.op.path}.input", self.arguments)

    # -- the call source's result, replaced (a one pass, a split call): a kernel call's, a kind's record overrides --
    def skip(self, result: Any) -> None:
        """End the call with ``result``, the kernel's own return, the kernel call skipped (before it starts)."""
        self.op.skip(result)

    def replace(self, result: Any, waits: bool) -> None:
        """Make ``result`` the kernel's return once it has run (``waits``: it has not yet been waited for)."""
        if waits:
            self.op.output
        Mediator.swap(f"{self.op.path}.output", result)

    def own_final(self) -> torch.Tensor | None:  # the final state the source computes itself, as the last of `states`
        return None

    def graft(self, zero: torch.Tensor) -> None:  # a spec's tap added to the return's last tokens (`gradients.add_zero`)
        output = self.op.output
        at = 0 if isinstance(output, tuple) else None
        self.op.output = replace_in(output, at, add_zero(select_from(output, at), zero, type(self.mixer).FAST.output_axis))

    kept = 0  # leading tokens whose outputs the call source keeps as it computed them: a split does not recompute them

    def segments(self, initial: Any, stop: int | None = None) -> list[tuple[int, int, Any]]:
        """The call's runs between its writes up to ``stop`` (`runs_between_writes`), the first from ``initial``."""
        return runs_between_writes(self.writes, self.seq, initial, stop)

    # -- the state entering and leaving the call ---------------------------------------
    # A prompt's kernel takes the entering state as argument ``"state"`` (``None`` on a fresh prompt) and returns
    # the state after its last token as element ``FINAL_STATE`` (``None`` without a cache). A one-step decode
    # kernel (Mamba, ``ONE_STEP_DECODE``) updates the cache's buffer in place instead: the entering state is a
    # copy of it, written by copying into it, and the leaving state is the buffer once the kernel has returned.

    @property
    def one_step(self) -> bool:
        """Whether the kernel is a one-step decode updating the cache's state buffer (argument ``"state"``) in place."""
        return self.decodes and type(self.mixer).ONE_STEP_DECODE

    def state_input(self) -> torch.Tensor | None:
        """The state entering the call, a copy (``None`` on a fresh prompt)."""
        state = self.serve("state")
        if state is None:
            return None
        if recording() and not self.one_step and self.kernel_waiting():
            # Under autograd the kernel reads the entering state through the served copy (an exact graft), so its
            # .grad is the loss's derivative by it; the cache's buffer, overwritten in place later, is left out of it.
            entering = state.detach().clone().requires_grad_(True)
            self.assign("state", graft(entering, entering, state))
            return entering
        # The cache overwrites the entering state's buffer in place during the call.
        return state.clone()

    def assign_state_input(self, value: Any) -> None:
        """Make the call start from ``value``, before its kernel runs."""
        what = "`linear_attn.state_input`"
        self.check_not_started(f"a write to {what}")
        check_expected(what, value, *self.expected)
        if self.one_step:
            # The kernel updates this buffer in place and nothing else writes the cache:
            # write into it, so the step continues from value and the cache follows.
            self.serve("state").copy_(value)
            return
        if "state" not in self.table:
            raise Unavailable(
                "a write to linear_attn.state_input",
                f"{type(self.mixer).__name__}'s prompt kernel takes no initial state (it starts from zeros): call "
                "nnterp.fast_states(model) first (it adds what the state contributes), or assign on a decode step"
            )
        self.assign("state", value)

    def state_output(self) -> torch.Tensor:
        """The state after the call's last token (waits for the kernel to return)."""
        if self.one_step:
            buffer = self.serve("state")
            self.op.output  # the kernel has returned: the buffer holds the new state
            return buffer.clone()
        return self.final_output()[type(self.mixer).FINAL_STATE]

    def write_state_output(self, value: Any) -> None:
        """Make ``value`` the state after the call's last token, once the kernel has returned."""
        what = "`linear_attn.state_output`"
        if self.one_step:
            buffer = self.serve("state")
            self.op.output
            check_tensor(what, value, buffer)
            buffer.copy_(value)
            return
        output, index = self.final_output(), type(self.mixer).FINAL_STATE
        check_tensor(what, value, output[index])
        self.op.output = replace_in(output, index, value)

    def final_output(self) -> tuple:
        """The kernel's return, holding a final state (else `Unavailable`: the call runs without a cache)."""
        output = self.op.output
        if not isinstance(output, tuple) or output[type(self.mixer).FINAL_STATE] is None:
            raise Unavailable("linear_attn.state_output", no_cache_reason(self.mixer, NO_CACHE))
        return output

    def effective(self, positions: Any, selection: Any, coefficients: bool) -> tuple:
        """``(A, readout)``: the mixer's effective attention (``EFFECTIVE``) from the kernel's arguments by name."""
        return type(self.mixer).EFFECTIVE.compute(dict(self.serve_all()), positions, selection, coefficients)

    def effective_selection(self, positions: Any, heads: Any, channels: Any, what: str) -> tuple:
        """``(rows, picked)``: `effective_attention_of`'s positions and heads (or channels), checked as indices."""
        mixer = self.mixer
        axis = type(mixer).EFFECTIVE.axis
        chosen, other = (heads, channels) if axis == "heads" else (channels, heads)
        if other is not None:
            wrong = "channels" if axis == "heads" else "heads"
            raise SignatureError(f"`{what}`: {type(mixer).__name__}'s effective attention has one pattern per {axis[:-1]}: pass {axis}=, not {wrong}=")
        rows = indices.selection(positions, self.seq, what, "position")
        width = mixer.dims()[type(mixer).values()["effective_attention"].annotation.dim_str.split()[1]]
        return rows, indices.selection(chosen, width, what, axis[:-1], f"the mixer's {width} {axis}")

    # -- the checks ----------------------------------------------------------------

    @staticmethod
    def check_reachable(location: str, first: int, what: str, passed: str, med: Any = None) -> None:
        """The one order test: raise `OrderError` (``what`` asked after ``passed``) once the run has passed
        ``location`` more than ``first`` times, where nnsight would raise its raw ``OutOfOrderError`` (``med``: the
        worker's mediator, where the caller has it)."""
        if (med or mediator()).occurrence(location) > first:
            raise OrderError(order_hint(what, passed))

    @staticmethod
    def check_entry(mixer: Any, what: str = "a value of this call of `linear_attn`", location: str | None = None,
                    med: Any = None) -> None:
        """Raise unless the run has not passed ``location`` (the mixer's input) of the call a request made now
        asks for: a call's record is made there, before any of its values."""
        entry = location or f"{mixer.path}.input"
        med = med or mediator()
        Call.check_reachable(entry, med.wanted(entry), what, MIXER_RAN, med)

    def check_not_started(self, what: str, passed: str = "this call's kernel had started") -> None:
        """Raise unless the kernel call has not started: arguments are read and written, and states found, before it runs."""
        self.check_reachable(f"{self.op.path}.input", self.started, what, passed)

    def check_open(self, what: str, med: Any = None) -> None:
        """Raise unless the kernel call has not returned yet."""
        self.check_reachable(f"{self.op.path}.output", self.output_at, what, "the kernel had returned (state_output or a later value was read)", med)

    def reach(self, position: int, what: str, ops: Any, first: int) -> None:
        """Raise unless the run can still reach occurrence ``first + position`` of every op in ``ops`` (one op, or
        the ops one token's state is read from, in any order); then record it as reached."""
        med = mediator()
        self.check_open(what, med)
        earlier = self.furthest[1] if self.furthest is not None else "an earlier read"
        for op in ops if isinstance(ops, (list, tuple)) else (ops,):
            self.check_reachable(f"{op.path}.output", first + position, what, f"{earlier} had moved the run past token {position}", med)
        self.advance(position, what)

    def advance(self, position: int, what: str) -> None:
        """Record that a read or write reached ``position``."""
        if self.furthest is None or position >= self.furthest[0]:
            self.furthest = (position, what)

    def check_write(self, position: int, what: str) -> None:
        """Raise unless a write at ``position`` comes before the kernel returned and after no read or write of a
        later (or the same) position."""
        self.check_open(what)
        self.check_write_order(what, position, self.states_read, self.furthest, self.writes)

    def check_first_write(self, what: str) -> None:  # a write that replaces the whole call (skips it) comes first
        self.check_not_started(what, "this call's kernel had already started (state_output, attention_output or a later value was read first)")

    def check_no_write(self, what: str) -> None:
        """Raise if this call has a write: a read of every token (`states`) that cannot see it comes before it."""
        if self.writes:
            raise OrderError(f"{what} after set_state_after in the same call: read states before the write")

    def check_no_states_read(self, what: str) -> None:
        """Raise if `states` was read in this call: a one pass served every state and skipped the kernel call."""
        self.check_write_order(what, 0, self.states_read, None, {})

    def check_no_later_read(self, position: int, what: str) -> None:
        """Raise if a read or write reached a token after ``position`` (a write carried to every later token
        through the decays, which any number of writes may repeat in any order)."""
        self.check_write_order(what, position, False, self.furthest, {})

    def check_before(self, op: Any, first: int, what: str, passed: str) -> None:
        """Raise unless the run has not passed occurrence ``first`` of ``op``'s output (``passed``: what had)."""
        self.check_reachable(f"{op.path}.output", first, what, passed)

    def check_unwritten(self, what: str, passed: str, also: bool = False) -> None:
        """Raise if a write inside the call came first (``also``: a kind's own write, lightning's ``decays``):
        ``what`` replaces what the whole call starts from, so it comes before any write that changes the call."""
        if self.writes or also:
            raise OrderError(order_hint(what, passed))

    def check_own(self, what: str) -> None:
        """Raise if ``set_state_after`` changed the call: ``what`` is computed from the call as the forward ran it."""
        if self.writes:
            raise OrderError(f"{what} is the call's own: read it before set_state_after")

    @staticmethod
    def check_write_order(what: str, position: int, states_read: bool, furthest: tuple | None, writes: dict) -> None:
        """The write order, on any kind's record: no `states` read before, no later token read, writes increasing."""
        if states_read:
            raise OrderError(order_hint(what, "states"))
        if furthest is not None and furthest[0] > position:
            raise OrderError(order_hint(what, f"{furthest[1]} had read a later token"))
        if writes and max(writes) >= position:
            raise OrderError(order_hint(what, f"set_state_after({max(writes)}, value)"))

    def positions(self, selection: Any, what: str) -> list[int]:
        """``selection`` (a sequence of ints, a range, a 1-d tensor) as positions of this call, in the order given."""
        return indices.sequence(selection, self.seq, what)

    def position(self, t: Any, what: str) -> int:
        """``t`` as a position of this call (negative counts from the end), or an error naming the range."""
        return indices.index(t, self.seq, what)
