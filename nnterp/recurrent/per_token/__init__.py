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

Each serves ``states``, ``state_after(t)``, ``set_state_after(t, value)`` and
``state`` (`PerToken`, ``protocol.py``) on one call of one mixer, keeping what
it learns in that call's `nnterp.recurrent.call.Call`, and says why it cannot
(``unavailable``), which is what `support()` reports.
"""

from __future__ import annotations

from typing import Any

from ..settings import per_token_setting
from .boundaries import CHUNK_BOUNDARIES, ChunkBoundaries
from .from_arguments import FROM_ARGUMENTS, FromArguments
from .loop import TOKEN_LOOP, TokenLoop
from .protocol import PerToken

__all__ = ["PerToken", "TokenLoop", "ChunkBoundaries", "FromArguments", "strategy_for", "iteration_strategy"]


def default_strategy(mixer: Any) -> PerToken:
    """The component's own way: `ChunkBoundaries` for a chunked scan (Mamba-2), `TokenLoop` otherwise."""
    return CHUNK_BOUNDARIES if type(mixer).CHUNKED_SCAN else TOKEN_LOOP


def strategy_for(mixer: Any) -> PerToken:
    """The strategy serving ``mixer``'s ``states``, ``state_after`` and ``set_state_after``.

    The model's setting first: ``fast_states(model)`` -> `FromArguments`,
    ``chunk_per_token(model)`` -> `ChunkBoundaries`; otherwise the component's
    own (`default_strategy`): `TokenLoop` for the DeltaNets and Mamba-1 (served
    once the family is routed), `ChunkBoundaries` for Mamba-2 (which says to
    call ``chunk_per_token`` until it is).
    """
    setting = per_token_setting(mixer)
    if setting == "fast":
        return FROM_ARGUMENTS
    if setting == "chunks":
        return CHUNK_BOUNDARIES
    return default_strategy(mixer)


def iteration_strategy(mixer: Any) -> PerToken:
    """The strategy serving ``state`` under ``tracer.iter``: a location with one occurrence per token.

    The fast path computes states from the call's arguments and has no such
    location, so ``state`` stays the component's own (`default_strategy`).
    """
    strategy = strategy_for(mixer)
    return default_strategy(mixer) if strategy is FROM_ARGUMENTS else strategy
