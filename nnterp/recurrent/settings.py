"""Per-model settings, held by nnterp on its own envoys: which way a mixer serves the state after every token.

A `StandardizedTransformer` owns its envoy tree, which outlives loading the
weights (``dispatch``), travels with the model when a trace is serialized and
is never shared between two models. So these settings are attributes of the
mixers' envoys (``PER_TOKEN``), never of transformers' modules or of the
process:

* `fast_states(model)`: ``"fast"``, the state after every token computed from
  the kernel call's own arguments (`nnterp.recurrent.per_token.from_arguments`);
* `chunk_per_token(model)`: ``"chunks"``, Mamba-2's chunk scan run with every
  token a chunk boundary (`nnterp.recurrent.per_token.boundaries`).

``route_kernels(family, ...)`` is the one process-wide switch, the low-level
knob the spec describes. Each function returns a `Setting`; as a context
manager it restores, on exit, what each mixer had before it, so nested blocks
unwind in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.calls import in_trace
from ..core.errors import InvalidArgument, RoutingError, WrongType
from ..core.interrupts import interrupts_held

#: Attribute of a mixer envoy holding its per-token setting: ``None``, ``"fast"`` or ``"chunks"``.
PER_TOKEN = "_nnterp_per_token"
#: Attribute of a mixer envoy saying it runs on a server (NDIF), which this process's `route_kernels` cannot
#: reach: set on every mixer of a ``StandardizedTransformer(..., remote=True)``, and on every mixer a
#: request carries (a mixer's pickled state always says so: it is pickled only to be shipped).
REMOTE = "_nnterp_remote"
#: Attribute of a mixer envoy set while its model runs ``generate``, where ``tracer.iter`` counts the model's
#: forward calls (the steps) rather than the tokens of one prompt call.
GENERATING = "_nnterp_generating"
#: Attribute of a mixer envoy holding the dtype `fast_states` stores its per-token states in (absent: float32).
STATES_DTYPE = "_nnterp_states_dtype"
#: The dtypes `fast_states` stores states in: float32, or one rounding of it (`nnterp.fast.scan.BF16_RTOL`).
STATES_DTYPES = ("float32", "bfloat16", "float16")


def states_dtype(mixer: Any) -> Any:
    """The dtype ``mixer``'s fast-path states are stored in (``torch.float32`` unless `fast_states` said another)."""
    import torch

    return mixer.__dict__.get(STATES_DTYPE) or torch.float32


def runs_remotely(mixer: Any) -> bool:
    """Whether ``mixer`` runs on a server, where routing done in this process does not apply."""
    return bool(mixer.__dict__.get(REMOTE))


def mark_remote(model: Any) -> None:
    """Mark every mixer of ``model`` as running on a server (``StandardizedTransformer(..., remote=True)``)."""
    for mixer in _mixers(model, "remote=True"):
        object.__setattr__(mixer, REMOTE, True)


def generating(mixer: Any) -> bool:
    """Whether ``mixer``'s model is running ``generate`` (set by `StandardizedTransformer.interleave`)."""
    return bool(mixer.__dict__.get(GENERATING))


class marked_generating:  # noqa: N801  (used as a function: ``with marked_generating(model, on):``)
    """While open, every mixer of ``model`` says whether the run is ``generate``; the previous marks come back on exit.

    A class, not a ``@contextmanager`` function: it runs on a server too, where a function arrives rebuilt from
    its source without its decorators.
    """

    def __init__(self, model: Any, on: bool) -> None:
        layers = getattr(model, "layers", None) or []
        self.mixers = [layer.linear_attn for layer in layers if getattr(layer, "linear_attn", None) is not None]
        self.on = on

    def __enter__(self) -> None:
        self.previous = [mixer.__dict__.get(GENERATING) for mixer in self.mixers]
        for mixer in self.mixers:
            object.__setattr__(mixer, GENERATING, self.on)

    def __exit__(self, *exc: Any) -> None:
        for mixer, before in zip(self.mixers, self.previous):
            object.__setattr__(mixer, GENERATING, before)


def per_token_setting(mixer: Any) -> str | None:
    """The mixer's per-token setting (``None`` when its model set none)."""
    return mixer.__dict__.get(PER_TOKEN)


class Setting:
    """What a setting function changed; as a context manager, restores each mixer's previous setting on exit."""

    def __init__(self, name: str, mixers: list, previous: list, enabled: bool) -> None:
        self.name, self.mixers, self.previous, self.enabled = name, mixers, previous, enabled
        self.previous_dtypes = [mixer.__dict__.get(STATES_DTYPE) for mixer in mixers]

    def __enter__(self) -> Setting:
        return self

    def __exit__(self, *exc: Any) -> None:
        _store_all(self.mixers, self.previous, [per_token_setting(mixer) for mixer in self.mixers])
        for mixer, before in zip(self.mixers, self.previous_dtypes):
            object.__setattr__(mixer, STATES_DTYPE, before)

    def __repr__(self) -> str:
        return f"{self.name}({len(self.mixers)} mixers, enabled={self.enabled})"


def _store(mixer: Any, value: str | None) -> None:
    object.__setattr__(mixer, PER_TOKEN, value)


def _mixers(model: Any, what: str) -> list:
    if in_trace():
        raise RoutingError(
            f"{what} was called inside a running trace, where the mixers may already have run; call it before "
            "`with model.trace(...)` / `model.generate(...)`"
        )
    layers = getattr(model, "layers", None)
    if layers is None:
        raise WrongType(f"{what} takes a StandardizedTransformer, got {type(model).__name__}")
    return [layer.linear_attn for layer in layers if getattr(layer, "linear_attn", None) is not None]


def _apply(model: Any, what: str, value: str, enabled: bool, applies: Callable[[Any], bool], none: str) -> Setting:
    mixers = [mixer for mixer in _mixers(model, what) if applies(mixer)]
    if not mixers:
        raise InvalidArgument(none)
    previous = [per_token_setting(mixer) for mixer in mixers]
    target = [value if enabled else (None if before == value else before) for before in previous]
    _store_all(mixers, target, previous)
    return Setting(what, mixers, previous, enabled)


def _store_all(mixers: list, values: list, previous: list) -> None:
    """Set every mixer's setting as one step: an exception puts the previous ones back, a Ctrl-C waits for the end."""
    with interrupts_held():
        try:
            for mixer, value in zip(mixers, values):
                _store(mixer, value)
        except BaseException:
            for mixer, before in zip(mixers, previous):
                object.__setattr__(mixer, PER_TOKEN, before)
            raise


def fast_states(model: Any, enabled: bool = True, dtype: Any = None) -> Setting:
    """Serve ``states``, ``state_after`` and ``set_state_after`` of ``model``'s mixers from the kernel call's arguments.

    Per model, on every mixer whose component has a fast path (``FAST``),
    until ``enabled=False``; ``with nnterp.fast_states(model):`` restores on
    exit. No routing is needed, and an optimized kernel (flash-linear-attention,
    mamba_ssm) may stay bound. Call it outside a trace.

    ``dtype``: what ``states`` and ``states_of`` are stored in (``None``:
    float32, whatever the model's dtype). ``torch.bfloat16`` (or
    ``torch.float16``) halves their memory: each state is computed in float32
    and rounded once when stored, so an entry is within ``2⁻⁸`` of its
    magnitude (bfloat16; `nnterp.fast.scan.BF16_RTOL`) plus float32's own
    error, at any length. ``state_after(t)`` and the states a write continues
    from stay float32.
    """
    import torch

    if dtype is not None and (not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in STATES_DTYPES):
        raise InvalidArgument(
            f"fast_states(dtype={dtype!r}): the states are stored in one of "
            f"{', '.join('torch.' + name for name in STATES_DTYPES)} (or None, float32)"
        )

    def applies(mixer: Any) -> bool:
        return getattr(type(mixer), "FAST", None) is not None

    kinds = sorted({type(mixer).__name__ for mixer in _mixers(model, "fast_states")}) or ["none"]
    setting = _apply(
        model, "fast_states", "fast", enabled, applies,
        f"{type(model).__name__} has no mixer with a fast path (mixers: {', '.join(kinds)}): it covers the mixers whose "
        "prompt kernel keeps the per-token states to itself (gated DeltaNet, Kimi delta attention, Mamba-1, Mamba-2), "
        "the RG-LRU, RWKV-4 and the mLSTM; "
        "support() says how this model's mixers serve `states` without it",
    )
    for mixer in setting.mixers:
        object.__setattr__(mixer, STATES_DTYPE, dtype if enabled else None)
    return setting


def chunk_per_token(model: Any, enabled: bool = True) -> Setting:
    """Make every token a chunk boundary of the chunk scan on every `StateSpace` mixer of ``model``.

    Then ``state``, ``states``, ``state_after`` and ``set_state_after`` of
    those mixers serve the state after every token: a call whose per-token
    states a trace reads runs its chunk scan with ``chunk_size=1`` (the same
    outputs to float rounding, slower on long prompts). ``enabled=False``
    turns it off. Per model, held by nnterp (the modules' ``chunk_size`` is
    untouched); call it outside a trace. ``with nnterp.chunk_per_token(model):``
    restores on exit.
    """
    def applies(mixer: Any) -> bool:
        return getattr(type(mixer), "CHUNKED_SCAN", False)

    return _apply(
        model, "chunk_per_token", "chunks", enabled, applies,
        f"{type(model).__name__} has no Mamba-2 (StateSpace) mixer whose chunk size to set: chunk_per_token "
        "applies to models with a chunked state-space scan",
    )
