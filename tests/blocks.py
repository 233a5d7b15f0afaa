"""Run a page's code block as a user would, and check what it prints against the comments it is written with.

nnsight reads a ``with`` block's body back from its source file, so a block
is written to a file and run from there (`run_block`). A page prints results
with the expected output in a trailing comment (``print(x)  # True``), written
for the real checkpoints; on a tiny one only the structural facts hold, so
each top-level commented print is checked for the ``True`` / ``False`` /
``None`` words of its comment, in order, and numbers and shapes are left alone.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

COMMENTED_PRINT = re.compile(r"^print\((.*)\)\s+#\s(.*)$")
WORDS = ("True", "False", "None")


def structural(text: str) -> list[str]:
    """The ``True`` / ``False`` / ``None`` words of ``text``, in order."""
    return [word for word in re.findall(r"[A-Za-z_]+", text) if word in WORDS]


def instrument(code: str) -> str:
    """``code`` with each top-level ``print(args)  # comment`` also recording ``(comment, printed)``."""
    lines = []
    for line in code.splitlines():
        match = COMMENTED_PRINT.match(line)
        lines.append(f"__printed__({match.group(2)!r}, {match.group(1)})" if match else line)
    return "\n".join(lines) + "\n"


def run_block(code: str, directory: Path, name: str, scope: dict) -> list[tuple[str, str]]:
    """Run ``code`` from ``directory/name.py`` in ``scope``; return ``(comment, printed)`` of its commented prints."""
    records: list[tuple[str, str]] = []

    def printed(comment: str, *args) -> None:
        text = " ".join(str(arg) for arg in args)
        print(text)
        records.append((comment, text))

    scope["__printed__"] = printed
    source = instrument(code)
    path = Path(directory) / f"{name}.py"
    path.write_text(source)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, str(path), "exec"), scope)
    return records


def check_printed(records: list[tuple[str, str]]) -> int:
    """Assert each commented print shows the ``True``/``False``/``None`` its comment does; return how many had some."""
    checked = 0
    for comment, text in records:
        words = structural(comment)
        assert structural(text) == words, f"printed `{text}`, the page says `{comment}`"
        checked += bool(words)
    return checked
