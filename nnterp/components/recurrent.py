"""RecurrentMixer: how a recurrent mixer's values are reached, whatever the values are.

A recurrent mixer (a gated DeltaNet, a state-space layer) runs its sequence
through a kernel function the modeling module calls: one kernel for a prompt,
another for a one-token step over a cached state (a decode step of
``generate``), picked by the forward's own test. Its values are the arguments
and results of that call. What differs between mixers is which arguments mean
what; what they share is how the call is found, which kernel names must be
transformers' pure-torch ones for there to be a call to read inside, how the
family's kernels are rebound (`route_kernels`), and, when the token-by-token
kernel materializes it, the state after every token. That shared part is
`RecurrentMixer`; a subclass (`LinearAttention`, `SelectiveScan`,
`StateSpace`) names its kernels in class constants and declares its values.

Conventions, stated once: ``seq`` is the tokens of *this call* (the prompt, or
the one token of a decode step), and every per-token position ``t`` counts
from the call's own first token. A state is float32 whatever the model's dtype.

Failure mode worth knowing: a worker reads in the order the model runs. The
state after token ``t`` exists only while the kernel runs, so per-token reads
and writes come after the kernel's arguments and before ``state_output`` /
``attention_output`` of the same call, and positions in increasing order.
nnsight silently drops a request for a position already passed; nnterp raises
`OrderError` naming the read that came first.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..core.calls import mediator, per_call, pinned
from ..core.dims import State, States
from ..core.errors import NnterpError, OrderError, Unavailable
from ..core.standard import Standard
from nnsight.intervention.interleaver import Mediator

from ..core.values import DerivedEProperty, EProperty, Key, check_expected, replace_in
from . import kernels
from .attention import unwrapped_output
from .routing import route_delta_rule, route_kernels  # noqa: F401  (documented here)


class TokenOp:
    """`RecurrentMixer._token_op`'s record for one call: where the per-token state is, and what was read."""

    __slots__ = ("op", "first", "seq", "kernel", "source", "output_at", "expected", "furthest", "written")

    def __init__(self, op: Any, first: int, seq: int, kernel: Any, source: Any, output_at: int, expected: tuple) -> None:
        self.op, self.first, self.seq, self.kernel, self.source = op, first, seq, kernel, source
        self.output_at = output_at
        self.expected = expected
        self.furthest: Optional[tuple[int, str]] = None
        self.written: dict[int, torch.Tensor] = {}

    def __iter__(self):
        return iter((self.op, self.first, self.seq))


def needs_torch_kernels(envoy: Any) -> Optional[str]:
    """Why a recurrent mixer's kernel values are unavailable: the kernel has no Python source to read inside.

    The scan's kernels first, then the short convolution's: a compiled
    convolution (causal-conv1d) makes the same values unavailable, since its
    package refuses the run that would serve them until the family is routed.
    """
    modeling = kernels.modeling_of(envoy._module)
    cls = type(envoy)
    for name in (cls.CHUNK_FUNCTION, cls.RECURRENT_FUNCTION, *cls.CONV_FUNCTIONS):
        reason = kernels.optimized(modeling.__dict__.get(name))
        if reason is not None:
            return reason
    return None


def needs_recurrent_routing(envoy: Any) -> Optional[str]:
    """Why the per-token state is unavailable: only the token-by-token kernel materializes it."""
    cls = type(envoy)
    if cls.STATE_OP is None:
        return "this mixer's kernels do not materialize the state after each token"
    reason = needs_torch_kernels(envoy)
    if reason is not None:
        return reason
    modeling = kernels.modeling_of(envoy._module)
    # Through the dispatcher or bound bare, what counts is the body a prompt runs (Mamba-1: the loop already).
    if kernels.torch_function(modeling.__dict__.get(cls.CHUNK_FUNCTION)) is not cls.loop_function(modeling):
        return (
            "the state after each token is materialized only by the token-by-token kernel; the chunked kernel a "
            "prompt runs through carries it between chunks. Call nnterp.route_kernels(model.family, 'torch') "
            "before tracing this layer (slower, like attn_implementation='eager')"
        )
    return None


class RecurrentMixer(Standard):
    """A sequence mixer with a recurrent state, read at the kernel call its forward makes.

    A subclass names its kernels and declares its values at
    ``kernel("inputs")`` / ``kernel("output")``:

    * ``CHUNK_FUNCTION`` / ``RECURRENT_FUNCTION``: the module-level names of
      the prompt's and the decode step's kernels; ``CHUNK_KERNEL`` /
      ``RECURRENT_KERNEL`` are their calls' labels in the forward.
    * ``BRANCH``: the binding the forward tests before it picks a kernel,
      true when the call continues a cached state (found per release:
      ``use_precomputed_states_0`` up to 5.20, ``recurrent_state_0`` after).
    * ``SEQ_OP``: the forward's masking of its input, once per call.
    * ``STATE_OP``: inside the token-by-token kernel, the binding of the state
      after each token's update; ``None`` when the kernels never materialize it.
    * ``STEP_STATE_OP``: set when the decode kernel is a single-step update
      rather than the token loop (Mamba-1): the binding of the new state in it.
      The prompt's kernel is then the token loop.

    ``KERNEL`` names the call that fires on this call of the mixer, decided
    once per call by the forward's own test, so the same values work in a
    trace and at every step of ``tracer.iter``. The state after every token
    of a prompt exists only in the token-by-token kernel;
    ``nnterp.route_kernels(model.family, "torch")`` routes the family's
    prompts through it (like eager attention, the user's choice), and then
    `state`, `states`, `state_after` and `set_state_after` read and write
    the state at any position.
    """

    KIND = "linear_attn"
    CHUNK_FUNCTION: str = ""
    RECURRENT_FUNCTION: str = ""
    CONV_FUNCTIONS: tuple = ("causal_conv1d_fn", "causal_conv1d_update")
    CHUNK_KERNEL: str = ""
    RECURRENT_KERNEL: str = ""
    BRANCH: str = "use_precomputed_states_0"
    SEQ_OP: str = "apply_mask_to_padding_states_0"
    STATE_OP: Optional[str] = None
    STEP_STATE_OP: Optional[str] = None
    #: The variable holding the state inside the kernels (to find the labels).
    STATE_VARIABLE: str = ""

    attention_output = unwrapped_output("the mixer's output, [batch, seq, hidden]")

    # -- which call, which kernel --------------------------------------------

    @classmethod
    def resolve(cls, hf_mixer: type) -> None:
        """Find this release's labels from ``hf_mixer``'s forward and kernels (at import).

        A release that moved a label fails here, naming the value and the
        release, rather than serving the wrong binding.
        """
        modeling = kernels.modeling_of(hf_mixer)
        cls.CHUNK_KERNEL = kernels.call_label(hf_mixer.forward, cls.CHUNK_FUNCTION)
        cls.RECURRENT_KERNEL = kernels.call_label(hf_mixer.forward, cls.RECURRENT_FUNCTION)
        cls.BRANCH = "use_precomputed_states_0" if kernels.has_label(hf_mixer.forward, "use_precomputed_states_0") else "recurrent_state_0"
        if cls.STATE_VARIABLE:
            loop = cls.loop_function(modeling)
            cls.STATE_OP = kernels.state_label(loop, cls.STATE_VARIABLE, in_loop=True)
            if cls.STEP_STATE_OP is not None:
                step = getattr(modeling, cls.RECURRENT_FUNCTION)
                cls.STEP_STATE_OP = kernels.state_label(step, cls.STATE_VARIABLE, in_loop=False)

    @classmethod
    def loop_function(cls, modeling: Any) -> Callable:
        """The pure-torch kernel that loops over tokens: the decode kernel, or the prompt's when the decode is one step."""
        name = cls.CHUNK_FUNCTION if cls.STEP_STATE_OP is not None else cls.RECURRENT_FUNCTION
        stash = modeling.__dict__.get("_nnterp_kernels", {})
        return kernels.torch_function(stash.get(name, modeling.__dict__[name]))

    @classmethod
    def continues_cache(cls, module: Any, cache: Any) -> bool:
        """The forward's test that the call continues a cached state (before the forward touches the cache)."""
        if cache is None:
            return False
        if hasattr(cache, "get_recurrent_state"):
            return cache.get_recurrent_state(module.layer_idx) is not None
        return bool(cache.has_previous_state(module.layer_idx))

    def _call(self) -> dict:
        """This call's inputs, read once per call at the mixer's input: the first request of every value."""

        def read() -> dict:
            args, kwargs = self.inputs
            bound = kernels.signature_binding(type(self._module).forward, self._module, args, kwargs)
            hidden = bound.get("hidden_states", args[0] if args else None)
            cache = bound.get("cache", bound.get("cache_params"))
            continues = type(self).continues_cache(self._module, cache)
            med = mediator()
            # How often each kernel has started before this call: a later request
            # for its arguments past that count would land in the next call.
            kernels_before = {
                label: med.occurrence(f"{self.path}.source.{label}.input")
                for label in (type(self).CHUNK_KERNEL, type(self).RECURRENT_KERNEL)
            }
            return {"seq": hidden.shape[1], "cache": cache, "continues": continues, "kernels": kernels_before}

        return per_call(self, "inputs", read)

    @staticmethod
    def KERNEL(envoy: "RecurrentMixer") -> str:
        """The kernel call that fires on this call of the mixer, decided once per call (`per_call`).

        The forward's own test: the token-by-token update for one token over a
        cached state, the prompt's kernel for everything else (several tokens
        over a cached state included). It is applied to the call's inputs,
        which fire on every call, so a step of ``tracer.iter`` is pinned by its
        first read whatever the user reads first.
        """
        cls = type(envoy)

        def choose() -> str:
            call = envoy._call()
            return cls.RECURRENT_KERNEL if call["continues"] and call["seq"] == 1 else cls.CHUNK_KERNEL

        envoy.source  # instrument the forward before it runs; see routing for why the moment matters
        return per_call(envoy, "kernel", choose)

    @staticmethod
    def kernel(attribute: str) -> Key:
        """A key at whichever kernel fires on this call: ``source.<KERNEL>.<attribute>``."""
        suffix = {"inputs": "input", "input": "input", "output": "output"}[attribute]

        def at_kernel(envoy: RecurrentMixer) -> str:
            return f"source.{type(envoy).KERNEL(envoy)}.{suffix}"

        return Key(at_kernel, f"kernel.{attribute}")

    # -- the state after every token -----------------------------------------

    def _seq(self, args: tuple, kwargs: dict) -> int:
        """The kernel call's number of tokens (a DeltaNet's queries' axis 1)."""
        return args[0].shape[1]

    def _state_shape(self, args: tuple, kwargs: dict) -> tuple:
        """The state's shape for this call, ``(batch, ...)``."""
        raise NotImplementedError

    def _state_op(self, kernel: str) -> str:
        """The per-token state binding inside ``kernel``."""
        cls = type(self)
        if kernel == cls.RECURRENT_KERNEL and cls.STEP_STATE_OP is not None:
            return cls.STEP_STATE_OP
        return cls.STATE_OP

    def _token_op(self) -> TokenOp:
        """``(op, first, seq)`` of this call, computed once per call.

        ``op`` is the state binding under the drilled kernel, ``seq`` the
        call's length and ``first`` the op's occurrence count when the kernel's
        arguments are read: the one moment that count is the number of tokens
        earlier calls of this run put through the op.
        """

        def compute() -> TokenOp:
            kernel = type(self).KERNEL(self)
            op = getattr(self.source, kernel)
            med = mediator()
            if med.occurrence(f"{op.path}.input") > self._call()["kernels"][kernel]:
                raise OrderError(self._order_hint("a per-token state", "this call's kernel had already run (state_output, attention_output or a later value was read first)"))
            args, kwargs = op.inputs
            source = self._drill(op)
            node = getattr(source, self._state_op(kernel))
            expected = (self._state_shape(args, kwargs), torch.float32, args[0].device)
            first = med.occurrence(f"{node.path}.output")
            return TokenOp(node, first, self._seq(args, kwargs), op, source, med.occurrence(f"{op.path}.output"), expected)

        return per_call(self, "call", compute)

    def _drill(self, op: Any) -> Any:
        """The source inside a kernel call: through the hub dispatcher when the name is not routed."""
        source = op.source
        if "implementation_0" in source.names and "torch_function_0" in source.names:
            source = source.implementation_0.source
        return source

    def _position(self, t: int, seq: int, what: str) -> int:
        if not isinstance(t, int) or isinstance(t, bool):
            raise NnterpError(f"{what} takes a token position (an int), got {type(t).__name__}")
        position = t + seq if t < 0 else t
        if not 0 <= position < seq:
            raise NnterpError(f"{what}: position {t} is outside this call's {seq} tokens (0..{seq - 1})")
        return position

    def _order_hint(self, asked: str, passed: str) -> str:
        return (
            f"{asked} was asked for after {passed}: a worker reads in the order the model runs, so in one trace "
            "read the kernel's arguments first, then per-token positions in increasing order (positions before a "
            "write, the write, then positions after it; `states` before any write), then `state_output` / "
            "`attention_output`, and a block's reads before any write to a later block"
        )

    def _visit(self, record: TokenOp, position: int, what: str, op: Any = None) -> None:
        """Raise unless the run can still reach ``position`` of this call (at ``op``, the state op by default)."""
        med = mediator()
        if med.occurrence(f"{record.kernel.path}.output") > record.output_at:
            raise OrderError(self._order_hint(what, "the kernel had returned (state_output or a later value was read)"))
        if med.occurrence(f"{(op or record.op).path}.output") > record.first + position:
            earlier = record.furthest[1] if record.furthest is not None else "an earlier read"
            raise OrderError(self._order_hint(what, f"{earlier} had moved the run past token {position}"))
        if record.furthest is None or position >= record.furthest[0]:
            record.furthest = (position, what)

    def _pinned_state(self, record: TokenOp, position: int) -> torch.Tensor:
        with pinned(record.first + position):
            return record.op.output

    def _states(self) -> States:
        record = self._token_op()
        self._visit(record, 0, "states")
        out = []
        for position in range(record.seq):
            out.append(self._pinned_state(record, position))
            record.furthest = (position, "states")
        return torch.stack(out, 1)

    def _token_state_op(self) -> str:
        with pinned(None):
            record = self._token_op()
        return record.op.path[len(self.path) + 1:] + ".output"

    state = EProperty(
        _token_state_op,
        description="the state after a token of the prompt, one occurrence per token (tracer.iter), [batch, ...state]; needs route_kernels(family, 'torch')",
        unavailable=needs_recurrent_routing,
        annotation=State,
    )
    states = DerivedEProperty(
        _states,
        description="The recurrent state after every token of this call; needs route_kernels(family, 'torch')",
        unavailable=needs_recurrent_routing,
        annotation=States,
    )

    def state_after(self, t: int) -> State:
        """The state after token ``t`` of this call (negative ``t`` counts from the end).

        As ``for _ in tracer.iter[t]: mix.state`` on a prompt, and one that
        counts from the call's own first token on a decode step.
        """
        self._require("state_after")
        record = self._token_op()
        position = self._position(t, record.seq, f"state_after({t})")
        if position in record.written:
            return record.written[position]
        self._visit(record, position, f"state_after({t})")
        return self._pinned_state(record, position)

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """Assign the state after token ``t``: the tokens after it continue from ``value``.

        Token ``t`` itself is left as it was (its output read the state it
        computed), as when a cache holding the prefix's state is replaced
        before the rest is fed; ``state_after(t)`` then reads ``value``. On
        the call's last token the kernel returns ``value`` as its final state,
        which the next decode step starts from. (Assigning `state` under
        ``tracer.iter[t]`` is the raw location: token ``t``'s readout uses it.)

        Reads follow the forward: in the same trace, read positions before
        ``t`` before the write and positions after it afterwards; `states`
        (every position) only before it.
        """
        self._require("set_state_after")
        record = self._token_op()
        position = self._position(t, record.seq, f"set_state_after({t})")
        what = f"set_state_after({t}, value)"
        check_expected(what, value, *record.expected)
        self._visit(record, position, what)
        if position + 1 < record.seq:
            self._continue_from(record, position, value, what)
        else:
            self._write_final(record, value)
        record.written[position] = value
        record.furthest = (position + 1, what)

    #: Which element of the kernel's return is the final state.
    FINAL_STATE = 1

    def _continue_from(self, record: TokenOp, position: int, value: torch.Tensor, what: str) -> None:
        """Make token ``position + 1`` of this call start from ``value`` (a mixer's own update rule)."""
        raise NotImplementedError(f"{type(self).__name__} does not write the state inside a call")

    def _write_final(self, record: TokenOp, value: torch.Tensor) -> None:
        """Make the kernel return ``value`` as the state after its last token."""
        location = f"{record.kernel.path}.output"
        raw = Mediator.value(location)
        Mediator.swap(location, replace_in(raw, type(self).FINAL_STATE, value))

    def _require(self, what: str) -> None:
        reason = needs_recurrent_routing(self)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")


#: ``kernel(attribute)``, the key function values are declared on (`RecurrentMixer.kernel`).
kernel = RecurrentMixer.kernel
