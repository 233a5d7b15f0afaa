"""The state after every token, declared once for every recurrent mixer: ``state``, ``states``, ``state_after``, ``set_state_after``.

`RecurrentMixer` binds these functions in its body (so the values keep their
place in its inventory) and each delegates to the strategy
`nnterp.recurrent.per_token` picks for this mixer of this model: the token
loop, Mamba-2's chunk boundaries, or the fast path.

``state`` is the one value tied to ``tracer.iter``: in a trace, the loop's
index is a token of the prompt call (a location with one occurrence per
token, `iteration_strategy`); under ``generate`` it is a step, one forward call
each, and ``state`` is the state that step leaves (`generating`, set while
``StandardizedTransformer.interleave`` runs ``generate``). A component with no
such location (lightning attention, the mLSTM, LFM2) says so in ``support()``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..recurrent.per_token import iteration_strategy, strategy_for
from ..recurrent.per_token.loop import TOKEN_LOOP, TokenOp
from ..recurrent.settings import generating


def per_token_reason(mixer: Any) -> str | None:
    """Why ``states`` / ``state_after`` / ``set_state_after`` cannot be served now (the strategy's reason)."""
    return strategy_for(mixer).unavailable(mixer)


def iteration_reason(mixer: Any) -> str | None:
    """Why ``state`` under ``tracer.iter`` cannot be served now."""
    return iteration_strategy(mixer).unavailable(mixer)


def token_state_op(mixer: Any) -> str:
    """The ``tracer.iter`` location of ``state`` (one occurrence per token), relative to the mixer."""
    return TOKEN_LOOP.location(mixer)


def token_op(mixer: Any) -> TokenOp:
    """``(op, first, seq)`` of this call: the binding of its per-token states, its first occurrence, the call's length."""
    return iteration_strategy(mixer).token_op(mixer)


def iterated_state(mixer: Any) -> torch.Tensor:
    if generating(mixer):
        # tracer.iter counts generate's steps, one call of the mixer each: the state that step leaves.
        return mixer.state_after(-1)
    return iteration_strategy(mixer).state(mixer)


def assign_iterated_state(mixer: Any, value: torch.Tensor) -> None:
    if generating(mixer):
        mixer.set_state_after(-1, value)
        return
    iteration_strategy(mixer).set_state(mixer, value)


def every_state(mixer: Any) -> torch.Tensor:
    return strategy_for(mixer).states(mixer)


def state_after(self: Any, t: int) -> torch.Tensor:
    """The state after token ``t`` of this call (negative ``t`` counts from the end).

    As ``for _ in tracer.iter[t]: mix.state`` on a prompt, and one that
    counts from the call's own first token on a decode step.
    """
    return strategy_for(self).state_after(self, t)


def set_state_after(self: Any, t: int, value: torch.Tensor) -> None:
    """Assign the state after token ``t``: the tokens after it continue from ``value``.

    Token ``t`` itself is left as it was (its output read the state it
    computed), as when a cache holding the prefix's state is replaced
    before the rest is fed; ``state_after(t)`` then reads ``value``. On
    the call's last token the kernel returns ``value`` as its final state,
    which the next decode step starts from. Assigning `state` under
    ``tracer.iter[t]`` is this write, on every mixer.

    Reads follow the forward: in the same trace, read positions before
    ``t`` before the write and positions after it afterwards; `states`
    (every position) only before it.
    """
    strategy_for(self).set_state_after(self, t, value)


__all__ = [
    "per_token_reason", "iteration_reason", "token_state_op", "token_op", "iterated_state", "assign_iterated_state",
    "every_state", "state_after", "set_state_after",
]
