"""Benchmark runner: nnterp's reads and writes as ratios to the plain transformers forward, in one run.

    python benchmarks/run.py                 # the full run (about half an hour on 2 CPU cores)
    python benchmarks/run.py --tiny --lengths 8 24 --reps 2 --tl off --out /tmp/perf.md   # a smoke run
    python benchmarks/run.py --families mlstm short_convolution --out /tmp/perf.md      # some kinds only

Per family (one medium random-weight model per recurrent mixer kind:
`models.FAMILIES`, configs in `models.configs`) and prompt length, every
repeat runs every measured call once, interleaved (`timing.interleave`); a
cell is the ratio of medians to the plain HF forward of the same model and
prompt, ``[min, max]`` of the paired ratios beside it. The kinds added after
the first three run from 512 tokens with fewer repeats (`models.FIRST`,
`models.REPS`), and a length whose plain forward is projected past
``--max-forward-s`` is skipped and noted. `generate` of 32 tokens is measured
from the run's first length against plain `generate`. TransformerLens 4.3's
``compute_ssm_state`` runs in its own venv (`--tl`), timed against that
process's own HF forward (`tl_probe.py`); where it has no adapter, or no
state reading for the mixer, the page says so. The runner writes the table,
the targets met or missed, the checks (fast vs routed states) and the exact
command to ``--out`` (``docs/performance.md``), keeping the "Import time",
"Soak", "GPU", "State store" and "Long contexts" sections other scripts wrote there. Threads: ``--threads``
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
    "sweep_cell": 1.3,  # issue 25: forwards per knockout-sweep cell at 512 tokens, on average over the kinds
}
#: States smaller than this (all layers) are not held to the memory target: the process's peak during the read is then
#: the forward's own activations (the gated short convolution's windows, the RG-LRU's vectors), not the states.
MEMORY_TARGET_MIN_BYTES = 256 * 2**20


def parse(argv: list) -> argparse.Namespace:
    from .models import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--reps", type=int, default=5, help="repeats at every length but the longest (three times as many below 256 tokens)")
    parser.add_argument("--long-reps", type=int, default=3, help="repeats at the longest length")
    parser.add_argument("--routed-long-reps", type=int, default=1, help="repeats of the routed path at the longest length")
    parser.add_argument("--mamba2-routed-max", type=int, default=512, help="longest prompt for Mamba-2's chunk_size=1 path (quadratic)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, metavar="FAMILY", help=f"of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--max-forward-s", type=float, default=40.0, help="skip a family's longer length where one plain forward is projected (quadratically, from its last length) past this")
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
        results["targets"] = targets(results)  # as this version of the runner judges them
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
    from .models import lengths_for, reps_for
    from .timing import interleave, summary

    cache_dir = Path(args.cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    results = {"command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv), "machine": machine(args), "families": {}}
    configs = cases.configs(args.tiny)
    started = time.time()
    for name in args.families:
        family_started = time.time()
        log(f"{name}: building and loading")
        folder = cases.build(name, configs[name], cache_dir)
        plain, model = cases.load(folder)
        paths = cases.Paths(model)
        lengths = lengths_for(name, args.lengths, args.tiny)
        family = results["families"][name] = {"lengths": {}, "folder": str(folder), "fast": paths.has_fast, "own": paths.own,
                                              "config": describe(configs[name]), "notes": cases.notes(model, paths), "skipped": {}}
        for index, length in enumerate(lengths):
            if length in family["skipped"]:
                continue
            ids = cases.prompt(model, length, seed=length)
            plain(ids)  # a warm-up: a first call's allocations would inflate the projection below
            began = time.perf_counter()
            plain(ids)  # the time the longer lengths are projected from
            once = time.perf_counter() - began
            # The next length only, from this one (a projection over several lengths overshoots a mostly linear forward).
            following = lengths[index + 1:]
            if following and once * (following[0] / length) ** 2 > args.max_forward_s:
                projected = once * (following[0] / length) ** 2
                for later in following:
                    family["skipped"][later] = (f"one plain forward projected to take {projected:.0f} s at L={following[0]} (from "
                                                f"{once:.1f} s at L={length}, assuming quadratic growth; --max-forward-s {args.max_forward_s:g})")
                    log(f"  L={later}: skipped, {family['skipped'][later]}")
            longest = all(later in family["skipped"] for later in lengths[index + 1:])
            routed = not paths.own and not (paths.model.family.MIXER.CHUNKED_SCAN and length > args.mamba2_routed_max)
            values = cases.donors(model, ids)
            log(f"  L={length}: checks (untimed)")
            checks = cases.checks(model, ids, values, paths, routed, plain)
            # Short prompts are cheap and the noisiest relative to their length: more repeats.
            reps = reps_for(name, args.long_reps if longest else (3 * args.reps if length < 256 else args.reps), args.tiny)
            sweep = args.tiny or length == cases.SWEEP_LENGTH
            timed = cases.methods(plain, model, ids, values, paths, args.routed_long_reps if longest else reps, routed, sweep)
            log(f"  L={length}: timing {len(timed)} calls")
            interleave(timed, reps, log=log)
            family["lengths"][length] = {
                "rows": {m.name: summary(m, timed[0]) for m in timed},
                "checks": checks,
                "routed_skipped": not routed and not paths.own,
            }
            del values
        # generate from the run's first length on every family (the same prompt length on all of them)
        ids = cases.prompt(model, args.lengths[0], seed=args.lengths[0])
        log(f"  generate {cases.GENERATE} tokens from L={args.lengths[0]}")
        generated = cases.generate_methods(plain, model, ids)
        generated[0].once()  # warm-up
        interleave(generated, reps_for(name, args.reps, args.tiny), log=log)
        family["generate"] = {"prompt": args.lengths[0], "rows": {m.name: summary(m, generated[0]) for m in generated}}
        del plain, model, paths
        import gc

        from nnterp.fast import empty_cache

        gc.collect()
        empty_cache()  # TransformerLens' cache of a long prompt needs the memory the fast path keeps for reuse
        family["tl"] = transformer_lens(args, folder, [length for length in lengths if length not in family["skipped"]])
        family["elapsed_s"] = time.time() - family_started
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
STORE = re.compile(r"<!-- store:.*?<!-- /store -->\n?", flags=re.S)
LONG_CONTEXT = re.compile(r"<!-- long-context:.*?<!-- /long-context -->\n?", flags=re.S)
CIRCUITS = re.compile(r"<!-- circuits:.*?<!-- /circuits -->\n?", flags=re.S)


def write(out: str, text: str) -> None:
    """Write the page, keeping the sections `import_time.py`, `soak.py`, `gpu.py`, `store.py`, `long_context.py` and
    `circuits.py` put there (none is rerun here)."""
    from .import_time import section, with_section

    path = Path(out)
    old = path.read_text() if path.exists() else ""
    text = with_section(text, section(old) if old else None)
    for kept in (SOAK, GPU, STORE, LONG_CONTEXT, CIRCUITS):
        found = kept.search(old)
        if found is not None and not kept.search(text):
            text = text.rstrip("\n") + "\n\n" + found.group(0)
    path.write_text(text)


def describe(config) -> str:
    """The config's shape-defining fields, as one line."""
    keys = ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_heads", "linear_head_dim", "lru_width", "attention_hidden_size", "intermediate_size",
            "mlp_layer_types", "num_local_experts", "num_experts_per_tok", "num_heads", "head_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_dim_factor", "v_dim_factor",
            "state_size", "n_groups", "chunk_size", "block_size", "conv_L_cache", "expand")
    found = {key: getattr(config, key) for key in keys if getattr(config, key, None) is not None}
    if set(found.get("mlp_layer_types", ["sparse"])) == {"dense"}:  # the experts' fields are unused
        found.pop("num_local_experts", None), found.pop("num_experts_per_tok", None)
    for key in ("layer_types", "mlp_layer_types"):
        if key in found:
            found[key] = "/".join(kind.split("_")[0] for kind in found[key])
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


def transformer_lens(args: argparse.Namespace, folder: Path, lengths: list) -> dict:
    python = tl_python(args)
    if python is None:
        return {"errors": ["not run (--tl off)"], "lengths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tl.json"
        command = [python, str(Path(__file__).with_name("tl_probe.py")), "--model", str(folder), "--lengths", *map(str, lengths),
                   "--reps", str(args.reps), "--long-reps", str(args.routed_long_reps), "--threads", str(args.threads), "--json", str(out)]
        log(f"  TransformerLens: {' '.join(command[1:3])} ...")
        done = subprocess.run(command, capture_output=True, text=True)
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"errors": [f"tl_probe exited {done.returncode}: " + " | ".join(tail)], "lengths": {}}
        return json.loads(out.read_text())


#: Row names the targets read, as prefixes: a sibling row ("states, fast path (kernel + states pass)") gets its own target row.
FAST_STATES, FAST_WRITE, OWN_STATES = "states, fast path", "set_state_after(mid), fast path", "states, own strategy"


def _like(rows: dict, prefix: str) -> list:
    """``(suffix, row)`` of every row named ``prefix`` or ``prefix`` followed by a parenthesized variant."""
    return [(name[len(prefix):], row) for name, row in rows.items() if name == prefix or name.startswith(prefix + " (")]


def targets(results: dict) -> list:
    """``(target, where, value, met, key)`` for issue 17's targets (``key`` names its note in `report.WHY`; ``met`` None: not run)."""
    found = []
    for name, family in results["families"].items():
        bound = TARGETS["fast_states_mamba" if name == "mamba" else "fast_states"]
        for length, data in family["lengths"].items():
            rows, where, long = data["rows"], f"{name}, L={length}", int(length) >= 512
            row = rows.get("layer_output of every layer")
            if row:
                found.append((f"layer_output of every layer ≤ {TARGETS['layer_output']}×", where, row["ratio"], row["ratio"] <= TARGETS["layer_output"], "layer_output"))
            tl = family.get("tl", {}).get("lengths", {}).get(str(length))
            for suffix, fast in _like(rows, FAST_STATES):
                if long:
                    found.append((f"fast states{suffix} ≤ {bound}×", where, fast["ratio"], fast["ratio"] <= bound, "fast_states"))
                if tl:
                    found.append((f"fast states{suffix} ahead of TransformerLens (value: fast / TL)", where, fast["ratio"] / tl["total"]["ratio"], fast["ratio"] < tl["total"]["ratio"], "tl"))
            for suffix, write in _like(rows, FAST_WRITE) if long else ():
                found.append((f"set_state_after(mid), fast path{suffix} ≤ {TARGETS['write']}×", where, write["ratio"], write["ratio"] <= TARGETS["write"], "write"))
            for suffix, own in _like(rows, OWN_STATES) if long else ():
                why = "own strategy: the fast path" if family.get("fast") else "own strategy: no fast path"
                found.append((f"states{suffix} ≤ {bound}× ({why})", where, own["ratio"], own["ratio"] <= bound, "own_states"))
            checks = data.get("checks", {})
            for key, what in (("peak_rss_fast", ""), ("peak_rss_own", " (own strategy)")):
                if checks.get(key) and checks.get("states_bytes", 0) >= MEMORY_TARGET_MIN_BYTES and long:
                    share = checks[key] / checks["states_bytes"]
                    found.append((f"peak memory of a states read{what} ≤ {TARGETS['memory']}× the states", where, share, share <= TARGETS["memory"], "memory"))
        for length in family.get("skipped", {}):
            if int(length) >= 512 and (family.get("fast") or family.get("own")):
                what = f"fast states ≤ {bound}×" if family.get("fast") else f"states ≤ {bound}× (own strategy: no fast path)"
                found.append((what, f"{name}, L={length}", None, None, "skipped"))
        lengths = {int(length): data for length, data in family["lengths"].items()}
        if name == "mamba2" and 512 in lengths and 2048 in lengths:
            for row, what in (("fast states computed alone from captured kernel arguments", "computed alone"), (FAST_STATES, "the whole traced forward")):
                times = [lengths[length]["rows"].get(row, {}).get("median_s") for length in (2048, 512)]
                if None not in times:
                    growth = times[0] / times[1]
                    found.append((f"Mamba-2 states at 2048 ≤ {TARGETS['mamba2_growth']}× their time at 512 ({what})", name, growth, growth <= TARGETS["mamba2_growth"], "mamba2_growth"))
        generated = family.get("generate", {}).get("rows", {})
        reading = generated.get("generate, state_output of every recurrent layer at every step")
        if reading:
            found.append((f"generate reading state_output every step ≤ {TARGETS['generate']}×", name, reading["ratio"], reading["ratio"] <= TARGETS["generate"], "generate"))
    found += _sweep_targets(results)
    return found


def _sweep_targets(results: dict) -> list:
    """Forwards per knockout-sweep cell at 512 tokens (the sweep row's ratio over its cells): each kind's, and their mean (the target)."""
    from .cases import SWEEP_CELLS, SWEEP_ROW

    bound, per_kind = TARGETS["sweep_cell"], []
    for name, family in results["families"].items():
        row = family["lengths"].get("512", family["lengths"].get(512, {})).get("rows", {}).get(SWEEP_ROW)
        if row:
            per_kind.append((name, row["ratio"] / SWEEP_CELLS))
    found = [(f"knockout_sweep: forwards per cell (each kind's, informative; the target is the mean) ≤ {bound}", f"{name}, L=512", value, value <= bound, "sweep_cell")
             for name, value in per_kind]
    if per_kind:
        mean = sum(value for _, value in per_kind) / len(per_kind)
        found.append((f"knockout_sweep: forwards per cell, mean over the kinds ≤ {bound}", "every kind, L=512", mean, mean <= bound, "sweep_cell"))
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
