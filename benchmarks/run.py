"""Benchmark runner: nnterp's reads and writes as ratios to the plain transformers forward, in one run.

    python benchmarks/run.py                 # the full run (about half an hour on 2 CPU cores)
    python benchmarks/run.py --tiny --lengths 8 24 --reps 2 --tl off --out /tmp/perf.md   # a smoke run

Per family (a Qwen3.5-like gated DeltaNet hybrid, Mamba-1, Mamba-2; medium
configs, random weights; `cases.configs`) and prompt length, every repeat
runs every measured call once, interleaved (`timing.interleave`); a cell is
the ratio of medians to the plain HF forward of the same model and prompt,
``[min, max]`` of the paired ratios beside it. `generate` of 32 tokens is
measured at the first length against plain `generate`. TransformerLens 4.3's
``compute_ssm_state`` runs in its own venv (`--tl`), timed against that
process's own HF forward (`tl_probe.py`). The runner writes the table, the
targets met or missed, the checks (fast vs routed states) and the exact
command to ``--out`` (``docs/performance.md``), keeping the "Import time"
section that ``benchmarks/import_time.py`` wrote there. Threads: ``--threads``
(1 by default, set before torch is imported, as the anchors were measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TL_VENV = Path("~/.cache/nnterp-bench/tl-venv").expanduser()
#: Issue 17's targets (ratios to the plain forward of the same run).
TARGETS = {
    "layer_output": 1.05,
    "fast_states": 1.10,
    "fast_states_mamba": 1.15,  # Mamba-1: a fast path for its per-channel decay
    "write": 1.10,
    "memory": 1.05,
    "mamba2_growth": 4.2,
    "generate": 1.2,
}


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--reps", type=int, default=5, help="repeats at every length but the longest (three times as many below 256 tokens)")
    parser.add_argument("--long-reps", type=int, default=3, help="repeats at the longest length")
    parser.add_argument("--routed-long-reps", type=int, default=1, help="repeats of the routed path at the longest length")
    parser.add_argument("--mamba2-routed-max", type=int, default=512, help="longest prompt for Mamba-2's chunk_size=1 path (quadratic)")
    parser.add_argument("--families", nargs="+", default=["gated_deltanet", "mamba", "mamba2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tl", default="auto", help="'auto' (the venv at ~/.cache/nnterp-bench/tl-venv, made if missing), 'off', or a python path")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (the smoke test)")
    parser.add_argument("--cache-dir", default="~/.cache/nnterp-bench")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--render", default=None, metavar="JSON", help="only re-render --out from a --json file of an earlier run")
    return parser.parse_args(argv)


def main(argv: list | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        write(args.out, render(results))
        return results
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, str(args.threads))
    import torch

    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    try:
        return _measure(args, argv)
    finally:  # a caller in the same process (the tests) gets its settings back
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, argv: list | None) -> dict:
    from . import cases
    from .timing import interleave, summary

    cache_dir = Path(args.cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    results = {"command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv), "machine": machine(args), "families": {}}
    configs = cases.configs(args.tiny)
    started = time.time()
    for name in args.families:
        log(f"{name}: building and loading")
        folder = cases.build(name, configs[name], cache_dir)
        plain, model = cases.load(folder)
        paths = cases.Paths(model)
        family = results["families"][name] = {"lengths": {}, "folder": str(folder), "fast": paths.has_fast, "config": describe(configs[name])}
        for index, length in enumerate(args.lengths):
            longest = length == max(args.lengths)
            routed = not (paths.kind == "mamba2" and length > args.mamba2_routed_max)
            ids = cases.prompt(model, length, seed=length)
            values = cases.donors(model, ids)
            log(f"  L={length}: checks (untimed)")
            checks = cases.checks(model, ids, values, paths, routed)
            # Short prompts are cheap and the noisiest relative to their length: more repeats.
            reps = args.long_reps if longest else (3 * args.reps if length < 256 else args.reps)
            timed = cases.methods(plain, model, ids, values, paths, args.routed_long_reps if longest else reps, routed)
            log(f"  L={length}: timing {len(timed)} calls")
            interleave(timed, reps, log=log)
            family["lengths"][length] = {
                "rows": {m.name: summary(m, timed[0]) for m in timed},
                "checks": checks,
                "routed_skipped": not routed,
            }
            del values
            if index == 0:
                log(f"  generate {cases.GENERATE} tokens from L={length}")
                generated = cases.generate_methods(plain, model, ids)
                generated[0].once()  # warm-up
                interleave(generated, args.reps, log=log)
                family["generate"] = {"prompt": length, "rows": {m.name: summary(m, generated[0]) for m in generated}}
        del plain, model, paths
        import gc

        from nnterp.fast import empty_cache

        gc.collect()
        empty_cache()  # TransformerLens' cache of a long prompt needs the memory the fast path keeps for reuse
        family["tl"] = transformer_lens(args, folder, name)
        log(f"{name}: done at {time.time() - started:.0f}s")
    results["elapsed_s"] = time.time() - started
    results["targets"] = targets(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write(args.out, render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    log(f"wrote {args.out} in {results['elapsed_s']:.0f}s")
    return results


SOAK = re.compile(r"<!-- soak:.*?<!-- /soak -->\n?", flags=re.S)
GPU = re.compile(r"<!-- gpu:.*?<!-- /gpu -->\n?", flags=re.S)


def write(out: str, text: str) -> None:
    """Write the page, keeping the sections `import_time.py`, `soak.py` and `gpu.py` put there (none is rerun here)."""
    from .import_time import section, with_section

    path = Path(out)
    old = path.read_text() if path.exists() else ""
    text = with_section(text, section(old) if old else None)
    for kept in (SOAK, GPU):
        found = kept.search(old)
        if found is not None and not kept.search(text):
            text = text.rstrip("\n") + "\n\n" + found.group(0)
    path.write_text(text)


def describe(config) -> str:
    """The config's shape-defining fields, as one line."""
    keys = ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "intermediate_size", "num_heads", "head_dim", "state_size", "n_groups", "chunk_size", "expand")
    found = {key: getattr(config, key) for key in keys if getattr(config, key, None) is not None}
    if "layer_types" in found:
        found["layer_types"] = "/".join(kind.split("_")[0] for kind in found["layer_types"])
    return f"`{type(config).__name__}`: " + ", ".join(f"{key}={value}" for key, value in found.items())


def log(line: str) -> None:
    print(line, flush=True)


def machine(args: argparse.Namespace) -> str:
    import nnsight
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    memory = next((int(line.split()[1]) // 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory} GiB RAM, {platform.system()} {platform.release()}; "
        f"torch {torch.__version__} ({args.threads} thread{'s' if args.threads > 1 else ''}), transformers {transformers.__version__}, "
        f"nnsight {nnsight.__version__}, Python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def tl_python(args: argparse.Namespace) -> str | None:
    """TransformerLens' interpreter: its own venv, sharing torch and transformers through a .pth (no second download)."""
    if args.tl == "off":
        return None
    if args.tl != "auto":
        return args.tl
    python = TL_VENV / "bin" / "python"
    if not python.exists():
        log(f"making {TL_VENV} (transformer-lens==4.3.*, once)")
        subprocess.run([sys.executable, "-m", "venv", str(TL_VENV)], check=True)
        site = next((TL_VENV / "lib").glob("python*/site-packages"))
        main_site = next(p for p in sys.path if p.endswith("site-packages") and "torch" in os.listdir(p))
        (site / "_nnterp_main_venv.pth").write_text(main_site + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "-q", "transformer-lens==4.3.*"], check=True)
    return str(python)


def transformer_lens(args: argparse.Namespace, folder: Path, name: str) -> dict:
    python = tl_python(args)
    if python is None:
        return {"errors": ["not run (--tl off)"], "lengths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tl.json"
        command = [python, str(Path(__file__).with_name("tl_probe.py")), "--model", str(folder), "--lengths", *map(str, args.lengths),
                   "--reps", str(args.reps), "--long-reps", str(args.routed_long_reps), "--threads", str(args.threads), "--json", str(out)]
        log(f"  TransformerLens: {' '.join(command[1:3])} ...")
        done = subprocess.run(command, capture_output=True, text=True)
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"errors": [f"tl_probe exited {done.returncode}: " + " | ".join(tail)], "lengths": {}}
        return json.loads(out.read_text())


def targets(results: dict) -> list:
    """``(target, where, value, met, key)`` for the issue's four targets (``key`` names its note in `report.WHY`)."""
    found = []
    for name, family in results["families"].items():
        for length, data in family["lengths"].items():
            rows = data["rows"]
            row = rows.get("layer_output of every layer")
            if row:
                found.append((f"layer_output of every layer ≤ {TARGETS['layer_output']}×", f"{name}, L={length}", row["ratio"], row["ratio"] <= TARGETS["layer_output"], "layer_output"))
            fast = rows.get("states, fast path")
            if fast and int(length) >= 512:
                bound = TARGETS["fast_states_mamba" if name == "mamba" else "fast_states"]
                found.append((f"fast states ≤ {bound}×", f"{name}, L={length}", fast["ratio"], fast["ratio"] <= bound, "fast_states"))
            write = rows.get("set_state_after(mid), fast path")
            if write and int(length) >= 512:
                found.append((f"set_state_after(mid), fast path ≤ {TARGETS['write']}×", f"{name}, L={length}", write["ratio"], write["ratio"] <= TARGETS["write"], "write"))
            checks = data.get("checks", {})
            if checks.get("peak_rss_fast") and checks.get("states_bytes") and int(length) >= 512:
                share = checks["peak_rss_fast"] / checks["states_bytes"]
                found.append((f"peak memory of a states read ≤ {TARGETS['memory']}× the states", f"{name}, L={length}", share, share <= TARGETS["memory"], "memory"))
            tl = family.get("tl", {}).get("lengths", {}).get(str(length))
            if fast and tl:
                found.append(("fast states ahead of TransformerLens (value: fast / TL)", f"{name}, L={length}", fast["ratio"] / tl["total"]["ratio"], fast["ratio"] < tl["total"]["ratio"], "tl"))
        lengths = sorted(int(length) for length in family["lengths"])
        if name == "mamba2" and 512 in lengths and 2048 in lengths:
            for row, what in (("fast states computed alone from captured kernel arguments", "computed alone"), ("states, fast path", "the whole traced forward")):
                times = [family["lengths"][length]["rows"].get(row, {}).get("median_s") for length in (2048, 512)]
                if None not in times:
                    growth = times[0] / times[1]
                    found.append((f"Mamba-2 states at 2048 ≤ {TARGETS['mamba2_growth']}× their time at 512 ({what})", name, growth, growth <= TARGETS["mamba2_growth"], "mamba2_growth"))
        generated = family.get("generate", {}).get("rows", {})
        reading = generated.get("generate, state_output of every recurrent layer at every step")
        if reading:
            found.append((f"generate reading state_output every step ≤ {TARGETS['generate']}×", name, reading["ratio"], reading["ratio"] <= TARGETS["generate"], "generate"))
    return found


def cell(row: dict | None) -> str:
    if row is None:
        return "–"
    return f"**{row['ratio']:.2f}** [{row['min']:.2f}, {row['max']:.2f}]" + (f" (n={row['n']})" if row["n"] < 3 else "")


def render(results: dict) -> str:
    from .report import render as render_report

    return render_report(results, cell)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from benchmarks.run import main as entry  # the package-relative imports need the package

    entry()
