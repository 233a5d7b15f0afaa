"""The kernels a recurrent mixer's forward calls, as its modeling module binds them.

transformers decorates each kernel with its hub dispatcher
(``use_kernel_func_from_hub_with_fallback``), which binds the module-level
name to a closure ``wrapped`` holding ``torch_function``, the pure-torch body,
and ``implementation``, the optimized kernel when its package is installed (the
torch body otherwise). With the HF ``kernels`` package the name is an
``nn.Module`` instead. This file reads those bindings; `routing` changes them
and keeps what the module bound at import in its ``STASH`` (`original`).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from types import FunctionType, ModuleType
from typing import Any

import torch
from nnsight.intervention.source import decorator_chain

from ..core.local import LocalDict
from .settings import runs_remotely

#: Attribute of a modeling module holding the bindings it had at import (written by `routing`).
STASH = "_nnterp_kernels"


class FallbackNotice(logging.Filter):
    """transformers' "falling back to its reference PyTorch implementation" warnings, said once per process.

    transformers warns once per kernel name, so a process loading a hybrid
    prints one line per missing kernel, and each new family adds its own. The
    first goes through, saying it stands for the others; the rest are dropped.
    Installed on transformers' hub-kernel logger when nnterp is imported.
    """

    PHRASE = "is falling back to its reference PyTorch implementation"

    def __init__(self) -> None:
        super(FallbackNotice, self).__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.PHRASE not in message:
            return True
        if self.said:
            return False
        self.said = True
        record.msg = (
            f"{message} (nnterp shows this once per process: other recurrent kernels whose package is missing also "
            "run transformers' reference PyTorch bodies, unannounced)"
        )
        record.args = ()
        return True


def announce_fallbacks_once() -> None:
    """Install one `FallbackNotice` on transformers' hub-kernel logger (again on re-import: a no-op)."""
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(type(f).__name__ == FallbackNotice.__name__ for f in logger.filters):
        logger.addFilter(FallbackNotice())


announce_fallbacks_once()


def closure(fn: Any) -> dict:
    """The dispatcher's closure variables (``{}`` for a bare function)."""
    if not isinstance(fn, FunctionType) or fn.__closure__ is None:
        return {}
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__)))


def is_dispatcher(fn: Any) -> bool:
    """Whether ``fn`` is transformers' hub dispatcher around a kernel."""
    cells = closure(fn)
    return "torch_function" in cells and "implementation" in cells


def is_hub_module(fn: Any) -> bool:
    """Whether ``fn`` is the HF ``kernels`` package's ``nn.Module`` binding."""
    return isinstance(fn, torch.nn.Module)


def torch_function(fn: Any) -> Any:
    """The pure-torch body behind a binding (the binding itself when it is bare)."""
    if is_dispatcher(fn):
        return closure(fn)["torch_function"]
    if is_hub_module(fn):
        inner = closure(type(fn).forward).get("func") or getattr(fn, "func", None)
        return torch_function(inner) if inner is not None else fn
    return fn


def compiled_package(fn: Any) -> str | None:
    """The package a dispatcher hands ``fn``'s calls to, or ``None`` when it runs the pure-torch body."""
    cells = closure(fn)
    if not cells or cells.get("implementation") is cells.get("torch_function"):
        return None
    return cells.get("package") or getattr(cells["implementation"], "__module__", "?").split(".")[0]


def optimized(fn: Any) -> str | None:
    """Why the binding ``fn`` has no Python body to read inside, or ``None``; names the package and the fix."""
    if is_hub_module(fn):
        return hub_module_reason(fn)
    if is_dispatcher(fn):
        package = compiled_package(fn)
        if package is not None:
            return (
                f"read inside transformers' pure-torch {closure(fn)['torch_function'].__name__}, but this process "
                f"dispatches it to an optimized kernel ({package}) whose interior nnsight cannot read; call "
                "nnterp.route_kernels(model.family, 'torch') to read these (slower, like eager attention)"
            )
    return None


def hub_module_reason(fn: Any) -> str:
    """Why a binding of the HF ``kernels`` package hides the call: an ``nn.Module`` nnsight cannot drill into."""
    return (
        f"the HF `kernels` package binds transformers' pure-torch {getattr(fn, 'kernel_layer_name', 'kernel')} "
        "to an nn.Module nnsight cannot drill into; set USE_HUB_KERNELS=0 in the environment before importing "
        "transformers, or uninstall `kernels`, to read these"
    )


def modeling_of(module_or_class: Any) -> ModuleType:
    """The transformers modeling module a mixer (instance or class) is defined in."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return sys.modules[cls.__module__]


def bound(modeling: ModuleType, name: str) -> Any:
    """What ``modeling`` binds ``name`` to now."""
    return modeling.__dict__[name]


def runs_pure_torch(mixer: Any) -> bool:
    """Whether a mixer's prompt kernel call runs a pure-torch body now (no optimized kernel, no hub module bound).

    A mixer with no module-level kernel (a method-call source: the RG-LRU's scan) runs its module's own method.
    """
    name = type(mixer).CHUNK_FUNCTION
    return not name or optimized(bound(modeling_of(mixer._module), name)) is None


def original(modeling: ModuleType, name: str) -> Any:
    """What ``modeling`` bound ``name`` to at import, whatever routing did since."""
    return modeling.__dict__.get(STASH, {}).get(name, modeling.__dict__[name])


def original_body(modeling: ModuleType, name: str) -> Callable:
    """The pure-torch body of ``name`` as bound at import (labels and signatures are read from it)."""
    return torch_function(original(modeling, name))


_SIGNATURES: dict = LocalDict()  # pickled empty: a server parses its own functions


def signature(fn: Callable) -> inspect.Signature:
    """``fn``'s signature under its decorators, parsed once per function (not once per call)."""
    found = _SIGNATURES.get(fn)
    if found is None:
        found = _SIGNATURES[fn] = inspect.signature(decorator_chain(fn)[0])
    return found


def signature_binding(forward: Callable, module: Any, args: tuple, kwargs: dict) -> dict:
    """``{parameter: value}`` of a call of ``forward`` on ``module``."""
    bound_args = signature(forward).bind_partial(module, *args, **kwargs)
    flat = dict(bound_args.arguments)
    flat.update(flat.pop("kwargs", {}) or {})
    return flat


def drill(op: Any) -> Any:
    """The source inside a kernel call's envoy: through the hub dispatcher when the name is not routed."""
    source = op.source
    if "implementation_0" in source.names and "torch_function_0" in source.names:
        source = source.implementation_0.source
    return source


def needs_torch_kernels(mixer: Any) -> str | None:
    """Why a value read *inside* a recurrent mixer's scan kernel is unavailable: the bound kernel has no interior to read.

    The token loop's state binding, the chunk scan's boundaries: an optimized
    kernel (fla, mamba_ssm) computes them without binding them in Python. Only
    the scan's two kernels count: a compiled convolution (causal-conv1d) leaves
    the scan's interior as readable as before. Where ``fast_states`` computes
    the same values from the call's arguments, the reason says so.
    """
    modeling = modeling_of(mixer._module)
    cls = type(mixer)
    for name in (cls.CHUNK_FUNCTION, cls.RECURRENT_FUNCTION):
        reason = optimized(modeling.__dict__.get(name))
        if reason is not None:
            fast = getattr(cls, "FAST", None) is not None
            if runs_remotely(mixer):
                reason = reason.partition("; ")[0] + (
                    "; this runs on a server, whose kernels only its operator can route (route_kernels cannot reach "
                    "it)" + (": nnterp.fast_states(model) serves the per-token states without routing" if fast else "")
                )
            elif fast:
                reason += (
                    "; or nnterp.fast_states(model), which computes the per-token states from the kernel call's own "
                    "arguments with the optimized kernel kept (not `state` under tracer.iter: read state_after(t))"
                )
            return reason
    # A kernel the mixer itself knows to have no Python loop (RWKV's CUDA WKV kernel, loaded by transformers).
    return mixer.kernel_reason() if hasattr(mixer, "kernel_reason") else None


def unreadable_call(mixer: Any) -> str | None:
    """Why the scan kernel call's own inputs and return are unavailable, or ``None``: what most bindings serve.

    The kernel's arguments, the state entering and leaving the call, the
    decays, effective attention: all read at the call in the forward, whatever
    kernel the dispatcher hands it to, so a compiled kernel (fla, mamba_ssm)
    serves them. Only the HF ``kernels`` package's ``nn.Module`` binding hides
    the call from nnsight.
    """
    modeling = modeling_of(mixer._module)
    cls = type(mixer)
    for name in (cls.CHUNK_FUNCTION, cls.RECURRENT_FUNCTION):
        fn = modeling.__dict__.get(name)
        if is_hub_module(fn):
            return hub_module_reason(fn)
    return mixer.kernel_reason() if hasattr(mixer, "kernel_reason") else None


def failed_kernel(error: BaseException) -> tuple[str, str] | None:
    """``(package, kernel name)`` when ``error`` was raised inside an optimized kernel the hub dispatcher called.

    Read from the traceback: the dispatcher's frame (transformers' ``wrapped``)
    holds its closure, and it handed the call to ``implementation``, not to the
    pure-torch body (a routed or fallback call is a plain error of the forward).
    """
    found, traceback = None, error.__traceback__
    while traceback is not None:
        local = traceback.tb_frame.f_locals if traceback.tb_frame.f_code.co_name == "wrapped" else {}
        if "implementation" in local and "torch_function" in local and local["implementation"] is not local["torch_function"]:
            found = (str(local.get("package", "?")), str(local.get("func_name", local["torch_function"].__name__)))
        traceback = traceback.tb_next
    return found
