"""`nnterp.long_context_profile`'s peak memory and time per token against the sequence's length, one process per length.

    taskset -c 0 python -m benchmarks.long_context                       # 4k, 64k, 256k; updates docs/performance.md
    taskset -c 0 python -m benchmarks.long_context --lengths 4096 1048576 --out /tmp/perf.md

Each length runs in a fresh interpreter (a child of this one) on a tiny
recurrent-only model (the xLSTM of ``nnterp.testing.tiny_checkpoint``, whose
cache carries its state from chunk to chunk): load, a warm-up profile of
one chunk, then the profile of ``length`` random tokens in chunks of
``--chunk-size``, with ``every`` set so that the output keeps 256 rows a layer
whatever the length (the output is the one thing meant to grow), and
effective memory at the last token for lags 0, 1, 16 and 256. The child
reports its RSS high-water mark (``resource.getrusage``, which counts the
model, torch and the interpreter: the same in every child) after loading and
after the profile, and the profile's wall time. The target: the peak at the
longest length at most 1.1x the peak at the shortest.

The result is the "Long contexts" section of ``--out`` (``docs/performance.md``),
between the marker comments `BEGIN` and `END` below; `run.py` keeps that
section when it rewrites the page.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- long-context: made by benchmarks/long_context.py; do not edit by hand -->"
END = "<!-- /long-context -->"
SECTION = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", flags=re.S)
MODEL = "xlstm"
TARGET = 1.1
TARGET_LENGTH = 262144  # issue 26: the peak at 256k tokens against the peak at 4k
ROWS = 256
CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
import nnterp
from nnterp.testing import tiny_checkpoint
length, chunk_size, rows = (int(x) for x in sys.argv[1:4])
model = nnterp.StandardizedTransformer(str(tiny_checkpoint(sys.argv[4])), dispatch=True, device="cpu")
ids = torch.randint(3, 200, (length,), generator=torch.Generator().manual_seed(0))
nnterp.long_context_profile(model, ids[:chunk_size], chunk_size=chunk_size, memory_at=[], progress=False)
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.perf_counter()
profile = nnterp.long_context_profile(
    model, ids, chunk_size=chunk_size, every=max(1, length // rows), memory_at=[length - 1], lags=[0, 1, 16, 256], progress=False
)
seconds = time.perf_counter() - began
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"length": length, "loaded_kib": loaded, "peak_kib": peak, "seconds": seconds,
                  "rows": profile.state_norm[next(iter(profile.state_norm))].shape[0], "layers": len(profile.state_norm)}))
"""


def measure(length: int, chunk_size: int, python: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([python, "-c", CHILD, str(length), str(chunk_size), str(ROWS), MODEL], check=True, env=env, cwd=ROOT,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(results: list[dict], chunk_size: int) -> str:
    first = results[0]["peak_kib"]
    lines = [
        BEGIN,
        "## Long contexts",
        "",
        f"`nnterp.long_context_profile` on the tiny `{MODEL}` checkpoint (recurrent only: {results[0]['layers']} mLSTM layers), "
        f"chunks of {chunk_size} tokens, one process per length (peak: its RSS high-water mark, model and interpreter included), "
        f"{ROWS} kept rows a layer, effective memory at the last token for 4 lags. {platform.processor() or platform.machine()}, "
        "one thread, pinned to one core.",
        "",
        "| tokens | peak RSS (MiB) | peak / peak at the shortest | RSS after loading (MiB) | profile time (s) | time per token (µs) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row['length']:,} | {row['peak_kib'] / 1024:.0f} | {row['peak_kib'] / first:.3f} | {row['loaded_kib'] / 1024:.0f} | "
            f"{row['seconds']:.1f} | {row['seconds'] / row['length'] * 1e6:.0f} |"
        )
    at = next((row for row in results if row["length"] == TARGET_LENGTH), results[-1])
    ratio = at["peak_kib"] / first
    verdict = "met" if ratio <= TARGET else "missed"
    longest = "" if at is results[-1] else f" (at {results[-1]['length']:,}: {results[-1]['peak_kib'] / first:.3f}x)"
    lines += [
        "",
        f"Target: peak at {at['length']:,} tokens ≤ {TARGET}x the peak at {results[0]['length']:,}: {ratio:.3f}x, {verdict}{longest}. "
        "Times come from a machine other work shares, so they are upper bounds; the peaks do not depend on it.",
        END,
    ]
    return "\n".join(lines) + "\n"


def with_section(page: str, section: str) -> str:
    """``page`` with its long-context section replaced by ``section`` (appended where it has none)."""
    if SECTION.search(page):
        return SECTION.sub(lambda _: section, page, count=1)
    return page.rstrip("\n") + "\n\n" + section


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 65536, 262144])
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--measured", help="a file of the JSON lines an earlier run printed: render those, measure nothing")
    args = parser.parse_args(argv)
    results = []
    if args.measured:
        results = sorted((json.loads(line) for line in Path(args.measured).read_text().splitlines() if line.startswith("{")), key=lambda r: r["length"])
    for length in [] if args.measured else sorted(args.lengths):
        results.append(measure(length, args.chunk_size, args.python))
        print(json.dumps(results[-1]), flush=True)
    path = Path(args.out)
    path.write_text(with_section(path.read_text() if path.exists() else "", render(results, args.chunk_size)))
    return results


if __name__ == "__main__":
    main()
