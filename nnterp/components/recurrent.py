"""RecurrentMixer: how a recurrent mixer's values are reached, whatever the values are.

A recurrent mixer (a gated DeltaNet, a state-space layer) runs its sequence through a kernel the modeling module calls:
one kernel for a prompt, another for a one-token step over a cached state (a decode step of ``generate``), picked by the
forward's own test. Its values are the arguments and results of that call. What differs between mixers is which
arguments mean what (a signature table per kernel, `nnterp.recurrent.arguments`) and how a state is written inside a
call (the hooks a strategy calls, `nnterp.recurrent.per_token.protocol.Mixer`); what they share is declared here: which
kernel fires (`KERNEL`, once per call), the values of the per-call record (`nnterp.recurrent.call.Call`: the arguments,
the states entering and leaving the call, effective attention), and the state after every token, served by the strategy
`nnterp.recurrent.per_token.strategy_for` chooses. A subclass declares its kernels, reference HF class, signature tables
and values; the labels (``CHUNK_KERNEL``, ...) are found per HF mixer class (`nnterp.recurrent.labels`).

Conventions, stated once: ``seq`` is the tokens of *this call* (the prompt, or the one token of a decode step), and
every per-token position ``t`` counts from the call's own first token. A state is float32 whatever the model's dtype.

Failure mode worth knowing: a worker reads in the order the model runs. The state after token ``t`` exists only while
the kernel runs, so per-token reads and writes come after the kernel's arguments and before ``state_output`` /
``attention_output`` of the same call, and positions in increasing order. nnsight silently drops a request for a
position already passed; nnterp raises `OrderError` naming the read that came first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..core.calls import mediator, once_per_call, per_call, pinned
from ..core.dims import BATCH, MIXER_HEADS, SEQ, Hidden, State, States, Values
from ..core.errors import InvalidArgument, Unavailable
from ..core.standard import Standard
from ..core.values import DerivedEProperty, Key, module_output
from ..fast.spec import EffectiveSpec, FastSpec
from ..recurrent import arguments, per_token
from ..recurrent.call import Call
from ..recurrent.gradient_support import gradient_reasons
from ..recurrent.kernels import drill, modeling_of, needs_torch_kernels, original_body, runs_pure_torch, unreadable_call
from ..recurrent.knockout import RecurrenceInterventions
from ..recurrent.labels import Label, cache_test, call_label, state_label, without_labels
from ..recurrent.no_cache import final_state_reason
from ..recurrent.per_token.loop import needs_recurrent_routing
from ..recurrent.routing import route_delta_rule, route_kernels, track  # noqa: F401  (documented here)
from ..recurrent.settings import REMOTE

__all__ = ["RecurrentMixer", "kernel", "kernel_argument", "EffectiveAttention", "needs_torch_kernels", "needs_recurrent_routing",
           "route_kernels", "route_delta_rule", "per_call", "pinned"]

#: The per-call record key of the mixer's strategy (`per_token.strategy_for`, once per call: settings hold in a trace).
STRATEGY = "per-token strategy"
#: ``[batch, mixer_heads, seq, seq]``: rows are the output's tokens t, columns the values' tokens s.
EffectiveAttention = Float[Tensor, f"{BATCH} {MIXER_HEADS} {SEQ} {SEQ}"]


class RecurrentMixer(RecurrenceInterventions, Standard):
    """A sequence mixer with a recurrent state, read at the kernel call its forward makes.

    A subclass declares: ``REFERENCE``, the HF mixer class (``"module.Class"``) its class-level labels are read from
    (an envoy reads those of the module it wraps); ``CHUNK_FUNCTION`` / ``RECURRENT_FUNCTION``, the module-level
    names of the prompt's and the decode step's kernels, whose calls in the forward are labelled ``CHUNK_KERNEL`` /
    ``RECURRENT_KERNEL``; ``STATE_VARIABLE``, the variable holding the state inside them, so that ``STATE_OP`` is
    its binding after each token's update in the token-by-token kernel (``None`` when no kernel materializes it) and
    ``STEP_STATE_OP`` the new state of a one-step decode kernel (``ONE_STEP_DECODE``, Mamba); ``CHUNK_ARGUMENTS`` /
    ``RECURRENT_ARGUMENTS``, each kernel's signature table (``"state"``: the state entering the call;
    ``SEQ_ARGUMENT``: the argument whose axis 1 counts the tokens); ``FAST`` / ``EFFECTIVE``, its fast path and
    effective attention (`nnterp.fast`), or ``None``; ``CHUNKED_SCAN``, whether the prompt kernel is Mamba-2's chunk
    scan.

    ``KERNEL`` names the call that fires on this call of the mixer, decided once per call by the forward's own test,
    so the same values work in a trace and at every step of ``tracer.iter``. The state after every token (`state`,
    `states`, `state_after`, `states_of`, `set_state_after`) is served by the strategy
    `nnterp.recurrent.per_token.strategy_for` picks: the token loop once ``nnterp.route_kernels(model.family,
    "torch")`` routes the family's prompts through it (like eager attention, the user's choice), Mamba-2's chunk
    boundaries with ``chunk_per_token(model)``, or the kernel call's own arguments with ``fast_states(model)``.
    """

    KIND = "linear_attn"
    REFERENCE: str = ""
    CHUNK_FUNCTION: str = ""
    RECURRENT_FUNCTION: str = ""
    CONV_FUNCTIONS: tuple = ("causal_conv1d_fn", "causal_conv1d_update")
    STATE_VARIABLE: str = ""
    ONE_STEP_DECODE: bool = False
    CHUNKED_SCAN: bool = False
    STATES_FROM_ARGUMENTS = False  # `FromArguments` its own strategy, whatever the setting (`Mixer.STATES_FROM_ARGUMENTS`)
    FAST: FastSpec | None = None
    FAST_CONSTANTS: dict[str, str] = {}  # what FAST reads off the module beside the call (`Mixer.FAST_CONSTANTS`)
    OWN_ONE_PASS: Callable | None = None  # its own strategy's one pass (`Mixer.OWN_ONE_PASS`)
    EFFECTIVE: EffectiveSpec | None = None  # its effective attention (`nnterp.fast.spec`), from the kernel's arguments
    #: Values of this component no gradient reaches, beyond the shared ones (`gradient_support.NEVER`): name -> why.
    GRADIENTLESS: dict[str, str] = {}
    CHUNK_ARGUMENTS: arguments.Signature = {}
    RECURRENT_ARGUMENTS: arguments.Signature = {}
    SEQ_ARGUMENT: str = "q"
    FINAL_STATE: int | None = 1  # the kernel return's element holding the final state (None: none, `Mixer.leave_state`)
    #: Whether the forward also uses, outside the kernel, tensors it passes the kernel in another layout than served (Mamba-1's
    #: ``x`` feeds ``x_proj``): the kernel then gets its own node of each under autograd (`arguments.own_nodes`).
    SHARED_ARGUMENTS = False
    #: Whether the forward must ask the cache by name (a release that stops doing so fails at the label lookup).
    CACHE_TEST_REQUIRED = False

    CHUNK_KERNEL = Label()
    RECURRENT_KERNEL = Label()
    STATE_OP = Label()
    STEP_STATE_OP = Label()
    #: How the forward asks the cache whether it continues a state (`nnterp.recurrent.labels.cache_test`).
    CACHE_TEST = Label()

    attention_output = module_output("the mixer's output, [batch, seq, hidden]", Hidden)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(RecurrentMixer, self).__init__(*args, **kwargs)
        track(self)

    def __getstate__(self) -> dict:
        # Pickled only to travel with a remote request: the copy a server rebuilds runs where routing cannot reach.
        state = without_labels(type(self), super(RecurrentMixer, self).__getstate__())
        state[REMOTE] = True
        return state

    # -- labels, found once per HF mixer class ---------------------------------------

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        """This release's labels in ``hf_mixer``'s forward and kernels (`nnterp.recurrent.labels.labels_for` caches them)."""
        modeling = modeling_of(hf_mixer)
        labels = {
            "CHUNK_KERNEL": call_label(hf_mixer.forward, cls.CHUNK_FUNCTION),
            "RECURRENT_KERNEL": call_label(hf_mixer.forward, cls.RECURRENT_FUNCTION),
            "CACHE_TEST": cache_test(hf_mixer.forward, required=cls.CACHE_TEST_REQUIRED),
            "STATE_OP": None,
            "STEP_STATE_OP": None,
        }
        if cls.STATE_VARIABLE:
            labels["STATE_OP"] = state_label(cls.loop_body(modeling), cls.STATE_VARIABLE, in_loop=True)
            if cls.ONE_STEP_DECODE:
                step = original_body(modeling, cls.RECURRENT_FUNCTION)
                labels["STEP_STATE_OP"] = state_label(step, cls.STATE_VARIABLE, in_loop=False)
        return labels

    @classmethod
    def loop_body(cls, modeling: Any) -> Callable:
        """The pure-torch kernel that loops over tokens: the decode kernel, or the prompt's when the decode is one step."""
        return original_body(modeling, cls.CHUNK_FUNCTION if cls.ONE_STEP_DECODE else cls.RECURRENT_FUNCTION)

    def loop_function(self) -> Callable:
        """`loop_body` of this mixer's modeling module."""
        return type(self).loop_body(modeling_of(self._module))

    def hf_module(self) -> Any:
        """The transformers module this envoy wraps."""
        return self._module

    # -- which call, which kernel ----------------------------------------------------

    def continues_cache(self, cache: Any) -> bool:
        """The forward's test that the call continues a cached state (before the forward touches the cache)."""
        if cache is None:
            return False
        if self.CACHE_TEST == "has_previous_state()":
            return bool(cache.has_previous_state())
        if hasattr(cache, "get_recurrent_state"):
            return cache.get_recurrent_state(self._module.layer_idx) is not None
        return bool(cache.has_previous_state(self._module.layer_idx))

    def _call(self) -> dict:
        """This call's inputs, read once per call at the mixer's input: the first request of every value."""
        return per_call(self, "inputs", lambda: Call.entry(self, (self.CHUNK_KERNEL, self.RECURRENT_KERNEL)))

    @staticmethod
    def KERNEL(envoy: RecurrentMixer) -> str:
        """The kernel call that fires on this call of the mixer, decided once per call (`per_call`).

        The forward's own test (`kernel_of`), applied to the call's inputs, which fire on every call (several tokens
        over a cached state run the prompt's kernel), so a step of ``tracer.iter`` is pinned by its first read.
        """
        envoy.kernel_source()  # instrument the forward before it runs; see routing for why the moment matters
        return per_call(envoy, "kernel", lambda: envoy.kernel_of(envoy._call()))

    def kernel_of(self, entry: dict) -> str:
        """`KERNEL`'s test on a call's entry (`Call.entry`): one token over a cached state decodes."""
        return self.RECURRENT_KERNEL if entry["continues"] and entry["seq"] == 1 else self.CHUNK_KERNEL

    @staticmethod
    def kernel(attribute: str) -> Key:
        """A key at whichever kernel fires on this call: ``source.<KERNEL>.<attribute>``."""
        suffix = {"inputs": "input", "input": "input", "output": "output"}[attribute]

        def at_kernel(envoy: RecurrentMixer) -> str:
            return f"source.{envoy.KERNEL(envoy)}.{suffix}"

        return Key(at_kernel, f"kernel.{attribute}")

    def record(self) -> Call:
        """This call's `Call`, made when the kernel starts (decodes: `kernel_of`'s test, also for RWKV-4's one kernel)."""

        def make() -> Call:
            entry = self._call()  # reads the mixer's input: instruments the call source first (`KERNEL`)
            kernel = self.kernel_of(entry)
            decodes, op = entry.get("decodes", entry["continues"] and entry["seq"] == 1), getattr(self.kernel_source(), kernel)
            return Call.at_start(self, kernel, op, decodes, entry["kernels"][kernel], self.SEQ_ARGUMENT)

        return per_call(self, "call", make)

    def kernel_source(self) -> Any:
        """The call source: the ``.source`` whose op is the kernel call (the forward's; a method call's, RG-LRU)."""
        return self.source

    def kernel_function(self) -> Callable:
        """What a split call runs (`Mixer.kernel_function`): ``CHUNK_FUNCTION`` as bound in the modeling module now."""
        return vars(modeling_of(self._module))[self.CHUNK_FUNCTION]

    # -- the kernel's arguments by name (the record serves and assigns them: `Call.serve`, `Call.assign`) --

    def argument(self, name: str) -> Any:
        """Any argument of this call's kernel by its signature-table name, tokens first; ``None`` where it takes none."""
        names = set(type(self).CHUNK_ARGUMENTS) | set(type(self).RECURRENT_ARGUMENTS)
        if name not in names:
            raise InvalidArgument(f"`linear_attn.argument` takes one of {sorted(names)}, got {name!r}")
        reason = unreadable_call(self)
        if reason is not None:
            raise Unavailable(f"linear_attn.argument({name!r})", reason)
        mediator(f"`linear_attn.argument({name!r})`")
        return self.record().serve(name)

    def state_shape(self, call: Call) -> tuple:
        """One state's shape in this call, ``(batch, ...)``: the decode buffer's, or the component's formula."""
        return tuple(call.serve("state").shape) if call.one_step else self._prompt_state_shape(call)

    def _prompt_state_shape(self, call: Call) -> tuple:
        raise NotImplementedError

    # -- the state entering and leaving the call (the record's: `Call.state_input`, `Call.state_output`) --

    def _state_input(self) -> torch.Tensor | None:
        return self.record().state_input()

    def _assign_state_input(self, value: Any) -> None:
        self.record().assign_state_input(value)

    def read_state_output(self) -> torch.Tensor:
        """The state after this call's last token."""
        return self.record().state_output()

    def write_state_output(self, value: Any) -> None:
        """Make ``value`` the state after this call's last token."""
        self.record().write_state_output(value)

    state_input = DerivedEProperty(
        _state_input, assign=_assign_state_input, key=kernel.__func__("inputs"),
        description="the state entering this call (None on a fresh prompt), a copy; assign to continue from another",
        unavailable=unreadable_call, annotation=State, none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        read_state_output, assign=write_state_output, key=kernel.__func__("output"),
        description="the state after this call's last token", unavailable=final_state_reason, annotation=State,
    )

    # -- effective attention: o_t = Σ_s A[t, s] v_s (+ the entering state's readout), per head or channel --

    def _effective(self, positions: Any, selection: Any, coefficients: bool) -> tuple:
        """``(A, readout)`` of this call (`Call.effective`); a component adjusts the readout here."""
        return self.record().effective(positions, selection, coefficients)

    effective_attention = DerivedEProperty(
        lambda envoy: envoy._effective(None, None, True)[0],
        description=(
            "the exact effective attention A[t, s]: the kernel's output at t is sum_s A[t, s] * attention_values[s] "
            "(+ state_input_readout), [batch, mixer_heads, seq, seq], float32; 4*batch*mixer_heads*seq^2 bytes "
            "(effective_attention_of(positions=...) keeps it bounded)"
        ),
        unavailable=per_token.effective_reason, annotation=EffectiveAttention,
    )
    state_input_readout = DerivedEProperty(
        lambda envoy: envoy._effective(None, None, False)[1],
        description=(
            "the part of the kernel's output read from the state entering the call (the rest of it is "
            "sum_s effective_attention[t, s] * attention_values[s]), [batch, seq, mixer_heads, value_dim]; None on a fresh prompt"
        ),
        unavailable=per_token.effective_reason, annotation=Values, none_on_fresh_prompt=True,
    )

    def effective_attention_of(self, positions: Any = None, heads: Any = None, channels: Any = None) -> torch.Tensor:
        """Rows ``positions`` of `effective_attention`, for some heads (Mamba-1, RG-LRU, RWKV: ``channels``) only,
        ``[batch, len(heads or channels), len(positions), seq]``, float32 (``4 · batch · heads · positions · seq``
        bytes). Each of them: ``None`` (all), an int, a slice, a range, a list or a tensor of indices (negative
        count from the end), in the order given, checked as `nnterp.core.indices` checks; the other axis raises."""
        what = "linear_attn.effective_attention_of"
        reason = per_token.effective_reason(self)
        if reason is not None:
            raise Unavailable(what, reason)
        mediator(f"`{what}`")
        return self._effective(*self.record().effective_selection(positions, heads, channels, what), True)[0]

    # -- which values carry a gradient (`nnterp.recurrent.gradient_support`) ------------------

    def gradients(self) -> dict[str, str | None]:
        """Per value, ``None`` where its ``.grad`` is served now, else why not (``support()``'s ``.grad`` rows)."""
        shared = type(self).values()["state_input"].compute is RecurrentMixer._state_input and not type(self).ONE_STEP_DECODE
        return gradient_reasons(self, shared)

    # -- the state after every token: one declaration, served by the chosen strategy (`nnterp.recurrent.per_token`) --

    def _token_op(self) -> Any:
        """``(op, first, seq)`` of this call: the binding of its per-token states, its first occurrence, its length."""
        return per_token.token_op(self)

    state = DerivedEProperty(
        per_token.iterated_state, assign=per_token.assign_iterated_state, key=Key(per_token.token_state_op, "_token_state_op"),
        description="the state after a token of the prompt, one occurrence per token (tracer.iter; under generate, the state each step leaves), [batch, ...state]; needs route_kernels(family, 'torch')",
        unavailable=per_token.iteration_reason, annotation=State,
    )
    states = DerivedEProperty(
        per_token.every_state, key=Key(per_token.every_state, "_states"),
        description="The recurrent state after every token of this call; needs route_kernels(family, 'torch')",
        unavailable=per_token.per_token_reason, annotation=States,
    )

    def state_after(self, t: int) -> torch.Tensor:
        """The state after token ``t`` of this call (negative ``t`` counts from the end): as ``for _ in
        tracer.iter[t]: mix.state`` on a prompt, and one that counts from the call's own first token on a decode step."""
        return once_per_call(self, STRATEGY, per_token.strategy_for).state_after(self, t)

    def states_of(self, positions: Any) -> torch.Tensor:
        """``states[:, positions]`` of this call only, ``[batch, len(positions), ...state]``, float32; ``positions``: a
        sequence of ints (a list, a tuple, a range, a 1-d tensor), negative ones counting from the call's end, in the
        order given (repeats allowed). With `FromArguments` only the tokens up to the last selected one are computed, in
        memory the selection plus one block. Order: as `state_after` at each. Gradients: a new tensor the model does
        not read, so its ``.grad`` never comes; read ``states.grad`` or ``state_after(t).grad``."""
        strategy = once_per_call(self, STRATEGY, per_token.strategy_for)
        if type(self).state_after is not RecurrentMixer.state_after and not isinstance(strategy, per_token.FromArguments):
            strategy = per_token.OWN_STATE_AFTER  # a kind's own state_after (the RG-LRU's decode step)
        return strategy.states_of(self, positions)

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """Assign the state after token ``t``: the tokens after it continue from ``value``.

        Token ``t`` itself is left as it was (its output read the state it computed), as when a cache holding
        the prefix's state is replaced before the rest is fed; ``state_after(t)`` then reads ``value``. On the
        call's last token the kernel returns ``value`` as its final state, which the next decode step starts
        from. Assigning `state` under ``tracer.iter[t]`` is this write, on every mixer. Reads follow the forward:
        in the same trace, read positions before ``t`` before the write and positions after it afterwards;
        `states` (every position) only before it.
        """
        once_per_call(self, STRATEGY, per_token.strategy_for).set_state_after(self, t, value)

    # -- the hooks a strategy calls (`nnterp.recurrent.per_token.protocol.Mixer`), defaults a kind overrides --

    def loop_source(self, op: Any) -> Any:
        """The source of the token loop inside kernel call ``op`` (RWKV's kernel calls its loop: one level further)."""
        return drill(op)

    #: A kind's own hooks (`Mixer` documents each), or ``None``: ``token_state`` (else the token loop reads the op),
    #: and `FromArguments`' ``fast_arguments`` (else the kernel's named arguments), ``run_kernel`` (else its split cuts
    #: them for `kernel_function`).
    token_state: Callable | None = None
    fast_arguments: Callable | None = None
    run_kernel: Callable | None = None

    def token_ops(self, call: Call, position: int) -> list:
        """The ops `token_state` reads the state after ``position`` from: the order check asks that none has passed it."""
        return [call.strategy["op"]]

    def kernel_reason(self) -> str | None:
        """Why this mixer's kernel has no Python loop to read, beyond the bindings `needs_torch_kernels` checks."""
        return None

    def pure_torch_kernel(self) -> bool:
        return runs_pure_torch(self)  # no optimized kernel, no hub module bound (`Mixer.pure_torch_kernel`)

    def continue_op(self, call: Call) -> Any:
        """The per-token op whose occurrence ``t + 1`` `continue_from` writes at (the state op by default)."""
        return call.strategy["op"]

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        """Make token ``position + 1`` of this call start from ``value`` (the mixer's own update rule)."""
        raise NotImplementedError(f"{type(self).__name__} does not write the state inside a call")

    def log_decays(self) -> torch.Tensor:
        """The call's log decays, tokens first (≤ 0), where a write is carried through them (Mamba-2)."""
        raise NotImplementedError(f"{type(self).__name__} carries no write through its decays")


#: ``kernel(attribute)``, the key function values are declared on (`RecurrentMixer.kernel`).
kernel = RecurrentMixer.kernel


def kernel_argument(name: str, description: str, annotation: Any) -> DerivedEProperty:
    """A declared value: argument ``name`` of whichever kernel fires, tokens first, laid back on write.

    Served from the call's record (read once, when the kernel starts), so it can be read at any point of the
    call; a write replaces the argument and must come before the kernel starts.
    """
    return DerivedEProperty(
        lambda envoy: envoy.record().serve(name), assign=lambda envoy, view: envoy.record().assign(name, view),
        key=kernel("inputs"), description=description, unavailable=unreadable_call, annotation=annotation,
    )
