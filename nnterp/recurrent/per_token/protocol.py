"""The two sides of a per-token strategy: `Mixer`, what it reads from a mixer, and `PerToken`, what it serves.

A strategy (`TokenLoop`, `ChunkBoundaries`, `FromArguments`) works on one
call of one mixer envoy, through the names `Mixer` declares and nothing else:
the component (``nnterp/components/``) implements them (`RecurrentMixer` the
defaults, a kind overriding the few hooks its kernel needs), the strategy
calls them. Conventions, stated once: a ``call`` is the mixer's current
`nnterp.recurrent.call.Call`; a ``position`` counts from the call's own first
token; an ``occurrence`` is nnsight's count of an op's firings in the run, so
token ``t`` of the call is occurrence ``call.strategy["first"] + t`` of its
per-token op; a state is ``[batch, ...state]`` float32 (``call.expected``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ...core.calls import mediator
from ...core.errors import Unavailable
from ..call import Call


class Mixer(Protocol):
    """Everything a per-token strategy reads from a recurrent mixer envoy (`RecurrentMixer` implements it)."""

    #: nnsight's: the envoy's path in the model, and its forward's operations (``source.<label>``).
    path: str
    source: Any
    #: The component's declarations (`RecurrentMixer` documents each): its fast path, the prompt kernel's
    #: signature table and module-level name, which element of the kernel's return is the final state, and
    #: whether the prompt kernel is Mamba-2's chunk scan.
    FAST: Any
    EFFECTIVE: Any
    #: What ``FAST`` reads beside the kernel call's arguments: spec name -> attribute path on `hf_module` (the module's
    #: constants the call does not carry: the mLSTM backend's ``{"eps": "mlstm_backend.config.eps"}``); ``{}`` mostly.
    FAST_CONSTANTS: dict
    #: Whether `FromArguments` is the kind's own strategy, whatever the setting: its kernel has no per-token location
    #: to read (the mLSTM's backend, lightning attention's forward) or holds none (the short convolution's windows,
    #: exact slices of the call's input).
    STATES_FROM_ARGUMENTS: bool
    #: A kind's own strategy's one pass (RWKV-4's loop, its fast path's), run by the one
    #: switch (`nnterp.recurrent.per_token.from_arguments.one_pass`) as a `FastSpec`'s ``one_pass``; or ``None``.
    OWN_ONE_PASS: Any
    CHUNK_ARGUMENTS: dict
    CHUNK_FUNCTION: str
    #: ``None`` where the kernel's return holds no final state (the forward keeps it itself: `leave_state`).
    FINAL_STATE: int | None
    CHUNKED_SCAN: bool
    #: The labels (`nnterp.recurrent.labels`): the state bound once per token in the token loop, the new state in a
    #: one-step decode kernel, and the chunk scan's boundary states (Mamba-2 only).
    STATE_OP: str | None
    STEP_STATE_OP: str | None
    BOUNDARY_OP: str | None

    def record(self) -> Call:
        """This call's record: the kernel call, its arguments by name (`Call.serve`, `Call.assign`), the order
        book, and ``call.strategy``, the strategy's own per-call data. Made once per call, at the kernel's start."""

    def hf_module(self) -> torch.nn.Module:
        """The transformers module the envoy wraps (its ``chunk_size``, its modeling module)."""

    def loop_function(self) -> Callable:
        """The pure-torch token-by-token kernel of this mixer's modeling module (what routing binds a prompt to)."""

    def loop_source(self, op: Any) -> Any:
        """The ``.source`` holding the token loop inside kernel call ``op`` (the state op's parent)."""

    #: A kind's own ``token_state(call, occurrence)``: the state after the token at ``occurrence`` of the state op
    #: (``None``: the next one), ``[batch, ...state]``, where it is not that op's one output (RWKV: three bindings);
    #: ``None`` (`RecurrentMixer`'s default): the strategy reads the state op's output itself, every token in one pass.
    token_state: Callable[[Call, int | None], torch.Tensor] | None

    def token_ops(self, call: Call, position: int) -> list:
        """The ops `token_state` reads the state after ``position`` from; the order check asks none has passed it."""

    def continue_op(self, call: Call) -> Any:
        """The per-token op whose occurrence for token ``position + 1`` `continue_from` writes at."""

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        """Make token ``position + 1`` start from state ``value`` (the kind's own update rule), its readout of
        token ``position`` left as computed."""

    def log_decays(self) -> torch.Tensor:
        """The call's log decays, ``[batch, seq, heads]`` (≤ 0; the state is multiplied by their ``exp``): how a
        write is carried to later chunk boundaries (Mamba-2)."""

    def read_state_output(self) -> torch.Tensor:
        """The state after the call's last token (a decode step's new state), ``[batch, ...state]``."""

    def write_state_output(self, value: torch.Tensor) -> None:
        """Make ``value`` the state after the call's last token (what the next call starts from)."""

    def state_after(self, t: int) -> torch.Tensor:
        """The mixer's ``state_after`` (a component serving its states its own way overrides it)."""

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """The mixer's ``set_state_after`` (``state`` under ``generate`` is the step's last token)."""

    def pure_torch_kernel(self) -> bool:
        """Whether the prompt's kernel call runs transformers' own pure-torch body now (what a one pass replaces)."""

    def kernel_function(self) -> Callable:
        """The prompt kernel as its call source calls it: the function bound to ``CHUNK_FUNCTION`` in the modeling
        module, or a method call's method bound to its module (the RG-LRU's ``_rnn_scan``, the mLSTM's backend's
        ``forward``); a split call runs it."""

    #: A kind's own ``fast_arguments(call)``: the call's arguments as its ``FAST`` spec takes them, tokens first (the
    #: short convolution's input cut to the call's own tokens, and the window entering it); ``None``
    #: (`RecurrentMixer`'s default): the kernel's named arguments (`Call.serve_all`).
    fast_arguments: Callable[[Call], dict] | None

    #: A kind's own ``run_kernel(call, lo, hi, initial)``: its kernel on tokens ``[lo, hi)`` of ``call``, from state
    #: ``initial``, returning what the kernel call returns for those tokens, so a split call is its parts' returns
    #: joined (the mLSTM's backend; the short convolution's input with ``initial`` as its window). ``None``
    #: (`RecurrentMixer`'s default): `FromArguments` cuts the kernel's arguments and runs `kernel_function`.
    run_kernel: Callable[[Call, int, int, Any], Any] | None

    def leave_state(self, call: Call, value: torch.Tensor) -> None:
        """Make ``value`` the state the call leaves (what the next call starts from), where the kernel's return
        holds none (``FINAL_STATE`` is ``None``: LFM2's forward caches its window before the kernel runs)."""

    def kernel_reason(self) -> str | None:
        """Why the bound kernel has no Python loop to read, beyond the bindings ``needs_torch_kernels`` checks."""

    @classmethod
    def values(cls) -> dict:
        """The component's declared values, by name."""


class TokenOp(NamedTuple):
    """``(op, first, seq)``: the state binding under this call's kernel, its first token's occurrence, the call's length."""

    op: Any
    first: int
    seq: int


class PerToken:
    """How one strategy serves the state after every token of a mixer's call.

    Every method takes the mixer envoy (`Mixer`) and works on its current
    call's `nnterp.recurrent.call.Call` (``mixer.record()``); positions count
    from the call's own first token, negative from its end.
    """

    #: Shown in reprs and docs.
    name = "per-token strategy"

    def unavailable(self, mixer: Mixer) -> str | None:
        """Why this strategy cannot serve the mixer now (routing, kernels, settings), or ``None``."""
        raise NotImplementedError

    def states(self, mixer: Mixer) -> torch.Tensor:
        """The state after every token of this call, ``[batch, seq, ...state]``."""
        raise NotImplementedError

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        """The state after token ``t`` of this call."""
        raise NotImplementedError

    def states_of(self, mixer: Mixer, positions: Any) -> torch.Tensor:
        """The states after tokens ``positions`` only, ``[batch, len(positions), ...state]``, in the order given.

        By default `state_after` at each distinct position in increasing order
        (the order the run reaches them; a token loop pins only those
        occurrences), then arranged as asked.
        """
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable("linear_attn.states_of", reason)
        mediator("`linear_attn.states_of`")
        call = mixer.record()
        chosen = call.positions(positions, "states_of(positions)")
        if not chosen:
            shape = call.expected[0]
            return torch.empty((shape[0], 0, *shape[1:]), device=call.expected[2])
        found = {p: self.state_after(mixer, p) for p in sorted(set(chosen))}
        return torch.stack([found[p] for p in chosen], 1)

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        """Make the tokens after ``t`` continue from ``value``; token ``t``'s own output stays as computed."""
        raise NotImplementedError

    def token_op(self, mixer: Mixer) -> Any:
        """``(op, first, seq)``: the binding holding this call's per-token states, its first occurrence, the call's length."""
        raise NotImplementedError

    def state(self, mixer: Mixer) -> torch.Tensor:
        """The state after the token ``tracer.iter`` pins (``mix.state``)."""
        raise NotImplementedError

    def set_state(self, mixer: Mixer, value: torch.Tensor) -> None:
        """Assign ``mix.state`` under ``tracer.iter``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name}>"
