"""Run the test suites on every supported transformers release and write ``docs/versions.md``.

    python scripts/version_table.py                       # every release in RELEASES
    python scripts/version_table.py --releases 5.20.2 5.24.0 --jobs 2

Each release runs through ``scripts/test_transformers_version.sh`` (its own
cached virtual environment) with a JUnit report; every test is then credited
to a family, and the table has one row per registered family and one column per
release: ``pass (n)`` when all ``n`` of the family's tests passed there,
``FAIL (k of n)`` otherwise. A test belongs to a family when

* it is in ``tests/families/test_<family>.py``;
* its parameters name one of the family's ``model_type`` values
  (``test_logits_equal_plain_transformers[qwen3_next]``);
* it is in ``tests/components/test_<component>.py`` and the family's mixer is
  the component defined in ``nnterp/components/<component>.py`` (the
  component's own suite runs on that family's checkpoint).

Tests credited to no family (the oracles' self-tests on no particular family,
the HF ``kernels`` stand-in) form the ``(shared)`` row. The page also records
each release's pytest summary line and wall time, and carries the results as
JSON in a comment for ``scripts/family_guide.py``. Exit status: 0 when every
cell passed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "test_transformers_version.sh"
#: The releases nnterp supports: the oldest of the ``use_precomputed_states`` style (5.18-5.20),
#: the last of it, and each later minor release's latest patch.
RELEASES = ("5.18.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0")
SHARED = "(shared)"
MARK = "nnterp-version-results"


def venv_python(release: str) -> Path:
    """The Python of ``release``'s environment (where `SCRIPT` builds it)."""
    import os

    root = Path(os.environ.get("NNTERP_VENVS", Path.home() / ".cache" / "nnterp" / "venvs"))
    return root / f"transformers-{release}" / "bin" / "python"


def families(python: Path) -> dict[str, dict]:
    """``{family: {"model_types": [...], "component": stem or None}}`` from the registry, read by ``python``."""
    code = (
        "import json\n"
        "from nnterp.families import families\n"
        "out = {}\n"
        "for f in families():\n"
        "    mixer = f.MIXER\n"
        "    module = mixer.__module__ if mixer is not None else ''\n"
        "    stem = module.rsplit('.', 1)[-1] if module.startswith('nnterp.components.') else None\n"
        "    out[f.NAME] = {'model_types': list(f.MODEL_TYPES), 'component': stem}\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def owner(test_file: str, name: str, registry: dict[str, dict]) -> str:
    """The family a test is credited to (see the module docstring), or `SHARED`."""
    stem = Path(test_file).stem.removeprefix("test_")
    parts = Path(test_file).parts
    if "families" in parts and stem in registry:
        return stem
    params = re.findall(r"[A-Za-z0-9_.]+", name.partition("[")[2])
    for family, info in registry.items():
        if any(param in info["model_types"] for param in params):
            return family
    if "components" in parts:
        for family, info in registry.items():
            if info["component"] == stem:
                return family
    return SHARED


def run_release(release: str, report: Path, extra: list[str]) -> dict:
    """Run the suites on ``release``; ``{"summary", "seconds", "rc", "log"}``."""
    start = time.monotonic()
    cmd = [str(SCRIPT), release, f"--junitxml={report}", "-q", "-p", "no:cacheprovider", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - start
    lines = [line.strip("= ").strip() for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    summary = lines[-1] if lines else f"no pytest summary (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
    return {"summary": summary, "seconds": round(seconds), "rc": proc.returncode, "log": proc.stdout[-4000:] + proc.stderr[-2000:]}


def module_file(classname: str) -> str:
    """The test file of a JUnit ``classname`` (``tests.components.test_x`` or ``tests.components.test_x.TestSuite``)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (REPO / candidate).exists():
            return candidate
    return "/".join(parts) + ".py"


def tally(report: Path, registry: dict[str, dict]) -> dict[str, dict]:
    """``{family: {"passed": n, "failed": [test ids]}}`` from a JUnit report."""
    out: dict[str, dict] = {}
    if not report.exists():
        return out
    for case in ET.parse(report).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_file = module_file(classname)
        if case.find("skipped") is not None:
            continue
        family = owner(test_file, name, registry)
        entry = out.setdefault(family, {"passed": 0, "failed": []})
        if case.find("failure") is not None or case.find("error") is not None:
            entry["failed"].append(f"{classname}::{name}")
        else:
            entry["passed"] += 1
    return out


def cell(entry: dict | None) -> str:
    if not entry:
        # Only a family the release does not have runs no test there (its test file is collected as one skip).
        return "absent from this release"
    total = entry["passed"] + len(entry["failed"])
    return f"pass ({total})" if not entry["failed"] else f"**FAIL** ({len(entry['failed'])} of {total})"


def render(results: dict[str, dict], registry: dict[str, dict]) -> str:
    releases = list(results)
    rows = [*registry, SHARED]
    lines = [
        "# Tested transformers releases",
        "",
        "<!-- Generated by scripts/version_table.py: do not edit by hand. -->",
        "",
        "Every registered family against every supported transformers release: the contract suite",
        "(`tests/test_contract.py`), the recurrent component suites (`tests/components/`), the family",
        "suites (`tests/families/`), the fast path's (`tests/fast/`) and the oracles' own tests (`tests/reference/`), each run by",
        "`scripts/test_transformers_version.sh RELEASE` in that release's own virtual environment",
        "(torch 2.13.0 CPU, nnsight 0.8.1). A cell is `pass (n)` when all `n` tests credited to the",
        "family passed on that release (how tests are credited: `scripts/version_table.py`).",
        "",
        "| family | " + " | ".join(releases) + " |",
        "| --- | " + " | ".join("---" for _ in releases) + " |",
    ]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(cell(results[r]["families"].get(row)) for r in releases) + " |")
    lines += ["", "## Runs", "", "| release | pytest summary | wall time |", "| --- | --- | --- |"]
    for release in releases:
        run = results[release]
        lines.append(f"| {release} | `{run['summary']}` | {run['seconds']} s |")
    failures = [(r, test) for r in releases for entry in results[r]["families"].values() for test in entry["failed"]]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {release}: `{test}`" for release, test in failures]
    payload = {r: {"summary": results[r]["summary"], "families": {f: {"passed": e["passed"], "failed": len(e["failed"])} for f, e in results[r]["families"].items()}} for r in releases}
    lines += ["", f"<!-- {MARK} {json.dumps(payload, sort_keys=True)} -->", ""]
    return "\n".join(lines)


def read_results(path: Path) -> dict:
    """The JSON a previous run left in ``docs/versions.md`` (``{}`` if none)."""
    if not path.exists():
        return {}
    found = re.search(rf"<!-- {MARK} (.*) -->", path.read_text())
    return json.loads(found.group(1)) if found else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", nargs="+", default=list(RELEASES))
    parser.add_argument("--jobs", type=int, default=1, help="releases run at once (each pytest uses one thread)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "versions.md")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after the release (default: the suites)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        def one(release: str) -> tuple[str, dict]:
            run = run_release(release, Path(tmp) / f"{release}.xml", args.pytest_args)
            print(f"{release}: {run['summary']} ({run['seconds']} s)", flush=True)
            if run["rc"] not in (0, 1):
                print(run["log"], file=sys.stderr)
            return release, run

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            done = dict(pool.map(one, args.releases))
        registry = families(venv_python(args.releases[-1]))
        for release, run in done.items():
            run["families"] = tally(Path(tmp) / f"{release}.xml", registry)
    results = {release: done[release] for release in args.releases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, registry))
    print(f"wrote {args.out}")
    ok = all(not entry["failed"] for run in results.values() for entry in run["families"].values()) and all(
        run["rc"] == 0 for run in results.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
