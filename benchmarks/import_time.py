"""What ``import nnterp`` costs over ``import nnsight, transformers``, measured side by side in one run.

    python benchmarks/import_time.py                  # 9 runs each, updates docs/performance.md
    python benchmarks/import_time.py --runs 3 --out /tmp/perf.md

Each run starts a fresh interpreter per statement, the two statements in
alternating order, and times it from start to exit (wall clock); the table
gives the medians, the [min, max] and their difference (the target: at most
1.5 s). It also lists the transformers modeling modules that ``import nnterp``
imports (``sys.modules`` before and after, in one interpreter).

The result is the "Import time" section of ``--out`` (``docs/performance.md``),
written between the marker comments `BEGIN` and `END` below; `run.py` keeps
that section when it rewrites the page.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- import-time: made by benchmarks/import_time.py; do not edit by hand -->"
END = "<!-- /import-time -->"
BASE = "import nnsight, transformers"
WITH = "import nnsight, transformers, nnterp"
TARGET_S = 1.5
MODELING = """
import sys
import nnsight, transformers
before = set(sys.modules)
import nnterp
new = sorted(set(sys.modules) - before)
print(__import__("json").dumps({
    "modeling": [m for m in new if m.startswith("transformers.models.") and ".modeling_" in m],
    "transformers": len([m for m in new if m.startswith("transformers.")]),
    "all": len(new),
    "nnterp": nnterp.__file__,
}))
"""


def env() -> dict:
    """The child interpreters' environment: this checkout's nnterp first on the path."""
    found = dict(os.environ)
    found["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in found.get("PYTHONPATH", "").split(os.pathsep) if p])
    return found


def once(statement: str, python: str) -> float:
    began = time.perf_counter()
    subprocess.run([python, "-c", statement], check=True, env=env(), cwd=ROOT)
    return time.perf_counter() - began


def measure(runs: int, python: str = sys.executable) -> dict:
    """``{statement: [seconds, ...]}``: ``runs`` fresh interpreters per statement, interleaved."""
    once(WITH, python)  # warm the file cache (.pyc files, shared libraries) before timing
    times: dict = {BASE: [], WITH: []}
    for repeat in range(runs):
        order = (BASE, WITH) if repeat % 2 == 0 else (WITH, BASE)
        for statement in order:
            times[statement].append(once(statement, python))
    return times


def modeling_modules(python: str = sys.executable) -> dict:
    """The modules ``import nnterp`` adds after ``import nnsight, transformers``."""
    out = subprocess.run([python, "-c", MODELING], check=True, env=env(), cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def importtime(python: str = sys.executable) -> list:
    """``[(module, importer, cumulative seconds)]``: the modules outside nnterp that nnterp's modules import
    first, from one ``-X importtime`` run after ``import nnsight, transformers``, largest first."""
    out = subprocess.run(
        [python, "-X", "importtime", "-c", "import nnsight, transformers; import nnterp"],
        check=True,
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    pending: dict = {}  # depth -> [(name, cumulative us, children)] printed, parent not yet printed
    found = []
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        _, cumulative, raw = line.split("|", 2)
        depth = (len(raw) - len(raw.lstrip()) - 1) // 2
        name = raw.strip()
        children = pending.pop(depth + 1, [])
        if name.startswith("nnterp"):
            found += [(child, name, us / 1e6) for child, us, _ in children if not child.startswith("nnterp")]
        pending.setdefault(depth, []).append((name, int(cumulative), children))
    return sorted(found, key=lambda row: -row[2])


def render(times: dict, modules: dict, command: str, largest: list = ()) -> str:
    base, with_nnterp = statistics.median(times[BASE]), statistics.median(times[WITH])
    difference = with_nnterp - base
    met = "met" if difference <= TARGET_S else "**missed**"
    versions = _versions()
    modeling = modules["modeling"]
    lines = [
        BEGIN,
        "## Import time",
        "",
        f"* Command: `{command}`",
        f"* Machine: {_cpu()}, {os.cpu_count()} cores, {versions}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"* {len(times[BASE])} fresh interpreters per statement, interleaved; wall time from start to exit, "
        "interpreter start included (the same in both rows).",
        "",
        "| statement | median s | [min, max] s |",
        "|---|---:|---:|",
        f"| `{BASE}` | {base:.2f} | [{min(times[BASE]):.2f}, {max(times[BASE]):.2f}] |",
        f"| `{WITH}` | {with_nnterp:.2f} | [{min(times[WITH]):.2f}, {max(times[WITH]):.2f}] |",
        f"| difference of the medians (target ≤ {TARGET_S} s: {met}) | {difference:.2f} | |",
        "",
        f"`import nnterp` adds {modules['all']} modules ({modules['transformers']} of transformers), "
        + (
            f"{len(modeling)} of them modeling modules: " + ", ".join(f"`{m}`" for m in modeling) + "."
            if modeling
            else "no modeling module."
        ),
    ]
    if largest:
        lines += [
            "",
            "The largest imports nnterp's own modules make (one `-X importtime` run, cumulative: a dependency "
            "shared by several modules counts for the first one to import it):",
            "",
            "| module | imported by | s |",
            "|---|---|---:|",
        ]
        lines += [f"| `{name}` | `{importer}` | {seconds:.2f} |" for name, importer, seconds in largest[:8]]
    lines += [
        END,
    ]
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.M)
    return found.group(1).strip() if found else platform.machine()


def _versions() -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, transformers, nnsight, sys; "
            "print(f'torch {torch.__version__}, transformers {transformers.__version__}, '"
            "f'nnsight {nnsight.__version__}, Python {sys.version.split()[0]}')",
        ],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or f"Python {platform.python_version()}"


def section(text: str) -> str | None:
    """The import-time section of a page, markers included (None when it has none)."""
    found = re.search(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", text, flags=re.S)
    return found.group(0) if found else None


def with_section(text: str, new: str | None) -> str:
    """``text`` with its import-time section replaced by ``new`` (appended when it has none; unchanged if None)."""
    if new is None:
        return text
    old = section(text)
    if old is not None:
        return text.replace(old, new if new.endswith("\n") else new + "\n")
    return text.rstrip("\n") + "\n\n" + new


def main(argv: list | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--python", default=sys.executable, help="the interpreter to time (default: this one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    modules = modeling_modules(args.python)
    largest = importtime(args.python)
    times = measure(args.runs, args.python)
    command = "python benchmarks/import_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(times, modules, command.strip(), largest)
    print(text)
    out = Path(args.out)
    out.write_text(with_section(out.read_text() if out.exists() else "# Performance\n", text))
    return {"times": times, "modules": modules, "largest": largest}


if __name__ == "__main__":
    main()
