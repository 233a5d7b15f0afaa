"""`chunk_per_token`: make every token a chunk boundary of Mamba-2's chunk scan, on one model.

Mamba-2's prompt kernel (state space duality) splits the sequence into chunks
of ``chunk_size`` tokens (256 on the released checkpoints) and computes the
state only at chunk boundaries, all in one einsum: the state after every
token is never materialized. With ``chunk_size = 1`` every token is a
boundary, so the boundary states are the state after every token, and the
scan computes the same outputs (to float rounding), slower on long prompts
(the inter-chunk einsum grows with the square of the number of chunks).

The forward reads ``self.chunk_size`` on every call, so this is a per-model,
per-module attribute change, unlike `route_kernels`, which is process-wide.
"""

from __future__ import annotations

from typing import Any

from ..core.calls import in_trace
from ..core.errors import NnterpError, RoutingError

#: Attribute of a mixer module holding the chunk size it had before `chunk_per_token`.
ORIGINAL = "_nnterp_chunk_size"


class ChunkPerToken:
    """What `chunk_per_token` did; as a context manager, undoes it on exit."""

    def __init__(self, model: Any, modules: list, enabled: bool) -> None:
        self.model, self.modules, self.enabled = model, modules, enabled

    def __enter__(self) -> "ChunkPerToken":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            chunk_per_token(self.model, enabled=False)

    def __repr__(self) -> str:
        return f"ChunkPerToken({len(self.modules)} mixers, enabled={self.enabled})"


def chunk_per_token(model: Any, enabled: bool = True) -> ChunkPerToken:
    """Set ``chunk_size`` to 1 on every `StateSpace` mixer of ``model``, so every token is a boundary.

    Then ``states``, ``state_after``, ``set_state_after`` and ``state`` of
    those mixers serve the state after every token. ``enabled=False``
    restores each mixer's original chunk size. Per model, not process-wide;
    call it outside a trace. ``with nnterp.chunk_per_token(model):`` restores
    on exit.
    """
    from .state_space import StateSpace

    if in_trace():
        raise RoutingError(
            "chunk_per_token was called inside a running trace, where the mixers may already have run; call it "
            "before `with model.trace(...)` / `model.generate(...)`"
        )
    mixers = [envoy for envoy in _envoys(model) if isinstance(envoy, StateSpace)]
    if not mixers:
        raise NnterpError(
            f"{type(model).__name__} has no Mamba-2 (StateSpace) mixer whose chunk size to set: chunk_per_token "
            "applies to models with a chunked state-space scan"
        )
    modules = [envoy._module for envoy in mixers]
    for module in modules:
        if enabled:
            module.__dict__.setdefault(ORIGINAL, module.chunk_size)
            module.chunk_size = 1
        elif ORIGINAL in module.__dict__:
            module.chunk_size = module.__dict__.pop(ORIGINAL)
    return ChunkPerToken(model, modules, enabled)


def _envoys(model: Any) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise NnterpError(f"chunk_per_token takes a StandardizedTransformer, got {type(model).__name__}")
    return [getattr(layer, "linear_attn", None) for layer in layers]
