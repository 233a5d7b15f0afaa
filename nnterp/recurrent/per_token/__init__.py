"""The state after every token: one protocol, three strategies, chosen in one place (`strategy_for`).

A prompt's kernel call computes every token's state, but which of them a
worker can reach depends on the kernel that runs:

* `TokenLoop` (``loop.py``): the token-by-token kernel binds the state after
  each token once per token; ``route_kernels(family, "torch")`` routes prompts
  through it. Reads pin each occurrence; writes replace it.
* `ChunkBoundaries` (``boundaries.py``): Mamba-2's chunk scan binds the state
  at every chunk boundary in one tensor; with every token a boundary
  (``chunk_per_token(model)``) that is the state after every token.
* `FromArguments` (``from_arguments.py``): the fast path
  (``fast_states(model)``): the states are computed from the kernel call's own
  arguments by `nnterp.fast`, and writes split the kernel call.

A kind whose states are always computed from its call's arguments
(``STATES_FROM_ARGUMENTS`` with a ``FAST`` spec: lightning attention, whose
recurrence is its forward's own operations, and the mLSTM, whose backend keeps
states only at chunk boundaries) has `FromArguments` as its own.

Each serves ``states``, ``state_after(t)``, ``set_state_after(t, value)`` and
``state`` (`PerToken`, ``protocol.py``) on one call of one mixer, keeping what
it learns in that call's `nnterp.recurrent.call.Call`, and says why it cannot
(``unavailable``), which is what `support()` reports. It reads the mixer
through the names `Mixer` (``protocol.py``) declares, nothing else.

`RecurrentMixer` declares the values; the functions below are what its
descriptors compute and check (``states``, ``state`` and their reasons).
``state`` is the one value tied to ``tracer.iter``: in a trace, the loop's
index is a token of the prompt call (a location with one occurrence per
token, `iteration_strategy`); under ``generate`` it is a step, one forward
call each, and ``state`` is the state that step leaves (`generating`, set
while ``StandardizedTransformer.interleave`` runs ``generate``).
"""

from __future__ import annotations

import torch

from ..kernels import unreadable_call
from ..settings import PER_TOKEN, generating
from .boundaries import CHUNK_BOUNDARIES, ChunkBoundaries
from .from_arguments import FROM_ARGUMENTS, FromArguments
from .loop import TOKEN_LOOP, TokenLoop
from .protocol import Mixer, PerToken, TokenOp

__all__ = [
    "Mixer", "PerToken", "TokenLoop", "ChunkBoundaries", "FromArguments", "OwnStateAfter", "TOKEN_LOOP", "OWN_STATE_AFTER", "FROM_ARGUMENTS",
    "strategy_for", "iteration_strategy", "per_token_reason", "iteration_reason", "effective_reason", "every_state",
    "iterated_state", "assign_iterated_state", "token_state_op", "token_op",
]


def default_strategy(mixer: Mixer) -> PerToken:
    """The component's own way: `ChunkBoundaries` for a chunked scan (Mamba-2), `FromArguments` for a kind whose
    states are always its fast path's (``STATES_FROM_ARGUMENTS``: lightning attention, the mLSTM, the short
    convolution), `TokenLoop` otherwise."""
    if type(mixer).CHUNKED_SCAN:
        return CHUNK_BOUNDARIES
    return FROM_ARGUMENTS if type(mixer).STATES_FROM_ARGUMENTS and type(mixer).FAST is not None else TOKEN_LOOP


def strategy_for(mixer: Mixer) -> PerToken:
    """The strategy serving ``mixer``'s ``states``, ``state_after`` and ``set_state_after``.

    The model's setting first: ``fast_states(model)`` -> `FromArguments`,
    ``chunk_per_token(model)`` -> `ChunkBoundaries`; otherwise the component's
    own (`default_strategy`): `TokenLoop` for the DeltaNets and Mamba-1 (served
    once the family is routed), `ChunkBoundaries` for Mamba-2 (which says to
    call ``chunk_per_token`` until it is), `FromArguments` for a kind declaring
    ``STATES_FROM_ARGUMENTS`` (lightning attention, the mLSTM, the short convolution).
    """
    setting = mixer.__dict__.get(PER_TOKEN)  # `per_token_setting`, read here: asked by a value's check and its compute
    if setting == "fast":
        return FROM_ARGUMENTS
    if setting == "chunks":
        return CHUNK_BOUNDARIES
    return default_strategy(mixer)


def iteration_strategy(mixer: Mixer) -> PerToken:
    """The strategy serving ``state`` under ``tracer.iter``: a location with one occurrence per token.

    The fast path computes states from the call's arguments and has no such
    location, so ``state`` stays the component's own (`default_strategy`).
    """
    strategy = strategy_for(mixer)
    return default_strategy(mixer) if strategy is FROM_ARGUMENTS else strategy


class OwnStateAfter(PerToken):
    """`PerToken`'s default ``states_of``, over a component's own ``state_after`` (a component serving the
    per-token states its own way: the RG-LRU's decode step)."""

    name = "the component's own state_after"

    def unavailable(self, mixer: Mixer) -> str | None:
        return type(mixer).values()["states"].reason(mixer)

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        return mixer.state_after(t)


OWN_STATE_AFTER = OwnStateAfter()


# -- what RecurrentMixer's per-token values compute and check -----------------------------


def per_token_reason(mixer: Mixer) -> str | None:
    """Why ``states`` / ``state_after`` / ``set_state_after`` cannot be served now (the strategy's reason)."""
    return strategy_for(mixer).unavailable(mixer)


def iteration_reason(mixer: Mixer) -> str | None:
    """Why ``state`` under ``tracer.iter`` cannot be served now."""
    return iteration_strategy(mixer).unavailable(mixer)


def effective_reason(mixer: Mixer) -> str | None:
    """Why ``effective_attention`` cannot be served now: no ``EFFECTIVE`` spec, or the kernel call is hidden."""
    if type(mixer).EFFECTIVE is None:
        return f"{type(mixer).__name__} has no effective attention"
    return unreadable_call(mixer)


def token_state_op(mixer: Mixer) -> str:
    """The ``tracer.iter`` location of ``state`` (one occurrence per token), relative to the mixer."""
    return TOKEN_LOOP.location(mixer)


def token_op(mixer: Mixer) -> TokenOp:
    """``(op, first, seq)`` of this call: the binding of its per-token states, its first occurrence, the call's length."""
    return iteration_strategy(mixer).token_op(mixer)


def every_state(mixer: Mixer) -> torch.Tensor:
    """``states``: the state after every token of this call."""
    return strategy_for(mixer).states(mixer)


def iterated_state(mixer: Mixer) -> torch.Tensor:
    """``state``: the state after the token ``tracer.iter`` pins, or under ``generate`` the state its step leaves."""
    if generating(mixer):
        return mixer.state_after(-1)
    return iteration_strategy(mixer).state(mixer)


def assign_iterated_state(mixer: Mixer, value: torch.Tensor) -> None:
    """Assign ``state``: `set_state_after` at the token ``tracer.iter`` pins (under ``generate``, the step's last)."""
    if generating(mixer):
        return mixer.set_state_after(-1, value)
    iteration_strategy(mixer).set_state(mixer, value)
