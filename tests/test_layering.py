"""nnterp's import layering (docs/architecture.md), checked by `scripts/check_layering.py`, and the checker itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from textwrap import dedent

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_layering", ROOT / "scripts" / "check_layering.py")
check_layering = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_layering", check_layering)
_spec.loader.exec_module(check_layering)


def test_nnterp_has_no_cycle_no_upward_import_and_no_private_import():
    found = check_layering.violations(ROOT / "nnterp")
    assert not found, "\n" + "\n".join(found)


# Issue 23's rules. Each allowlist holds today's offenders and only shrinks: a new offender fails, and so does
# an entry that no longer offends (remove it from the list).

#: ``{file: {"Class.name", ...}}`` bound in a class body from another module's function (none since issue 23).
BOUND_FUNCTIONS: dict[str, set[str]] = {}
#: ``{strategy file: {"x._name", ...}}``: private members the strategies read off a mixer (none since the spine).
PRIVATE_READS: dict[str, set[str]] = {}
#: The nnterp files over `check_layering.MAX_LINES` lines (none since issue 23).
LONG_FILES: set[str] = set()


def _only_shrinks(found: dict, allowed: dict, rule: str) -> None:
    new = {path: names - allowed.get(path, set()) for path, names in found.items()}
    gone = {path: names - found.get(path, set()) for path, names in allowed.items()}
    new, gone = {k: sorted(v) for k, v in new.items() if v}, {k: sorted(v) for k, v in gone.items() if v}
    assert not new, f"{rule}: new offenders (issue 23 forbids them): {new}"
    assert not gone, f"{rule}: no longer offending, remove them from the allowlist: {gone}"


def _by_file(hits: list, name) -> dict:
    found: dict = {}
    for hit in hits:
        found.setdefault(hit[0].relative_to(ROOT / "nnterp").as_posix(), set()).add(name(hit))
    return found


def test_no_new_function_is_bound_into_a_class_body_from_another_module():
    found = _by_file(check_layering.bound_functions(ROOT / "nnterp"), lambda hit: hit[2])
    _only_shrinks(found, BOUND_FUNCTIONS, "bound functions")


def test_the_strategies_read_no_new_private_member_of_a_mixer():
    found = _by_file(check_layering.private_reads(ROOT / "nnterp"), lambda hit: hit[2])
    _only_shrinks(found, PRIVATE_READS, "private member reads")


def test_no_new_file_is_longer_than_400_lines():
    found = {path.relative_to(ROOT / "nnterp").as_posix() for path, _ in check_layering.long_files(ROOT / "nnterp")}
    _only_shrinks({"": found}, {"": LONG_FILES}, f"files over {check_layering.MAX_LINES} lines")


# The checker, on synthetic trees.


def tree(tmp_path: Path, files: dict) -> Path:
    """Write ``{relative path: source}`` under ``tmp_path/nnterp`` (every folder a package) and return that folder."""
    root = tmp_path / "nnterp"
    for name, source in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents:
            (root / folder / "__init__.py").touch()
        path.write_text(dedent(source))
    return root


CLEAN = {
    "core/values.py": "import torch\n__version__ = 1\n",
    "core/__init__.py": "from .values import __version__\n",
    "fast/scan.py": "import torch\nfrom . import ssd\n",
    "fast/ssd.py": "",
    "recurrent/call.py": "from ..core import values\nfrom ..fast.scan import torch\n",
    "recurrent/per_token/loop.py": "from ...core.values import __version__\nfrom ..call import values\n",
    "components/recurrent.py": """
        import nnterp.core.values
        from nnterp.recurrent.per_token import loop

        def states():
            from ..recurrent import call  # lazy
            return call
        """,
    "families/llama.py": "from ..components import recurrent\n",
    "families/__init__.py": "def family_for(t):\n    from . import llama\n    return llama\n",
    "standardized.py": "from .families import family_for\nfrom . import plot\n",
    "plot.py": "import matplotlib\n",
    "testing/checkpoints.py": "from ..families import llama\nfrom nnterp.standardized import family_for\n",
}


def test_a_clean_tree_passes(tmp_path):
    assert check_layering.violations(tree(tmp_path, CLEAN)) == []


def test_relative_and_absolute_imports_resolve_to_the_tree_modules(tmp_path):
    edges = {(e.source, e.target, e.lazy) for e in check_layering.imports(tree(tmp_path, CLEAN))}
    assert ("nnterp.core", "nnterp.core.values", False) in edges  # `from .values import` in a package
    assert ("nnterp.recurrent.per_token.loop", "nnterp.core.values", False) in edges  # three dots
    assert ("nnterp.recurrent.per_token.loop", "nnterp.recurrent.call", False) in edges
    assert ("nnterp.components.recurrent", "nnterp.core.values", False) in edges  # `import nnterp.core.values`
    assert ("nnterp.components.recurrent", "nnterp.recurrent.per_token.loop", False) in edges  # a submodule by name
    assert ("nnterp.components.recurrent", "nnterp.recurrent.call", True) in edges  # lazy, in a function
    assert ("nnterp.families", "nnterp.families.llama", True) in edges
    assert ("nnterp.standardized", "nnterp.families", False) in edges  # a name, not a module: the package
    assert ("nnterp.standardized", "nnterp.plot", False) in edges


def test_a_cycle_through_a_lazy_import_fails_and_names_its_files(tmp_path):
    root = tree(
        tmp_path,
        {
            **CLEAN,
            "components/routing.py": "def route():\n    from ..families import llama\n",
            "families/llama.py": "from ..components import recurrent\n",
            "components/recurrent.py": "from . import routing\n",
        },
    )
    found = check_layering.violations(root)
    cycles = [line for line in found if line.startswith("cycle")]
    assert len(cycles) == 1, found
    for name in ("nnterp/components/routing.py", "nnterp/components/recurrent.py", "nnterp/families/llama.py"):
        assert name in cycles[0]
    assert check_layering.cycles(check_layering.imports(root))[0][1] == [
        "nnterp.components.recurrent",
        "nnterp.components.routing",
        "nnterp.families.llama",
        "nnterp.components.recurrent",
    ]
    assert any(line.startswith("upward import: nnterp/components/routing.py:2 (lazy)") for line in found), found


def test_a_cycle_within_one_layer_fails_but_one_under_type_checking_does_not(tmp_path):
    found = check_layering.violations(
        tree(tmp_path, {**CLEAN, "core/a.py": "from . import b\n", "core/b.py": "from .a import x\n"})
    )
    assert len(found) == 1 and found[0].startswith(
        "cycle of 2 modules: nnterp.core.a -> nnterp.core.b -> nnterp.core.a"
    ), found
    typed = {
        "core/a.py": "from . import b\n",
        "core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
    }
    assert check_layering.violations(tree(tmp_path, {**CLEAN, **typed})) == []


def test_an_upward_import_fails_per_the_layer_order(tmp_path):
    bad = {
        "core/dims.py": "from ..fast import scan\n",  # core imports only core
        "fast/delta.py": "from ..core.values import __version__\n",  # fast imports only fast
        "recurrent/labels.py": "from ..components import recurrent\n",
        "components/attention.py": "from nnterp.families import llama\n",
        "families/mamba.py": "from .. import standardized\n",
    }
    found = check_layering.violations(tree(tmp_path, {**CLEAN, **bad}))
    assert sorted(line.split(": ")[1].split(":")[0] for line in found) == sorted(f"nnterp/{name}" for name in bad), (
        found
    )
    assert all(line.startswith("upward import") for line in found), found
    assert "nnterp.core.dims (core) imports nnterp.fast.scan (fast)" in "\n".join(found)


def test_a_private_name_from_another_module_fails(tmp_path):
    found = check_layering.violations(
        tree(
            tmp_path,
            {
                **CLEAN,
                "components/kernels.py": "def _missing(): ...\n",
                "families/olmo.py": "from ..components.kernels import _missing, __doc__\n",
                "components/kimi.py": "from .kernels import _missing as missing\n",
            },
        )
    )
    taken = "imports _missing from nnterp.components.kernels"
    assert found == [
        f"private import: nnterp/components/kimi.py:1: nnterp.components.kimi {taken}",
        f"private import: nnterp/families/olmo.py:1: nnterp.families.olmo {taken}",
    ]


def test_a_function_of_another_module_bound_in_a_class_body_is_found(tmp_path):
    root = tree(
        tmp_path,
        {
            **CLEAN,
            "components/satellite.py": "def record(self):\n    return 1\n\n\ndef other(self):\n    return 2\n\nCONSTANT = 3\n",
            "components/shim.py": "from .satellite import other as moved\n",
            "components/mixer.py": """
                from . import satellite as calls
                from .satellite import record, CONSTANT
                from .shim import moved


                def local(self):
                    return 0


                class Mixer:
                    _run = calls.record
                    again = record
                    wrapped = staticmethod(calls.other)
                    through = moved
                    size = CONSTANT
                    mine = local
                    kind = calls.CONSTANT
                """,
        },
    )
    found = [(path.name, name, origin) for path, _, name, origin in check_layering.bound_functions(root)]
    assert found == [
        ("mixer.py", "Mixer._run", "nnterp.components.satellite.record"),
        ("mixer.py", "Mixer.again", "nnterp.components.satellite.record"),
        ("mixer.py", "Mixer.wrapped", "nnterp.components.satellite.other"),
        ("mixer.py", "Mixer.through", "nnterp.components.satellite.other"),
    ]


def test_a_private_member_read_from_a_strategy_is_found(tmp_path):
    strategy = """
        class Loop:
            def compute(self, mixer, call):
                self._cache = mixer._record()
                return call.mixer._serve, type(mixer).__name__, mixer.public, cls_like._x
        """
    root = tree(tmp_path, {**CLEAN, "recurrent/per_token/loop.py": strategy, "recurrent/call.py": strategy})
    found = [(path.name, read) for path, _, read in check_layering.private_reads(root)]
    assert found == [("loop.py", "mixer._record"), ("loop.py", "call.mixer._serve"), ("loop.py", "cls_like._x")]


def test_a_file_over_the_line_limit_is_found(tmp_path):
    root = tree(tmp_path, {**CLEAN, "core/long.py": "x = 1\n" * 401, "core/short.py": "x = 1\n" * 400})
    assert [(path.name, lines) for path, lines in check_layering.long_files(root)] == [("long.py", 401)]


def test_the_script_exits_nonzero_on_a_violation(tmp_path, capsys):
    assert check_layering.main([str(tree(tmp_path, CLEAN))]) == 0
    assert check_layering.main([str(tree(tmp_path, {**CLEAN, "core/x.py": "from ..families import llama\n"}))]) == 1
    assert "upward import: nnterp/core/x.py:1" in capsys.readouterr().out
    long = tree(tmp_path, {**CLEAN, "core/x.py": "x = 1\n" * 401})
    assert check_layering.main([str(long)]) == 0 and check_layering.main([str(long), "--strict"]) == 1
    assert "long file: nnterp/core/x.py: 401 lines" in capsys.readouterr().out
