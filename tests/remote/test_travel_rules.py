"""The rules code that travels to a server keeps (docs/remote.md), checked on the source.

nnsight ships a registered package's functions as source text and rebuilds
each one alone at module level on the server, so a function there has no
``__class__`` cell (zero-argument ``super()`` fails), no package context (a
relative import inside it fails), no decorators (the bare ``def`` is what is
found by name) and must keep the name it was defined with. And every module
global a shipped function reads travels with it, so a process's caches pickle
empty. The fake-server tests find a violation only on the path they run; this
finds every one.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import cloudpickle
import pytest

import nnterp

PACKAGE = Path(nnterp.__file__).parent
#: Modules that only ever run in the client's process (command line, plots, sweeps, test fixtures).
CLIENT_ONLY = ("__main__.py", "sweep.py", "plot.py", "testing/")
#: Decorated functions that only ever run in the client's process: ``route_kernels``'s signal guard.
CLIENT_ONLY_FUNCTIONS = {"recurrent/routing.py": {"_interrupts_held"}}
DESCRIPTORS = {"classmethod", "staticmethod", "property"}


def shipped_files() -> list[Path]:
    return sorted(
        path for path in PACKAGE.rglob("*.py")
        if not str(path.relative_to(PACKAGE)).startswith(CLIENT_ONLY)
    )


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_shipped_code_keeps_the_travel_rules(path):
    relative = str(path.relative_to(PACKAGE))
    tree = ast.parse(path.read_text())
    problems = []
    for fn in functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
                problems.append(f"{fn.name}:{node.lineno}: zero-argument super(); write super(Class, self)")
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                problems.append(f"{fn.name}:{node.lineno}: relative import inside a function; import at module level")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnterp") or (
                isinstance(node, ast.Import) and any(alias.name.startswith("nnterp") for alias in node.names)
            ):
                problems.append(f"{fn.name}:{node.lineno}: imports nnterp inside a function, which a server cannot")
        for decorator in fn.decorator_list:
            name = decorator.id if isinstance(decorator, ast.Name) else getattr(decorator, "attr", None)
            if name in DESCRIPTORS or fn.name in CLIENT_ONLY_FUNCTIONS.get(relative, ()):
                continue
            if isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter"):
                continue
            problems.append(f"{fn.name}:{fn.lineno}: decorated with {ast.unparse(decorator)}; a server rebuilds the bare function")
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr in ("__name__", "__qualname__", "__code__"):
                    owner = ast.unparse(target.value)
                    if owner != "self":
                        problems.append(f"line {node.lineno}: renames {owner}; a server finds a function by its defined name")
    assert not problems, f"{relative}:\n" + "\n".join(problems)


def test_process_caches_pickle_empty():
    from nnterp.core.local import LocalDict, LocalWeakSet
    from nnterp.families import REGISTRY
    from nnterp.fast import buffers
    from nnterp.recurrent import kernels, labels, routing

    assert isinstance(kernels._SIGNATURES, LocalDict) and isinstance(labels._FOUND, LocalDict)
    assert isinstance(routing._LIVE, LocalWeakSet) and isinstance(REGISTRY._loaded, LocalDict)
    full = LocalDict(a=1)
    assert pickle.loads(pickle.dumps(full)) == {} and full == {"a": 1}

    class Holder:
        pass

    live = LocalWeakSet()
    holder = Holder()
    live.add(holder)
    assert len(pickle.loads(pickle.dumps(live))) == 0
    pool = type(buffers._POOL)([object()])
    assert pickle.loads(pickle.dumps(pool)) == []


def test_a_value_pickles_without_its_annotation():
    from nnterp.components.recurrent import RecurrentMixer
    from nnterp.standardized import StandardizedTransformer

    for value in (StandardizedTransformer.__dict__["logits"], StandardizedTransformer.__dict__["next_token_probs"],
                  RecurrentMixer.__dict__["states"]):
        assert value.annotation is not None
        # Rebuilt from its reduction, not unpickled: unpickling a class shipped by value in this process would
        # overwrite the live class's attributes (cloudpickle's class tracking), and every later test would see it.
        rebuild, args = value.__reduce__()
        copy = rebuild(*args)
        assert type(copy) is type(value) and copy.annotation is None
        assert vars(copy).keys() == vars(value).keys()
        assert (copy.name, copy.description, copy.writable) == (value.name, value.description, value.writable)
        cloudpickle.dumps(value)  # and it pickles
