"""Kernel labels as data: what the installed transformers release calls each binding a mixer reads.

nnsight numbers a forward's operations per name in execution order
(``torch_chunk_gated_delta_rule_0``, ``last_recurrent_state_3``), and the
numbers shift between transformers releases. So no label is written down:
each is found from the source by variable name and position (inside the
token loop or not), and a release that moved one fails here, naming the
value, the function and the release, rather than serving the wrong binding.

The labels of one HF mixer class, as seen by one component, are computed once
and kept as a frozen `KernelLabels`; nothing is written onto a class. A
component exposes them as class constants through `Label` descriptors
(``LinearAttention.STATE_OP``): on an envoy they are the labels of the HF
module it wraps (``type(envoy._module)``), on the component class those of its
reference HF class (``REFERENCE``), so a new family whose mixer is a new HF
class needs no subclass of the component.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nnsight.intervention.source import compiled, decorator_chain

from ..core.errors import UnsupportedRelease
from ..core.local import LocalDict
from .kernels import torch_function


@dataclass(frozen=True)
class KernelLabels:
    """The labels one component reads on one HF mixer class, in the installed release.

    ``labels`` maps a constant's name (``"CHUNK_KERNEL"``, ``"STATE_OP"``,
    ``"DECAY_OP"``, ``"CACHE_TEST"``, ...) to its label or finding.
    """

    component: str
    hf_mixer: str
    labels: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.labels[name]


_FOUND: dict[tuple[type, type], KernelLabels] = LocalDict()  # pickled empty: a server reads its own release


def labels_for(component: type, hf_mixer: type) -> KernelLabels:
    """The `KernelLabels` of ``hf_mixer`` as ``component`` reads it, found once (``component.find_labels``)."""
    key = (component, hf_mixer)
    found = _FOUND.get(key)
    if found is None:
        labels = component.find_labels(hf_mixer)
        found = _FOUND[key] = KernelLabels(component.__name__, hf_mixer.__qualname__, MappingProxyType(dict(labels)))
    return found


class Label:
    """A class constant whose value is a label found in the installed release (`labels_for`).

    Read on an envoy, the labels of the HF module it wraps; on the component
    class, those of the class's ``REFERENCE`` HF mixer. An envoy's labels do
    not change while the process runs (they are its module class's, in this
    release), so the first read keeps the label in the envoy's ``__dict__``,
    which shadows this (non-data) descriptor: later reads are plain attribute
    reads. A pickled envoy leaves them behind (`without_labels`): a server
    reads its own release.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return labels_for(owner, reference(owner))[self.name]
        found = obj.__dict__[self.name] = labels_for(type(obj), type(obj._module))[self.name]
        return found


def without_labels(component: type, state: dict) -> dict:
    """An envoy's pickled ``state`` without the labels `Label` kept on it (a server reads its own release)."""
    names = {name for cls in component.__mro__ for name, value in vars(cls).items() if isinstance(value, Label)}
    return {key: value for key, value in state.items() if key not in names}


def reference(component: type) -> type:
    """The HF mixer class a component's class-level labels are read from (``REFERENCE``: ``"module.Class"``)."""
    module, _, name = component.REFERENCE.rpartition(".")
    return getattr(importlib.import_module(module), name)


def call_label(forward: Callable, function: str) -> str:
    """The nnsight label of the (first) call of ``function`` in ``forward``."""
    inner, _ = decorator_chain(forward)
    pattern = re.compile(rf"^{re.escape(function)}_\d+$")
    found = [name for name in compiled(inner).names if pattern.match(name)]
    if not found:
        raise UnsupportedRelease(missing(f"a call of `{function}`", inner))
    return found[0]


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
        raise UnsupportedRelease(missing(f"a binding of `{variable}` {where}", fn))
    return found


def _assigns(tree: ast.AST, line: int, variable: str) -> bool:
    """Whether line ``line`` assigns ``variable`` by name (not an unpacking, not `x = None if ...`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.lineno == line:
            if isinstance(node.value, ast.IfExp):
                return False
            return any(isinstance(t, ast.Name) and t.id == variable for t in node.targets)
    return False


def cache_test(forward: Callable, required: bool = True) -> str | None:
    """How ``forward`` asks the cache whether it continues a state (``None`` when it asks neither way and not ``required``).

    ``"get_recurrent_state"`` (5.21+: the state is ``None`` until a prompt
    wrote it), ``"has_previous_state(layer)"`` or ``"has_previous_state()"``
    (up to 5.20; OLMo-Hybrid's mixer asks without its layer index, which is
    the last linear block's flag).
    """
    inner = decorator_chain(forward)[0]
    tree = ast.parse(compiled(inner).source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    if any(call.func.attr == "get_recurrent_state" for call in calls):
        return "get_recurrent_state"
    asks = [call for call in calls if call.func.attr == "has_previous_state"]
    if not asks:
        if required:
            raise UnsupportedRelease(missing("the cache test (`get_recurrent_state` or `has_previous_state`)", inner))
        return None
    return "has_previous_state(layer)" if asks[0].args or asks[0].keywords else "has_previous_state()"


def repeats_first_argument(forward: Callable, function: str) -> bool:
    """Whether ``forward`` rebinds the variable it passes ``function`` first to a ``.repeat_interleave(...)`` of it."""
    tree = ast.parse(compiled(decorator_chain(forward)[0]).source)
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function and node.args
    ]
    names = {call.args[0].id for call in calls if isinstance(call.args[0], ast.Name)}
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id in names for target in node.targets)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "repeat_interleave"
        for node in ast.walk(tree)
    )


def source_of(fn: Callable) -> str:
    """The source nnsight compiles for ``fn`` (its pure-torch body)."""
    return compiled(torch_function(fn)).source


def missing(what: str, fn: Callable) -> str:
    """The error for a label a release moved: the function, the release, the supported range."""
    import transformers

    return (
        f"nnterp could not find {what} in {fn.__module__}.{fn.__qualname__} of transformers "
        f"{transformers.__version__}: this release changed the kernel's source. nnterp supports "
        "transformers >=5.18,<5.25; please report the release so the family can be updated"
    )
