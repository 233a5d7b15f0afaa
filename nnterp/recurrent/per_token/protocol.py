"""`PerToken`: what every per-token strategy serves, on one call of one mixer."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...core.calls import mediator
from ...core.errors import Unavailable


class TokenOp(NamedTuple):
    """``(op, first, seq)``: the state binding under this call's kernel, its first token's occurrence, the call's length."""

    op: Any
    first: int
    seq: int


class PerToken:
    """How one strategy serves the state after every token of a mixer's call.

    Every method takes the mixer envoy and works on its current call's
    `nnterp.recurrent.call.Call` (``mixer._record()``); positions count from
    the call's own first token, negative from its end.
    """

    #: Shown in reprs and docs.
    name = "per-token strategy"

    def unavailable(self, mixer: Any) -> str | None:
        """Why this strategy cannot serve the mixer now (routing, kernels, settings), or ``None``."""
        raise NotImplementedError

    def states(self, mixer: Any) -> torch.Tensor:
        """The state after every token of this call, ``[batch, seq, ...state]``."""
        raise NotImplementedError

    def state_after(self, mixer: Any, t: int) -> torch.Tensor:
        """The state after token ``t`` of this call."""
        raise NotImplementedError

    def states_of(self, mixer: Any, positions: Any) -> torch.Tensor:
        """The states after tokens ``positions`` only, ``[batch, len(positions), ...state]``, in the order given.

        By default `state_after` at each distinct position in increasing order
        (the order the run reaches them; a token loop pins only those
        occurrences), then arranged as asked.
        """
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable("linear_attn.states_of", reason)
        mediator("`linear_attn.states_of`")
        call = mixer._record()
        chosen = call.positions(positions, "states_of(positions)")
        if not chosen:
            shape = call.expected[0]
            return torch.empty((shape[0], 0, *shape[1:]), device=call.expected[2])
        found = {p: self.state_after(mixer, p) for p in sorted(set(chosen))}
        return torch.stack([found[p] for p in chosen], 1)

    def set_state_after(self, mixer: Any, t: int, value: torch.Tensor) -> None:
        """Make the tokens after ``t`` continue from ``value``; token ``t``'s own output stays as computed."""
        raise NotImplementedError

    def token_op(self, mixer: Any) -> Any:
        """``(op, first, seq)``: the binding holding this call's per-token states, its first occurrence, the call's length."""
        raise NotImplementedError

    def state(self, mixer: Any) -> torch.Tensor:
        """The state after the token ``tracer.iter`` pins (``mix.state``)."""
        raise NotImplementedError

    def set_state(self, mixer: Any, value: torch.Tensor) -> None:
        """Assign ``mix.state`` under ``tracer.iter``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name}>"
