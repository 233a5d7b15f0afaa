"""Which kernel functions a family's modeling module binds: `route_kernels`, the one process-wide switch.

A recurrent mixer's forward looks its kernels up by name in its modeling
module. ``"torch"`` rebinds those names to transformers' pure-torch bodies
(the functions the hub dispatcher falls back to): the slower path, and the only
one with Python source for nnsight to read values inside. On a mixer whose
token-by-token kernel materializes the state after every token (``STATE_OP``
set) the prompt's name is bound to that kernel too, so a prompt runs token by
token. ``"default"`` restores what the module bound at import. The originals
are stashed in the modeling module's ``_nnterp_kernels`` (`kernels.STASH`).

nnsight compiles a module's instrumented forward over a *copy* of its
module's globals, on the first ``.source`` access: a rebinding made after that
would be silently ignored by that module. Routing therefore also resets the
instrumentation of every live mixer of the family (each mixer envoy registers
itself, `track`), so each is re-instrumented over the new bindings at its next
access; a mixer traced before routing serves the routed kernel like any
other. Routing inside a running trace raises.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from nnsight.intervention.source import STATE

from ..core.calls import in_trace
from ..core.errors import InvalidArgument, NnterpError, RoutingError, WrongType, kernel_failure
from ..core.interrupts import interrupts_held
from ..core.local import LocalWeakSet
from .kernels import STASH, failed_kernel, torch_function
from .labels import labels_for

MODES = ("torch", "default")

#: Every live recurrent mixer envoy (`track`), so routing can reset their instrumentation.
_LIVE: weakref.WeakSet[Any] = LocalWeakSet()  # pickled empty: never another model's envoys in a request


def track(mixer: Any) -> None:
    """Register a mixer envoy: routing resets its compiled forward when its kernels are rebound."""
    _LIVE.add(mixer)


#: ``[lookup]``: ``lookup(modeling module) -> family or None``, installed by `nnterp.families` (the layer that
#: knows the registry), so a modeling module names its family before any model of it is loaded.
MODELING_LOOKUP: list = []


class _LiveFamily:
    """A transformers modeling module seen as a family: the mixers of it nnterp has wrapped."""

    def __init__(self, modeling: ModuleType) -> None:
        self.MODELING = modeling
        self.__name__ = modeling.__name__
        self.COMPONENTS = {
            type(mixer._module): type(mixer) for mixer in list(_LIVE) if type(mixer._module).__module__ == modeling.__name__
        }


def family_of(target: Any) -> Any:
    """The family ``target`` names: a family (``model.family``), a standardized model, a family's file, or a modeling module.

    A transformers modeling module names the registered family that wraps it
    (`MODELING_LOOKUP`, filled by `nnterp.families`), so routing it works
    before any model of it is loaded; a module no family wraps is known by
    the mixers of it nnterp has wrapped. Anything else is an error saying
    what was expected.
    """
    if hasattr(target, "MODELING") and hasattr(target, "COMPONENTS"):
        return target
    if hasattr(target, "_family") and hasattr(target, "layers"):
        return target._family
    declared = [
        value for value in vars(target).values()
        if isinstance(value, type) and value.__module__ == getattr(target, "__name__", None)
        and hasattr(value, "MODELING") and hasattr(value, "COMPONENTS")
    ] if isinstance(target, ModuleType) else []
    if declared:
        return declared[-1]  # a family's file: the family it declares
    if isinstance(target, ModuleType) and target.__name__.startswith("transformers.models."):
        for lookup in MODELING_LOOKUP:
            family = lookup(target)
            if family is not None:
                return family
        return _LiveFamily(target)
    raise WrongType(
        "route_kernels takes a family (model.family), a StandardizedTransformer or a family's transformers "
        f"modeling module (model.family.MODELING), got {type(target).__name__}"
        + (f" {target!r}" if isinstance(target, str) else "")
    )


def mixers_of(family: Any) -> list[tuple[type, type]]:
    """``[(hf_mixer_class, component)]`` of the family's recurrent mixers; an error on a family with none.

    A family whose mixer computes its recurrence in the module's own forward
    (MiniMax's lightning attention: no kernel function) has nothing to route:
    ``[]``, so routing it binds nothing.
    """
    family = family_of(family)
    found = [
        (hf, component) for hf, component in family.COMPONENTS.items()
        if hasattr(component, "CHUNK_FUNCTION") and hasattr(component, "find_labels")
    ]
    if not found and getattr(family, "MIXER", None) is None:
        raise InvalidArgument(
            f"{getattr(family, '__name__', family)} has no recurrent mixer to route: pass a recurrent family "
            "(model.family) or a model that has one"
        )
    return found


class Routing:
    """What `route_kernels` did; as a context manager, undoes it on exit."""

    def __init__(self, modeling: ModuleType, previous: dict[str, Any]) -> None:
        self.modeling = modeling
        self.previous = previous

    def __enter__(self) -> Routing:
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
    has already instrumented. ``family`` is the family (``model.family``) or
    the standardized model itself.

    Returns a `Routing`: ``with nnterp.route_kernels(family, "torch"):``
    restores the previous binding on exit. A call interrupted (Ctrl-C, any
    exception) before it returns changes nothing.
    """
    if mode not in MODES:
        raise InvalidArgument(f"route_kernels mode must be one of {MODES}, got {mode!r}")
    family = family_of(family)
    if in_trace():
        raise RoutingError(
            "route_kernels was called inside a running trace, where it cannot reach the forward already running; "
            "call it before `with model.trace(...)` / `model.generate(...)`"
        )
    modeling = family.MODELING
    stash = modeling.__dict__.setdefault(STASH, {})
    target: dict[str, Any] = {}
    for hf_mixer, component in mixers_of(family):
        # A mixer whose recurrence is its own method (RG-LRU) names no kernel: nothing of it to rebind.
        names = tuple(name for name in (component.CHUNK_FUNCTION, component.RECURRENT_FUNCTION, *component.CONV_FUNCTIONS) if name)
        for name in names:
            stash.setdefault(name, modeling.__dict__[name])
        if mode == "default":
            target.update({name: stash[name] for name in names})
            continue
        target.update({name: torch_function(stash[name]) for name in names})
        labels = labels_for(component, hf_mixer)
        if labels["STATE_OP"] is not None and not component.ONE_STEP_DECODE and component.CHUNK_FUNCTION:
            target[component.CHUNK_FUNCTION] = target[component.RECURRENT_FUNCTION]
    previous = {name: modeling.__dict__[name] for name in target}
    # One step under interrupts, up to the caller holding the `Routing`: a Ctrl-C held meanwhile (raised when the
    # step ends) or raised at any line before the return puts the previous bindings back, so an interrupted call
    # leaves the process as it was.
    try:
        with interrupts_held():
            _rebind(modeling, target)
            return Routing(modeling, previous)
    except BaseException:
        with interrupts_held():
            _rebind(modeling, previous)
        raise


def route_delta_rule(family: Any, mode: str) -> Routing:
    """`route_kernels` for a gated DeltaNet, in its own words.

    ``"recurrent"`` is ``route_kernels(family, "torch")``: the family's prompts
    run through transformers' token-by-token gated delta rule, which
    materializes the state after every token. ``"chunked"`` is
    ``route_kernels(family, "default")``.
    """
    modes = {"recurrent": "torch", "chunked": "default"}
    if mode not in modes:
        raise InvalidArgument(f"route_delta_rule mode must be 'recurrent' or 'chunked', got {mode!r}")
    return route_kernels(family, modes[mode])


def _rebind(modeling: ModuleType, target: dict[str, Any]) -> None:
    """Bind ``target`` and reset every live mixer compiled over other bindings, as one step.

    An interrupt (Ctrl-C) arriving meanwhile is held until the step is done, and
    any other exception puts the previous bindings back: the names and the
    mixers' compiled forwards never disagree. Resetting looks at what each
    compiled forward was built over, not at what changed, so a repeated
    ``"default"`` also repairs a mixer left compiled over the routed kernels.
    """
    previous = {name: modeling.__dict__[name] for name in target}
    with interrupts_held():
        try:
            for name, fn in target.items():
                setattr(modeling, name, fn)
            reinstrument(modeling, set(target))
        except BaseException:
            for name, fn in previous.items():
                setattr(modeling, name, fn)
            reinstrument(modeling, set(target))
            raise


def reinstrument(modeling: ModuleType, names: set[str]) -> int:
    """Drop nnsight's instrumented forward of every live mixer of ``modeling`` compiled over other bindings of ``names``.

    The controller stays; the next ``.source`` access instruments the forward
    again, over the module's globals as they are now. Returns how many were reset.
    """
    reset = 0
    bound = modeling.__dict__
    for mixer in list(_LIVE):
        module = mixer._module
        if type(module).__module__ != modeling.__name__:
            continue
        state = module.__dict__.get(STATE)
        if state is None or not state.sourced:
            continue
        seen = _compiled_globals(state.body, modeling.__name__)
        if any(name in seen and seen[name] is not bound.get(name) for name in names):
            state.body, state.sourced, state.compiled = state.original, False, None
            reset += 1
    return reset


def _compiled_globals(body: Any, module_name: str) -> dict:
    """The globals the instrumented forward runs over: a copy of its module's, taken when it was compiled.

    ``body`` may be wrapped by decorators (accelerate's hooks, deprecations)
    defined elsewhere: the forward itself is the innermost function of its
    modeling module along the closures.
    """
    found: dict = {}
    fn, seen = body, set()
    while callable(fn) and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, "__module__", None) == module_name and hasattr(fn, "__globals__"):
            found = fn.__globals__
        cells = [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ()) if _filled(cell)]
        fn = next((c for c in cells if callable(c) and hasattr(c, "__globals__")), None)
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def kernel_error(model: Any, error: BaseException) -> BaseException | None:
    """The error to raise for ``error``, when an optimized kernel raised it inside ``model``'s forward, or ``None``.

    transformers binds a kernel name to its package on import alone, with no
    device check: on a CPU, mamba_ssm refuses the tensors (``Expected
    u.is_cuda() to be true``) and fla's Triton kernels find no GPU (``0 active
    drivers``). A trace that never reaches such a kernel runs; one that does
    gets the kernel's own error as the message and the cause, and nnterp's one
    line naming the fix, as a `KernelFailure` that is also the builtin the
    kernel raised.
    """
    if isinstance(error, NnterpError):
        return None
    failed = failed_kernel(error)
    if failed is None:
        return None
    package, name = failed
    family = getattr(model, "family", None)
    named = "model.family" if family is not None else "the model's family"
    return kernel_failure(error)(
        f"{type(error).__name__}: {error}\n(raised inside {package}'s optimized kernel, to which this process's "
        f"transformers dispatches {name}; call nnterp.route_kernels({named}, 'torch') to run transformers' "
        "pure-torch kernels instead, e.g. on a machine where the package cannot run)"
    )
