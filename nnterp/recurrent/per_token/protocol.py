"""`PerToken`: what every per-token strategy serves, on one call of one mixer."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


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
