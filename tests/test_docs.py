"""Every ```python block of the docs and the README runs, and prints what its page says.

A page's blocks run in order in one namespace, against tiny checkpoints: a hub
id in a page (``"Qwen/Qwen3.5-0.8B"``) resolves, in this test only, to the tiny
checkpoint of its family (`HUB`), so the page keeps showing the real id.

What a ``print`` is checked against, on the page:

* a trailing comment on the print's line: ``print(x.shape)  # torch.Size([1, 16])``;
* otherwise the comment lines right below it, one per printed line (a loop's
  prints included).

The comment is the output on the *real* checkpoint, so it is compared
structurally (`compare`): strings, identifiers, booleans, ``None`` and brackets
must match exactly and lists must have as many elements; numbers may differ
(shapes, norms and token counts depend on the checkpoint). A comment starting
``(exact)`` compares numbers too. One starting ``(real weights)`` (a
probability, decoded text, a table of norms) or ``(real checkpoint)`` (what
depends on the real config or tokenizer, such as the list of its recurrent
layers) is not compared. Everything else a page claims is checked by its own
code (``assert torch.equal(...)``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import itertools
import linecache
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import nnterp
from nnterp.families import families
from nnterp.recurrent.kernels import STASH
from nnterp.testing import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [p for p in sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"] if "```python" in p.read_text()]

#: Hub id shown on a page -> the tiny checkpoint (``nnterp.testing`` name) it runs against here:
#: every published checkpoint a family records (``REAL_CHECKPOINTS``) runs on that family's.
HUB = {checkpoint: family.MODEL_TYPES[0] for family in families() for checkpoint in family.REAL_CHECKPOINTS}

SKIP_MARKS = ("(real weights)", "(real checkpoint)")
EXACT_MARK = "(exact)"
_COUNTER = itertools.count()


# -- the comparator ------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<string>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
    r"""|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"""
    r"""|(?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)"""
    r"""|(?P<other>\S)"""
)


def tokens(text: str) -> list[tuple[str, str]]:
    """``(kind, text)`` for each token of printed output; whitespace only separates."""
    return [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text)]


def compare(expected: str, actual: str, exact: bool = False) -> str | None:
    """``None`` when ``actual`` has ``expected``'s structure, else what differs.

    Numbers match any number (any number matches when ``exact`` is false);
    everything else, token for token.
    """
    want, got = tokens(expected), tokens(actual)
    for index, (w, g) in enumerate(itertools.zip_longest(want, got)):
        if w is None or g is None:
            extra = "more" if w is None else "fewer"
            return f"the output has {extra} tokens than the page: {actual!r} against {expected!r}"
        if w[0] == g[0] == "number" and not exact:
            continue
        if w != g:
            return f"token {index}: {g[1]!r} where the page has {w[1]!r} ({actual!r} against {expected!r})"
    return None


def expectation(comment: str) -> tuple[str, str]:
    """``(mode, text)`` of a comment: mode ``"skip"``, ``"exact"`` or ``"structure"``."""
    text = comment.lstrip("#").strip()
    if text.startswith(SKIP_MARKS):
        return "skip", text
    if text.startswith(EXACT_MARK):
        return "exact", text[len(EXACT_MARK):].strip()
    return "structure", text


# -- a page's blocks -------------------------------------------------------------


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, code)`` of each ```python fence, lines numbered as in the file."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if code is None and re.fullmatch(r"```python(\s.*)?", stripped):
            code, start = [], number + 1
        elif code is not None and stripped == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def _comments(code: str) -> tuple[dict[int, str], dict[int, str]]:
    """Trailing comments (after code on a line) and comment-only lines, by line number."""
    trailing, alone = {}, {}
    code_lines = set()
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT:
            (trailing if token.start[0] in code_lines else alone)[token.start[0]] = token.string
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return trailing, alone


def expected_prints(code: str) -> dict[int, tuple[str, list[str], bool]]:
    """For each ``print(...)`` statement with an expectation: ``{line: (mode, expected lines, per_call)}``.

    ``line`` is the statement's first line; ``per_call`` is true for a trailing
    comment (each call is compared with it) and false for comment lines below
    (all calls' output, line by line).
    """
    trailing, alone = _comments(code)
    found = {}
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        if not (isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            continue
        comment = trailing.get(node.end_lineno) or trailing.get(node.lineno)
        if comment is not None:
            mode, text = expectation(comment)
            found[node.lineno] = (mode, [text], True)
            continue
        below = []
        line = node.end_lineno + 1
        while line in alone:
            below.append(alone[line])
            line += 1
        if below:
            mode, first = expectation(below[0])
            lines = [first] + [expectation(c)[1] for c in below[1:]]
            found[node.lineno] = (mode, lines if mode != "skip" else [], False)
    return found


def rewrite(code: str, paths: dict[str, str]) -> str:
    """The block as it runs here: hub ids -> tiny checkpoints, ``print`` -> a recorder keyed by line."""
    for hub_id, path in paths.items():
        code = code.replace(f'"{hub_id}"', repr(path)).replace(f"'{hub_id}'", repr(path))
    lines = code.splitlines(keepends=True)
    names = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and n.id == "print"]
    for node in sorted(names, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        row = lines[node.lineno - 1].encode()  # ast columns count UTF-8 bytes
        name = f"_print_at_{node.lineno}".encode()
        lines[node.lineno - 1] = (row[: node.col_offset] + name + row[node.end_col_offset:]).decode()
    return "".join(lines)


def _unknown_hub_ids(code: str) -> list[str]:
    unknown = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            value = node.args[0].value
            if name in ("StandardizedTransformer", "from_pretrained") and isinstance(value, str):
                if re.fullmatch(r"[\w.-]+/[\w.-]+", value) and value not in HUB and not Path(value).exists():
                    unknown.append(value)
    return unknown


class Recorder:
    """``print`` for one line of a block: records each call's text, echoes it."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __call__(self, *args, sep=" ", end="\n", file=None, flush=False):
        if file is not None and file is not sys.stdout:
            print(*args, sep=sep, end=end, file=file, flush=flush)
            return
        text = sep.join(str(a) for a in args) + end
        self.calls.append(text)
        sys.stdout.write(text)


def check_outputs(where: str, expected: dict, printed: dict) -> list[str]:
    failures = []
    for line, (mode, lines, per_call) in expected.items():
        if mode == "skip":
            continue
        calls = printed.get(line, [])
        at = f"{where}:{line}"
        if not calls:
            failures.append(f"{at}: the page shows output, but this print never ran")
            continue
        exact = mode == "exact"
        if per_call:
            for text in calls:
                problem = compare(lines[0], text, exact)
                if problem:
                    failures.append(f"{at}: {problem}")
            continue
        out = "".join(calls).rstrip("\n").split("\n")
        if len(out) != len(lines):
            failures.append(f"{at}: printed {len(out)} lines, the page shows {len(lines)} (mark it '(real weights)'?)")
            continue
        for want, got in zip(lines, out):
            problem = compare(want, got, exact)
            if problem:
                failures.append(f"{at}: {problem}")
    return failures


def _restore_kernels() -> None:
    """A page may leave a family routed (a recipe ends mid-study); undo it like a new process would."""
    for family in families():
        stash = family.MODELING.__dict__.get(STASH, {})
        if any(family.MODELING.__dict__[name] is not fn for name, fn in stash.items()):
            nnterp.route_kernels(family, "default")


def run_page(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    blocks = python_blocks(path.read_text())
    paths = {hub_id: str(tiny_checkpoint(model_type)) for hub_id, model_type in HUB.items()}
    namespace: dict = {"__name__": "__docs__"}
    try:
        for start, code in blocks:
            where = f"{relative}:{start}"
            unknown = _unknown_hub_ids(code)
            assert not unknown, f"{where}: hub ids {unknown} have no tiny checkpoint: add them to their family's REAL_CHECKPOINTS (nnterp/families/)"
            expected = expected_prints(code)
            printed: dict[int, list] = {}
            for line in {n.lineno for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and n.id == "print"}:
                namespace[f"_print_at_{line}"] = Recorder(printed.setdefault(line, []))
            # Padded so line numbers (tracebacks, nnsight's block capture) are the page's own.
            source = "\n" * (start - 1) + rewrite(code, paths)
            filename = f"<docs {relative} #{next(_COUNTER)}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            exec(compile(source, filename, "exec"), namespace)
            # Blocks shift print lines by their start: report page lines.
            failures = check_outputs(relative, {start - 1 + k: v for k, v in expected.items()}, {start - 1 + k: v for k, v in printed.items()})
            assert not failures, "\n".join(failures)
    finally:
        _restore_kernels()


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_runs_and_prints_what_it_shows(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a page may save a figure: not into the repository
    run_page(path)


# -- the "Coming from nnterp 1.x" page's name tables ---------------------------------

ONEX_PAGE = DOCS / "coming-from-1x.md"
ONEX_HEADER = "| nnterp 1.x | status | notes |"
#: A row's status -> whether its names resolve.
ONEX_STATUSES = {"served": True, "changed": True, "ignored": True, "new": True, "refused": False, "not served": False}
#: Names the issue asked the page to list (nnterp 1.x's, served again): removing a row shows here.
ONEX_REQUIRED = (
    "nnterp.standardized_transformer.StandardizedTransformer", "model.model.layers", "model.model.ln_final",
    "model.model.device", "model.attention_probabilities.enabled", "model.attention_probabilities.disable",
    "model.attention_probabilities.check_source", "model.attention_probabilities.print_source",
    "model.detect_layer_output_type", "model.add_prefix_false_tokenizer", "nnterp.interventions.logit_lens(nn_model=)",
    "model.skip_layers(layer_returns_tuple=)", "model.steer(positions=)", "StandardizedTransformer(remote=True)",
    "nnterp.logging.logger", "nnterp.display.plot_topk_tokens", "nnterp.utils.unpack_tuple",
)


def onex_rows(text: str) -> list[tuple[str, list[str]]]:
    """``(status, names)`` of each row of the page's name tables (header `ONEX_HEADER`).

    A cell's names are its backticked items; a bare name after a module
    (``nnterp.display``: ``plot_topk_tokens``) is that module's attribute.
    """
    rows, in_table = [], False
    for line in text.splitlines():
        if line.strip() == ONEX_HEADER:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-"}:
            continue
        names, module = [], None
        for item in re.findall(r"`([^`]+)`", cells[0]):
            if re.fullmatch(r"nnterp(\.\w+)*", item) and _is_module(item):
                module = item
                if item != "nnterp":
                    continue
            elif module is not None and re.fullmatch(r"\w+", item):
                item = f"{module}.{item}"
            names.append(item)
        rows.append((cells[1], names))
    return rows


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError):  # a name under a module that is not a package
        return False


def _resolves(name: str, model, path: str) -> bool:
    """Whether ``name`` (an import path, ``model.`` attribute path, ``call(keyword=)`` or ``StandardizedTransformer(k=v)``) resolves."""
    from nnterp import NnterpError, StandardizedTransformer

    call = re.fullmatch(r"([\w.\[\]]+)\((\w+)=(.*)\)", name)
    if call and call.group(1) == "StandardizedTransformer" and call.group(3):
        try:
            StandardizedTransformer(path, **{call.group(2): ast.literal_eval(call.group(3))})
        except TypeError as error:
            assert isinstance(error, NnterpError), f"{name}: {error!r} is not nnterp's"
            return False
        return True
    if call:
        assert not call.group(3), f"{name}: a keyword takes a value only on StandardizedTransformer(...)"
        if not _resolves(call.group(1), model, path):
            return False
        return call.group(2) in inspect.signature(_resolve(call.group(1), model)).parameters
    try:
        _resolve(name, model)
    except (AttributeError, ImportError):
        return False
    return True


def _resolve(name: str, model):
    """The object ``name`` names; a trace-only value is looked up on its class, not read."""
    assert re.fullmatch(r"(nnterp|model)(\.\w+(\[i\])?)*", name), f"{name!r}: not a name form the test knows (see onex_rows)"
    parts = name.split(".")
    if parts[0] == "nnterp":
        found, rest = importlib.import_module("nnterp"), parts[1:]
        while rest and _is_module(f"{found.__name__}.{rest[0]}"):
            found, rest = importlib.import_module(f"{found.__name__}.{rest[0]}"), rest[1:]
    else:
        found, rest = model, parts[1:]
    for index, part in enumerate(rest):
        attribute, indexed = part.removesuffix("[i]"), part.endswith("[i]")
        last = index == len(rest) - 1
        static = inspect.getattr_static(found, attribute, _ABSENT)
        if last and static is not _ABSENT and not indexed:
            return static  # a property may be trace-only (`logits`): that it exists is enough
        found = getattr(found, attribute)
        if indexed and not last:
            found = found[0]
    return found


_ABSENT = object()


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_coming_from_1x_tables_match_the_code(model_type):
    from nnterp import StandardizedTransformer

    rows = onex_rows(ONEX_PAGE.read_text())
    names = [name for _, row in rows for name in row]
    assert len(rows) >= 30 and not [n for n in ONEX_REQUIRED if n not in names], [n for n in ONEX_REQUIRED if n not in names]
    path = str(tiny_checkpoint(model_type))
    model = StandardizedTransformer(path)
    wrong = []
    for status, row in rows:
        assert status in ONEX_STATUSES, f"status {status!r} of {row}: not one of {sorted(ONEX_STATUSES)}"
        assert row, f"a {status} row names nothing"
        wrong += [f"{name} ({status})" for name in row if _resolves(name, model, path) != ONEX_STATUSES[status]]
    assert not wrong, f"docs/coming-from-1x.md says, and the code disagrees: {wrong}"


def test_coming_from_1x_rows_are_read_as_written():
    page = (
        "| nnterp 1.x | status | notes |\n|---|---|---|\n"
        "| `nnterp.display`: `plot_topk_tokens`, `model.layers[i].mlp` | served | x `y` |\n"
        "| `StandardizedTransformer(rename_config=None)` | refused | |\n\ntext\n| a | b |\n"
    )
    assert onex_rows(page) == [
        ("served", ["nnterp.display.plot_topk_tokens", "model.layers[i].mlp"]),
        ("refused", ["StandardizedTransformer(rename_config=None)"]),
    ]


# -- the generated page and the site ----------------------------------------------


def _gen_support():
    spec = importlib.util.spec_from_file_location("gen_support", DOCS / "gen_support.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_support_page_is_generated():
    generator = _gen_support()
    assert generator.PAGE.read_text() == generator.render(), "docs/support.md is stale: run python docs/gen_support.py"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- the comparator itself ------------------------------------------------------------


@pytest.mark.parametrize(
    "expected, actual",
    [
        ("None torch.Size([1, 16, 128, 128]) 8.596", "None torch.Size([1, 4, 16, 8]) 4.495"),
        ("3 (1, 3, 16, 128) (1, 3, 16, 128, 128) True", "7 (1, 7, 2, 16) (1, 7, 4, 16, 8) True"),
        ("<kernel.inputs> <_token_state_op> <_states>", "<kernel.inputs>  <_token_state_op> <_states>"),
        ("LinearAttention torch_chunk_gated_delta_rule_0 last_recurrent_state_3", "LinearAttention torch_chunk_gated_delta_rule_0 last_recurrent_state_3"),
        ("'The'      2.802", "'The' 4.119"),
        ("0.0117", "0.0000"),
        ("1e-05 -3", "2.5E+03 +7"),
    ],
)
def test_compare_accepts_the_same_structure(expected, actual):
    assert compare(expected, actual) is None


@pytest.mark.parametrize(
    "expected, actual, exact",
    [
        ("True False", "True True", False),  # a wrong boolean
        ("[0, 0, 1]", "[0, 0]", False),  # a missing list element
        ("[0, 1, 2, 4]", "[0, 1, 2]", False),
        ("None torch.Size([1, 16])", "tensor(0.) torch.Size([1, 16])", False),  # None became a tensor
        ("' Paris' 0.590", "'ou' 0.066", False),  # a string differs
        ("last_recurrent_state_3", "last_recurrent_state_4", False),  # an identifier's digits are the identifier
        ("[3, 1, 1] [0, 0, 1]", "[3, 1, 1] [0, 1, 1]", True),  # (exact): numbers too
        ("(1, 3)", "(1, 3", False),  # a bracket
        ("x", "x y", False),  # extra output
    ],
)
def test_compare_rejects_a_different_structure(expected, actual, exact):
    assert compare(expected, actual, exact) is not None


def test_expectations_are_read_from_the_page():
    code = (
        "print(1 == 1, [1, 2])   # True [7, 8]\n"
        "print('a')\n"
        "# (real weights) 'b'\n"
        "for i in range(2):\n"
        "    print(i)\n"
        "# (exact) 0\n"
        "# 1\n"
        "print(None)   # (real checkpoint) [0, 1]\n"
        "print('no comment')\n"
    )
    assert expected_prints(code) == {
        1: ("structure", ["True [7, 8]"], True),
        2: ("skip", [], False),
        5: ("exact", ["0", "1"], False),
        8: ("skip", ["(real checkpoint) [0, 1]"], True),
    }
    printed = {1: ["True [1, 2]\n"], 2: ["a\n"], 5: ["0\n", "2\n"], 8: ["None\n"], 9: ["no comment\n"]}
    failures = check_outputs("page.md", expected_prints(code), printed)
    assert len(failures) == 1 and "page.md:5" in failures[0] and "'2'" in failures[0]
    assert check_outputs("page.md", {1: ("structure", ["True"], True)}, {1: []})  # a print that never ran fails


def test_blocks_keep_their_page_lines_and_hub_ids_are_rewritten():
    page = "# t\n\n```python\nm = StandardizedTransformer(\"Qwen/Qwen3.5-0.8B\")\nprint(m)  # x\n```\n\n```bash\nls\n```\n"
    (start, code), = python_blocks(page)
    assert start == 4 and code.startswith("m = ")
    out = rewrite(code, {"Qwen/Qwen3.5-0.8B": "/tmp/tiny"})
    assert "'/tmp/tiny'" in out and "_print_at_2(m)" in out and "Qwen" not in out
    assert _unknown_hub_ids('StandardizedTransformer("someone/unknown-model")') == ["someone/unknown-model"]
    assert rewrite('x = "é‖"; print(x)  # é‖\n', {}) == 'x = "é‖"; _print_at_1(x)  # é‖\n'  # columns are bytes
