"""The kernels a recurrent mixer's forward calls, as bound in its modeling module.

transformers decorates each kernel with its hub dispatcher
(``use_kernel_func_from_hub_with_fallback``), which binds the module-level
name to a closure ``wrapped`` holding ``torch_function``, the pure-torch body,
and ``implementation``, the optimized kernel when its package is installed (the
torch body otherwise). With the HF ``kernels`` package the name is an
``nn.Module`` instead. This file reads those bindings; `routing` changes them.

It also finds, from a kernel's own source, the nnsight label of the binding
that holds the state: labels are numbered per name in execution order and
shift between transformers releases, so they are derived by variable name and
position (inside the token loop or not), never written down.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
from types import FunctionType, ModuleType
from typing import Any, Callable, Optional

from nnsight.intervention.source import compiled, decorator_chain

from ..core.errors import NnterpError


def closure(fn: Any) -> dict:
    """The dispatcher's closure variables (``{}`` for a bare function)."""
    if not isinstance(fn, FunctionType) or fn.__closure__ is None:
        return {}
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__)))


def is_dispatcher(fn: Any) -> bool:
    """Whether ``fn`` is transformers' hub dispatcher around a kernel."""
    cells = closure(fn)
    return "torch_function" in cells and "implementation" in cells


def torch_function(fn: Any) -> Any:
    """The pure-torch body behind a binding (the binding itself when it is bare)."""
    if is_dispatcher(fn):
        return closure(fn)["torch_function"]
    if _is_hub_module(fn):
        inner = closure(type(fn).forward).get("func") or getattr(fn, "func", None)
        return torch_function(inner) if inner is not None else fn
    return fn


def _is_hub_module(fn: Any) -> bool:
    import torch

    return isinstance(fn, torch.nn.Module)


def optimized(fn: Any) -> Optional[str]:
    """Why the binding ``fn`` has no Python body to read inside, or ``None``.

    Names the package (or the HF ``kernels`` integration) and its fix.
    """
    if _is_hub_module(fn):
        return (
            f"the HF `kernels` package binds transformers' pure-torch {getattr(fn, 'kernel_layer_name', 'kernel')} "
            "to an nn.Module nnsight cannot drill into; set USE_HUB_KERNELS=0 in the environment before importing "
            "transformers, or uninstall `kernels`, to read these"
        )
    if is_dispatcher(fn):
        cells = closure(fn)
        if cells["implementation"] is not cells["torch_function"]:
            package = cells.get("package") or getattr(cells["implementation"], "__module__", "?").split(".")[0]
            return (
                f"read inside transformers' pure-torch {cells['torch_function'].__name__}, but this process "
                f"dispatches it to an optimized kernel ({package}) with no Python source; uninstall it, or call "
                "nnterp.route_kernels(model.family, 'torch'), to read these"
            )
    return None


def modeling_of(module_or_class: Any) -> ModuleType:
    """The transformers modeling module a mixer (instance or class) is defined in."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return sys.modules[cls.__module__]


def call_label(forward: Callable, function: str) -> str:
    """The nnsight label of the (first) call of ``function`` in ``forward``."""
    inner, _ = decorator_chain(forward)
    names = compiled(inner).names
    pattern = re.compile(rf"^{re.escape(function)}_\d+$")
    found = [name for name in names if pattern.match(name)]
    if not found:
        raise NnterpError(_missing(f"a call of `{function}`", inner))
    return found[0]


def has_label(forward: Callable, label: str) -> bool:
    inner, _ = decorator_chain(forward)
    return label in compiled(inner).names


def state_label(kernel: Callable, variable: str, *, in_loop: bool) -> str:
    """The label of the binding of ``variable`` that holds the state in ``kernel``.

    ``in_loop``: the last binding inside the kernel's ``for`` loop (the state
    after each token's update, once per token); otherwise the last binding
    outside any loop (a single-step update).
    """
    return bindings(kernel, variable, in_loop=in_loop)[-1]


def bindings(kernel: Callable, variable: str, *, in_loop: bool) -> list[str]:
    """The labels of the bindings of ``variable`` in ``kernel``, in execution order, inside its loop or outside."""
    fn = torch_function(kernel)
    info = compiled(fn)
    tree = ast.parse(info.source)
    loops = [(node.lineno, node.end_lineno) for node in ast.walk(tree) if isinstance(node, (ast.For, ast.While))]
    pattern = re.compile(rf"^{re.escape(variable)}_\d+$")
    found = [
        name
        for name in info.names
        if pattern.match(name)
        and any(start < info.lines[name] <= end for start, end in loops) == in_loop
        and _assigns(tree, info.lines[name], variable)
    ]
    if not found:
        where = "inside its token loop" if in_loop else "outside any loop"
        raise NnterpError(_missing(f"a binding of `{variable}` {where}", fn))
    return found


def _assigns(tree: ast.AST, line: int, variable: str) -> bool:
    """Whether line ``line`` assigns ``variable`` by name (not an unpacking, not `x = None if ...`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.lineno == line:
            value = node.value
            if isinstance(value, ast.IfExp):
                return False
            return any(isinstance(t, ast.Name) and t.id == variable for t in node.targets)
    return False


def _missing(what: str, fn: Callable) -> str:
    import transformers

    return (
        f"nnterp could not find {what} in {fn.__module__}.{fn.__qualname__} of transformers "
        f"{transformers.__version__}: this release changed the kernel's source. nnterp supports "
        "transformers >=5.18,<5.25; please report the release so the family can be updated"
    )


@functools.lru_cache(maxsize=None)
def _signature(forward: Callable) -> inspect.Signature:
    # Peeling the decorators parses the wrapper's source: once per forward, not once per call.
    return inspect.signature(decorator_chain(forward)[0])


def signature_binding(forward: Callable, module: Any, args: tuple, kwargs: dict) -> dict:
    """``{parameter: value}`` of a call of ``forward`` on ``module``."""
    bound = _signature(forward).bind_partial(module, *args, **kwargs)
    flat = dict(bound.arguments)
    flat.update(flat.pop("kwargs", {}) or {})
    return flat
