"""Which kernel functions a family's modeling module binds: `route_kernels`.

A recurrent mixer's forward looks its kernels up by name in its modeling
module. ``"torch"`` rebinds those names to transformers' pure-torch bodies
(the functions the hub dispatcher falls back to): the slower path, and the only
one with Python source for nnsight to read values inside. On a mixer whose
token-by-token kernel materializes the state after every token (``STATE_OP``
set) the prompt's name is bound to that kernel too, so a prompt runs token by
token. ``"default"`` restores what the module bound at import. The originals
are stashed in the modeling module's ``_nnterp_kernels``.

nnsight compiles a module's instrumented forward over a *copy* of its
module's globals, on the first ``.source`` access: a rebinding made after that
would be silently ignored by that module. Routing therefore also resets the
instrumentation of every live mixer of the family, so each is re-instrumented
over the new bindings at its next access; a mixer traced before routing serves
the routed kernel like any other. Routing inside a running trace raises.
"""

from __future__ import annotations

import gc
import sys
from types import ModuleType
from typing import Any, Iterable

import torch
from nnsight.intervention.source import STATE

from ..core.calls import in_trace
from ..core.errors import NnterpError, RoutingError
from .kernels import closure, torch_function

#: Attribute of the modeling module holding the bindings it had at import.
STASH = "_nnterp_kernels"
MODES = ("torch", "default")


def modeling_module(family: Any) -> ModuleType:
    """The transformers modeling module of a family (``family.MODELING``), or the module itself."""
    return getattr(family, "MODELING", family)


def mixers_of(family: Any) -> tuple:
    """The recurrent mixer components whose kernels live in ``family``'s modeling module."""
    mixer = getattr(family, "MIXER", None)
    if mixer is None:
        from ..families import families

        # a family's modeling module, or its file (nnterp.families.qwen3_5_text)
        found = [f for f in families() if family in (f.MODELING, sys.modules.get(f.__module__))]
        mixer = found[0].MIXER if found else None
    if mixer is None:
        raise NnterpError(
            f"{getattr(family, '__name__', family)!r} has no recurrent mixer to route: pass a recurrent family "
            "(model.family) or its transformers modeling module"
        )
    return tuple(mixer) if isinstance(mixer, (tuple, list)) else (mixer,)


def bindings(modeling: ModuleType, names: Iterable[str]) -> dict[str, Any]:
    return {name: modeling.__dict__[name] for name in names}


class Routing:
    """What `route_kernels` did; as a context manager, undoes it on exit."""

    def __init__(self, modeling: ModuleType, previous: dict[str, Any]) -> None:
        self.modeling = modeling
        self.previous = previous

    def __enter__(self) -> "Routing":
        return self

    def __exit__(self, *exc: Any) -> None:
        _rebind(self.modeling, self.previous)

    def __repr__(self) -> str:
        return f"Routing({self.modeling.__name__})"


def route_kernels(family: Any, mode: str) -> Routing:
    """Bind a family's recurrent kernels, process-wide.

    ``"torch"`` binds the prompt's and the decode step's kernel names in the
    family's modeling module to transformers' pure-torch kernels; on a mixer
    whose token-by-token kernel materializes the state after every token
    (``STATE_OP`` set) the prompt's name is bound to that kernel, so
    ``state``, ``states``, ``state_after`` and ``set_state_after`` read and
    write the state at any position. On a gated DeltaNet that is the decode
    kernel, so both names are bound to it; on Mamba-1 the pure-torch selective
    scan is itself the token loop, and each name keeps its own. The short
    convolution's kernels are bound to their pure-torch bodies too.
    ``"default"`` restores what the module bound at import. Like installing a
    kernel, it applies to every model of the family, including mixers nnsight
    has already instrumented. ``family`` is the family (``model.family``,
    or its file ``nnterp.families.qwen3_5_text``) or its transformers modeling module.

    Returns a `Routing`: ``with nnterp.route_kernels(family, "torch"):``
    restores the previous binding on exit.
    """
    if mode not in MODES:
        raise NnterpError(f"route_kernels mode must be one of {MODES}, got {mode!r}")
    if in_trace():
        raise RoutingError(
            "route_kernels was called inside a running trace, where it cannot reach the forward already running; "
            "call it before `with model.trace(...)` / `model.generate(...)`"
        )
    modeling = modeling_module(family)
    stash = modeling.__dict__.setdefault(STASH, {})
    target: dict[str, Any] = {}
    for mixer in mixers_of(family):
        names = (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)
        for name in names:
            stash.setdefault(name, modeling.__dict__[name])
        if mode == "default":
            target.update({name: stash[name] for name in names})
            continue
        target.update({name: torch_function(stash[name]) for name in names})
        if mixer.STATE_OP is not None and mixer.STEP_STATE_OP is None:
            target[mixer.CHUNK_FUNCTION] = target[mixer.RECURRENT_FUNCTION]
    previous = bindings(modeling, target)
    _rebind(modeling, target)
    return Routing(modeling, previous)


def route_delta_rule(family: Any, mode: str) -> Routing:
    """`route_kernels` for a gated DeltaNet, in its own words.

    ``"recurrent"`` is ``route_kernels(family, "torch")``: the family's prompts
    run through transformers' token-by-token gated delta rule, which
    materializes the state after every token. ``"chunked"`` is
    ``route_kernels(family, "default")``.
    """
    modes = {"recurrent": "torch", "chunked": "default"}
    if mode not in modes:
        raise NnterpError(f"route_delta_rule mode must be 'recurrent' or 'chunked', got {mode!r}")
    return route_kernels(family, modes[mode])


def _rebind(modeling: ModuleType, target: dict[str, Any]) -> None:
    changed = {name for name, fn in target.items() if modeling.__dict__.get(name) is not fn}
    for name, fn in target.items():
        setattr(modeling, name, fn)
    if changed:
        reinstrument(modeling, changed)


def reinstrument(modeling: ModuleType, names: set[str]) -> int:
    """Drop nnsight's instrumented forward of every live module of ``modeling`` that calls one of ``names``.

    The controller stays; the next ``.source`` access instruments the forward
    again, over the module's globals as they are now. Returns how many were reset.
    """
    reset = 0
    for obj in gc.get_objects():
        # The type test first: `isinstance` on some lazy module proxies warns.
        if type(obj).__module__ != modeling.__name__ or not isinstance(obj, torch.nn.Module):
            continue
        state = obj.__dict__.get(STATE)
        if state is None or not state.sourced:
            continue
        labels = state.compiled.names if state.compiled is not None else ()
        if any(label.rsplit("_", 1)[0] in names for label in labels):
            state.body, state.sourced, state.compiled = state.original, False, None
            reset += 1
    return reset


def refused_device(model: Any) -> "str | None":
    """Why running ``model`` would fail inside a compiled kernel that refuses its device, or ``None``.

    With ``mamba_ssm`` or ``causal-conv1d`` installed, the dispatcher hands a
    CPU tensor to a CUDA kernel, which refuses it (``Expected u.is_cuda() to
    be true``) from inside the forward. Checked before a trace runs
    (`StandardizedTransformer.interleave`), so the error names the fix.
    """
    family = getattr(model, "family", None)
    if family is None or getattr(family, "MIXER", None) is None:
        return None
    parameter = next(model._module.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return None
    modeling = modeling_module(family)
    for mixer in mixers_of(family):
        for name in (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS):
            cells = closure(modeling.__dict__.get(name))
            if cells and cells.get("implementation") is not cells.get("torch_function"):
                package = cells.get("package") or getattr(cells["implementation"], "__module__", "?").split(".")[0]
                return (
                    f"this process dispatches transformers' {name} to {package}'s compiled CUDA kernel, which refuses "
                    f"this model's CPU tensors (`Expected ....is_cuda() to be true`); call "
                    f"nnterp.route_kernels(model.family, 'torch') before tracing it on a CPU"
                )
    return None
