"""Check nnterp's import layering: no cycle, no upward import, no private name imported across modules.

    python scripts/check_layering.py            # checks ./nnterp, exits 1 and lists the violations if any
    python scripts/check_layering.py --strict   # ... and exits 1 on an offender of issue 23's rules too

Every ``nnterp/**/*.py`` is parsed with `ast` (nothing is imported). Every import
statement counts, the lazy ones inside functions included; relative imports are
resolved against the importing module. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module of the tree, else to ``pkg``.

The layers, lowest first (docs/architecture.md); a module may import its own
layer and the layers below it, never above:

    core < fast < recurrent < components < families < top level

with two narrowings: ``core`` imports only ``core`` and ``fast`` only ``fast``
(it is pure torch). The top level is ``nnterp/*.py`` and every subpackage not
named above (``nnterp/testing``).

Checked:

* a cycle: a strongly connected set of modules; imports under
  ``if TYPE_CHECKING:`` do not run and are left out of this check only;
* an upward import, per the order above;
* a private name (``_x``, not ``__x__``) imported from another nnterp module.

Listed as well (``offenders``; issue 23 empties them, tests/test_layering.py
holds the list of those left and fails when one is added or one goes):

* a bound function: a class-body assignment (``_run = calls.record``,
  ``set_state_after = per_token.set_state_after``, also through
  ``staticmethod(...)``, ``classmethod(...)``, ``property(...)``) whose right
  side is a function defined at module level in another nnterp module;
* a private member read from a strategy: under ``recurrent/per_token/``, an
  attribute ``x._name`` (not ``__name__``) where ``x`` is not ``self`` or
  ``cls``: the strategies reach a mixer through public names only;
* a long file: an nnterp file of more than `MAX_LINES` lines.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

#: Layer order, lowest first. A subpackage not listed is top level.
LAYERS = ("core", "fast", "recurrent", "components", "families", "top")
#: What each layer may import (its own layer included). Default: its own layer and every one below.
ALLOWED = {
    "core": {"core"},
    "fast": {"fast"},
    **{layer: set(LAYERS[: LAYERS.index(layer) + 1]) for layer in LAYERS[2:]},
}


@dataclass(frozen=True)
class Import:
    """One import edge: ``source`` imports ``target`` (module names), at ``line`` of ``path``."""

    source: str
    target: str
    path: Path
    line: int
    names: tuple = ()  # the names a ``from`` import takes from ``target``
    type_checking: bool = False  # under ``if TYPE_CHECKING:``
    lazy: bool = False  # inside a function body


def layer_of(module: str, package: str = "nnterp") -> str:
    """The layer of a module name: its first subpackage if that is a layer, else ``"top"``."""
    parts = module.split(".")
    if parts[0] != package or len(parts) == 1:
        return "top"
    return parts[1] if parts[1] in LAYERS[:-1] else "top"


def modules(root: Path) -> dict:
    """``{module name: path}`` for every ``.py`` under the package directory ``root``."""
    root = Path(root)
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path) -> list:
    """Every import of a tree module by a tree module, as `Import` edges."""
    root = Path(root)
    known = modules(root)
    package = root.name
    edges = []
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, type_checking, lazy in _walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        target = _longest_known(alias.name, known)
                        if target is not None:
                            edges.append(Import(source, target, path, node.lineno, (), type_checking, lazy))
                continue
            base = _resolve(source, is_package, node.module, node.level)
            if base is None or not (base == package or base.startswith(package + ".")):
                continue
            grouped: dict = {}
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in known:
                    grouped.setdefault(sub, []).append(alias.name)  # a submodule: the edge goes to it
                else:
                    grouped.setdefault(_longest_known(base, known) or base, []).append(alias.name)
            for target, names in grouped.items():
                if target in known:
                    edges.append(Import(source, target, path, node.lineno, tuple(names), type_checking, lazy))
    return sorted(edges, key=lambda e: (str(e.path), e.line, e.target))


def _walk(tree: ast.AST):
    """Yield ``(import node, under TYPE_CHECKING, inside a function)`` for every import in the tree."""
    stack = [(tree, False, False)]
    while stack:
        node, type_checking, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking, lazy
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(child, True, lazy) for child in node.body]
            stack += [(child, type_checking, lazy) for child in node.orelse]
            continue
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack += [(child, type_checking, inner) for child in ast.iter_child_nodes(node)]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(source: str, is_package: bool, module: str | None, level: int) -> str | None:
    """The absolute module name of ``from <level dots><module> import ...`` written in ``source``."""
    if level == 0:
        return module
    parts = source.split(".") if is_package else source.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        return None  # beyond the top-level package
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _longest_known(name: str, known: dict) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def cycles(edges: list) -> list:
    """The import cycles: ``(modules, cycle)`` per strongly connected set of 2+ modules, ``modules``
    sorted and ``cycle`` a shortest cycle through the first of them (``[a, b, a]``)."""
    graph: dict = {}
    for edge in edges:
        if not edge.type_checking and edge.source != edge.target:
            graph.setdefault(edge.source, set()).add(edge.target)
            graph.setdefault(edge.target, set())
    found = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            members = sorted(component)
            found.append((members, _shortest_cycle(graph, members[0], set(component))))
    return sorted(found)


def _strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, result, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                result.append(component)
    return result


def _shortest_cycle(graph: dict, start: str, within: set) -> list:
    """A shortest path ``start -> ... -> start`` inside ``within`` (breadth first)."""
    previous = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1] + [start]
            if child in within and child not in previous:
                previous[child] = node
                queue.append(child)
    return [start]


def upward(edges: list, package: str = "nnterp") -> list:
    """The edges from a layer to one it may not import."""
    return [e for e in edges if layer_of(e.target, package) not in ALLOWED[layer_of(e.source, package)]]


def private(edges: list) -> list:
    """The edges that take a private name (``_x``, not ``__x__``) from another module."""
    return [
        e
        for e in edges
        if e.source != e.target
        and any(n.startswith("_") and not (n.startswith("__") and n.endswith("__")) for n in e.names)
    ]


def violations(root: Path) -> list:
    """Every violation in the package at ``root``, as lines of text (empty when the layering holds)."""
    root = Path(root)
    edges = imports(root)
    known = modules(root)
    base = root.parent

    def where(edge: Import) -> str:
        kind = " (lazy)" if edge.lazy else ""
        kind += " (TYPE_CHECKING)" if edge.type_checking else ""
        return f"{edge.path.relative_to(base)}:{edge.line}{kind}"

    lines = []
    for members, cycle in cycles(edges):
        files = ", ".join(str(known[m].relative_to(base)) for m in members)
        lines.append(f"cycle of {len(members)} modules: {' -> '.join(cycle)}\n    files: {files}")
    for edge in upward(edges, root.name):
        lines.append(
            f"upward import: {where(edge)}: {edge.source} ({layer_of(edge.source, root.name)}) imports "
            f"{edge.target} ({layer_of(edge.target, root.name)})"
        )
    for edge in private(edges):
        names = ", ".join(n for n in edge.names if n.startswith("_") and not n.endswith("__"))
        lines.append(f"private import: {where(edge)}: {edge.source} imports {names} from {edge.target}")
    return lines


#: The most lines an nnterp file may have.
MAX_LINES = 400
#: Where the private-member rule applies: the strategies.
STRATEGIES = ("recurrent", "per_token")
#: Wrappers through which a class body still binds a function.
WRAPPERS = {"staticmethod", "classmethod", "property"}


def _module_bindings(source: str, path: Path, known: dict) -> dict:
    """``{local name: (module, attribute or None)}`` of ``source``'s module-level imports of tree modules."""
    is_package = path.name == "__init__.py"
    package = source.split(".")[0]
    found = {}
    nodes = [node for node, _, lazy in _walk(ast.parse(path.read_text(), filename=str(path))) if not lazy]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    found[alias.asname] = (alias.name, None)
            continue
        base = _resolve(source, is_package, node.module, node.level)
        if base is None or not (base == package or base.startswith(package + ".")):
            continue
        for alias in node.names:
            local = alias.asname or alias.name
            sub = f"{base}.{alias.name}"
            found[local] = (sub, None) if sub in known else (base, alias.name)
    return found


def _functions(module: str, known: dict, cache: dict) -> dict:
    """``{name: (defining module, its name there)}`` of the functions ``module`` defines at module level or
    imports from the tree."""
    if module not in cache:
        cache[module] = {}  # a cycle resolves to nothing
        tree = ast.parse(known[module].read_text(), filename=str(known[module]))
        defined = {n.name: (module, n.name) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for local, (target, attr) in _module_bindings(module, known[module], known).items():
            if attr is not None and local not in defined and target in known:
                origin = _functions(target, known, cache).get(attr)
                if origin is not None:
                    defined[local] = origin
        cache[module] = defined
    return cache[module]


def bound_functions(root: Path) -> list:
    """``(path, line, "Class.name", "module.function")`` for each function of another module bound in a class body."""
    root = Path(root)
    known, cache, found = modules(root), {}, []
    for source, path in known.items():
        bindings = _module_bindings(source, path, known)
        for klass in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(klass, ast.ClassDef):
                continue
            for node in klass.body:
                if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                    continue
                value = node.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in WRAPPERS and value.args:
                    value = value.args[0]
                origin = None
                if isinstance(value, ast.Name) and value.id in bindings:
                    module, attr = bindings[value.id]
                    if attr is not None and module in known:
                        origin = _functions(module, known, cache).get(attr)
                elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id in bindings:
                    module, attr = bindings[value.value.id]
                    if attr is None and module in known:
                        origin = _functions(module, known, cache).get(value.attr)
                if origin is not None and origin[0] != source:
                    found.append((path, node.lineno, f"{klass.name}.{node.targets[0].id}", f"{origin[0]}.{origin[1]}"))
    return found


def private_reads(root: Path) -> list:
    """``(path, line, "x._name")`` for each private member a strategy reads off something not ``self``/``cls``."""
    root = Path(root)
    folder = root.joinpath(*STRATEGIES)
    found = []
    for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
            found.append((path, node.lineno, f"{owner}.{node.attr}"))
    return sorted(found, key=lambda hit: (str(hit[0]), hit[1], hit[2]))


def long_files(root: Path, most: int = MAX_LINES) -> list:
    """``(path, lines)`` for each file of the package longer than ``most`` lines."""
    found = []
    for path in modules(root).values():
        lines = len(path.read_text().splitlines())
        if lines > most:
            found.append((path, lines))
    return sorted(found, key=lambda hit: str(hit[0]))


def offenders(root: Path) -> list:
    """The bound functions, the strategies' private member reads and the long files, as lines of text."""
    root = Path(root)
    base = root.parent
    lines = [
        f"bound function: {path.relative_to(base)}:{line}: {name} = {origin}"
        for path, line, name, origin in bound_functions(root)
    ]
    lines += [f"private member read: {path.relative_to(base)}:{line}: {read}" for path, line, read in private_reads(root)]
    lines += [f"long file: {path.relative_to(base)}: {count} lines (most {MAX_LINES})" for path, count in long_files(root)]
    return lines


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1] / "nnterp"))
    parser.add_argument("--strict", action="store_true", help="exit 1 on an offender too (issue 23's rules)")
    args = parser.parse_args(argv)
    found = violations(Path(args.root))
    for line in found:
        print(line)
    print(f"{len(found)} layering violation(s)" if found else "layering: ok", file=sys.stderr)
    listed = offenders(Path(args.root))
    for line in listed:
        print(line)
    print(f"{len(listed)} offender(s) of issue 23's rules" if listed else "issue 23's rules: ok", file=sys.stderr)
    return 1 if found or (args.strict and listed) else 0


if __name__ == "__main__":
    sys.exit(main())
