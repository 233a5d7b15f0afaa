"""The GPU benchmark of issue 17: fast-path states against the routed path, timed against the plain forward, on a GPU.

    python benchmarks/gpu.py --out $OUT --budget-s 150   # on a machine with a CUDA GPU
    python benchmarks/gpu.py --cpu-dry-run               # tiny models on the CPU, float32: checks this script
    python benchmarks/gpu.py --section gpu.md --page docs/performance.md   # a brought-back section into the page

Not a test (the suite never needs a GPU): without one, and without ``--cpu-dry-run``, it says so and exits with 2.

Per family, a medium random-weight model in bfloat16 (a Qwen3.5-like gated DeltaNet hybrid: hidden 1024, 16 key and
value heads of 128, three DeltaNet blocks per attention block; a Mamba-2: hidden 1024, 32 heads of 64, state 128),
built from its config class and saved with nnterp's tiny tokenizer:

1. the packages installed (fla, mamba_ssm, causal-conv1d: each optional), the kernel bound per name ("pure torch");
2. correctness, untimed, at ``--check-length`` tokens: every recurrent layer's ``states`` through
   ``nnterp.fast_states(model)`` (the optimized kernel stays bound), and the logits after ``set_state_after(mid, 2 *
   state_after(mid))``, each against the same read on a float32 copy of the model through the routed path
   (``route_kernels(family, "torch")``, and ``chunk_per_token`` where the mixer's scan is chunked). The tolerance is
   measured, not fixed: the noise floor is what the routed path in the benchmark's dtype differs from that float32
   read (what rounding to bfloat16 costs on this computation) or what the fast path differs from itself run twice,
   whichever is larger; a check passes within ``FLOOR_FACTOR`` floors (never under ``MIN_TOLERANCE``), and the
   table shows the floor beside it;
3. timing, shortest ``--lengths`` first, every family at one length before the next: the plain transformers forward
   (the optimized kernels bound), an nnsight trace reading nothing, the fast-path states of every recurrent layer,
   and ``set_state_after(mid)`` on the fast path; interleaved repeats with ``torch.cuda.synchronize()`` around each
   call, each row the median's ratio to the plain forward of the same repeats. A row whose projection (the last
   row's time, or the checks' warm trace, scaled by the length) would end past ``--budget-s`` is skipped, and says so.

The section (date, GPU, versions, the tables) is rewritten whole to ``--out`` (a file, or ``gpu.md`` in a folder)
after every table, written aside and renamed, so a crash or a kill at the time limit keeps what finished. An error
is caught per family and per length and written in its place (the traceback to stderr); the run goes on. ``--page
docs/performance.md`` replaces the page's GPU section (`benchmarks/run.py` keeps that section).

Carrying what the GPU machine lacks (its image: Python 3.12, torch 2.11, transformers 5.17; no nnsight, no fla):
``scripts/carry_gpu_wheels.sh`` downloads the pinned wheels into ``.whl/`` here (mamba_ssm and causal-conv1d ship
sources only, so Mamba-2 runs transformers' pure torch there, and step 1 says so). Then one device call, ``carry:
[".whl"]``, ``timeout_s: 480`` (about 5 minutes of the 15, leaving a rerun)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; nvidia-smi -L; timeout -k 10 180 python3 benchmarks/gpu.py --budget-s 150 --out $OUT/gpu.md 2>&1 | tee $OUT/gpu.log; timeout -k 10 90 python3 scripts/gpu_check.py --budget-s 60 --out $OUT/gpu_check.txt 2>&1 | tee $OUT/gpu_check.log

``tests/test_gpu_carry.py`` runs that line on the CPU from the carried folder. Exit status: 0 when every check passed, 1 when one failed or raised, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = ("gated_deltanet", "mamba2")
#: A check passes within this many noise floors: the fast path rounds in other places than the routed one, as often.
FLOOR_FACTOR = 4.0
#: Below this a difference is float32's own reordered sums (the dry run's floor is 0: both reads are float32).
MIN_TOLERANCE = 1e-4
PACKAGES = ("flash-linear-attention", "fla-core", "mamba_ssm", "causal_conv1d", "triton")
SECTION = "<!-- gpu: made by benchmarks/gpu.py; do not edit by hand -->"
END = "<!-- /gpu -->"


def configs(tiny: bool) -> dict:
    from transformers import Mamba2Config, Qwen3_5TextConfig

    from nnterp.testing import tiny_tokenizer

    vocab = len(tiny_tokenizer())
    if tiny:
        from benchmarks.cases import configs as small

        found = small(True)
        return {name: found[name] for name in FAMILIES}
    return {
        "gated_deltanet": Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, linear_num_key_heads=16,
            linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        ),
        "mamba2": Mamba2Config(
            vocab_size=vocab, hidden_size=1024, num_hidden_layers=8, num_heads=32, head_dim=64, state_size=128,
            n_groups=1, chunk_size=256, expand=2,
        ),
    }


class Report:
    """The section measured so far, per family (notes, checks, timing rows), rewritten whole after every table.

    ``failed`` counts failed checks and caught errors."""

    def __init__(self, out: Path | None, page: Path | None, header: list) -> None:
        self.out, self.page, self.header = out, page, header
        self.families: dict = {}
        self.failed, self.finished = 0, False

    def family(self, name: str) -> dict:
        return self.families.setdefault(name, {"notes": [], "checks": [], "rows": []})

    def error(self, name: str, where: str, error: BaseException) -> None:
        traceback.print_exc()
        self.failed += 1
        self.family(name)["notes"].append(f"**error** in {where}: `{type(error).__name__}: {str(error)[:300]}`")

    def render(self) -> str:
        state = "finished" if self.finished else "**cut short**: the run was still going when this was last written"
        lines = [SECTION, "## GPU", "", *self.header, f"* Run {state}; checks failed or raised: {self.failed}.", ""]
        for name, found in self.families.items():
            lines += [f"### {name}", "", *(f"{note}\n" for note in found["notes"])]
            if found["checks"]:
                lines += ["| check | fast vs float32 routed | noise floor | tolerance | |", "|---|---:|---:|---:|---|", *found["checks"], ""]
            if found["rows"]:
                lines += ["| L | plain forward (s) | trace, nothing read | states, fast path | set_state_after(mid), fast path |",
                          "|---:|---:|---:|---:|---:|", *found["rows"], ""]
        return "\n".join([*lines, END]) + "\n"

    def flush(self) -> None:
        text = self.render()
        for path in (self.out, self.page):
            if path is not None:
                write_synced(path, replaced(path.read_text(), text) if path == self.page else text)


def write_synced(path: Path, text: str) -> None:
    """Write aside, sync, rename: a kill at any moment leaves the previous version or this one, whole."""
    aside = path.with_name(path.name + ".partial")
    with open(aside, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(aside, path)


def replaced(old: str, text: str) -> str:
    start, end = old.find(SECTION), old.find(END)
    if start < 0 or end < 0:
        return old.rstrip("\n") + "\n\n" + text
    return old[:start] + text + old[end + len(END) + 1:]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--check-length", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="skip what its projection says would end later")
    parser.add_argument("--out", help="a file, or a folder to write gpu.md in; rewritten after every table")
    parser.add_argument("--page", help="a performance page whose GPU section this run replaces")
    parser.add_argument("--section", help="put this section (a brought-back --out) into --page, and measure nothing")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny models on the CPU in float32, to check this script")
    args = parser.parse_args(argv)
    page = Path(args.page) if args.page else None
    if args.section:
        if page is None:
            parser.error("--section needs --page")
        write_synced(page, replaced(page.read_text(), Path(args.section).read_text()))
        return 0

    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu.py: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was measured.")
        return 2
    started = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    device = "cpu" if args.cpu_dry_run else "cuda"
    dtype = torch.float32 if args.cpu_dry_run else torch.bfloat16
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or args.out.endswith("/")):
        out.mkdir(parents=True, exist_ok=True)
        out = out / "gpu.md"
    report = Report(out, page, describe(device, args.cpu_dry_run))
    report.flush()
    ready: dict = {}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as routing:
        found = configs(args.cpu_dry_run)
        for name in [name for name in FAMILIES if name in args.families]:
            config = found[name]
            if left() <= 0:
                report.family(name)["notes"].append(f"Skipped: the budget ({args.budget_s:.0f} s) was spent before it began.")
                continue
            try:
                ready[name] = load(name, config, Path(folder), device, dtype, report, routing)
                check(name, ready[name], device, args, report)
            except Exception as error:  # noqa: BLE001 - one family's failure is written in its place; the others still run
                report.error(name, "loading or the checks", error)
            report.flush()
        for length in sorted(set(args.lengths)):
            for name, family in ready.items():
                try:
                    row(name, family, length, device, args, left, report)
                except Exception as error:  # noqa: BLE001 - one length's failure is written in its place; the next runs
                    report.error(name, f"the timing at L={length}", error)
                report.flush()
    report.finished = True
    report.flush()
    print(report.render())
    return 1 if report.failed else 0


def describe(device: str, dry: bool) -> list:
    import nnsight
    import torch
    import transformers

    where = "the CPU (dry run, float32, tiny models: the numbers mean nothing)" if dry else torch.cuda.get_device_name(0)
    return [
        f"* `python benchmarks/gpu.py` on {where}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"* Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"nnsight {nnsight.__version__}; " + ", ".join(f"{name} {version(name)}" for name in PACKAGES) + ".",
    ]


def load(name: str, config, folder: Path, device: str, dtype, report: Report, routing: contextlib.ExitStack) -> dict:
    """The plain model, nnterp's in ``dtype`` and a float32 copy (the checks' reference), and the kernels bound."""
    import torch
    from transformers import AutoModelForCausalLM

    import nnterp
    from benchmarks.cases import build
    from nnterp import StandardizedTransformer
    from nnterp.recurrent.kernels import compiled_package

    transformers_mamba2()
    path = build(name, config, folder)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if not type(plain).__module__.startswith("transformers."):
        raise RuntimeError(f"{name} loaded as {type(plain).__module__}: a package registered its own model for this type")
    model = StandardizedTransformer(str(path), dispatch=True, device_map=device, dtype=dtype)
    reference = StandardizedTransformer(str(path), dispatch=True, device_map=device, dtype=torch.float32)
    mixer = model.family.MIXER
    bound = {fn: compiled_package(model.family.MODELING.__dict__.get(fn)) or "pure torch"
             for fn in (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)}
    report.family(name)["notes"].append("Kernels bound: " + ", ".join(f"`{fn}` -> {package}" for fn, package in bound.items()) + ".")
    if device == "cpu" and set(bound.values()) != {"pure torch"}:
        report.family(name)["notes"].append("The dry run routes them to transformers' pure torch: they run on a GPU only.")
        routing.enter_context(nnterp.route_kernels(model.family, "torch"))
    return {"plain": plain, "model": model, "reference": reference, "per_token_s": None}


def transformers_mamba2() -> None:
    """Undo fla's registration of its own Mamba-2 for model type "mamba2" in transformers' Auto classes.

    Importing fla (transformers' hub kernels do, at the first modeling import) registers it with ``exist_ok=True``:
    a Mamba-2 checkpoint then loads as fla's model, which nnterp does not standardize."""
    from transformers import AutoConfig, AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

    AutoConfig.register("mamba2", Mamba2Config, exist_ok=True)
    AutoModelForCausalLM.register(Mamba2Config, Mamba2ForCausalLM, exist_ok=True)


@contextlib.contextmanager
def routed(model):
    """The reference path: transformers' pure-torch kernels, and a chunk boundary at every token where the scan is chunked."""
    import nnterp

    per_token = nnterp.chunk_per_token(model) if getattr(model.family.MIXER, "CHUNKED_SCAN", False) else contextlib.nullcontext()
    with nnterp.route_kernels(model.family, "torch"), per_token:
        yield


def fast(model):
    import nnterp

    return nnterp.fast_states(model)


def read(model, setting, ids, mid: int) -> tuple[list, object]:
    """Every recurrent layer's ``states``, and the logits after doubling layer 0's state after ``mid``, under ``setting``."""
    import torch

    mixers = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    every: list = []  # filled inside the traces: a name bound inside one does not outlive it in a function
    logits: list = []
    with setting(model), torch.no_grad(), model.trace(ids):
        for mix in mixers:
            every.append(mix.states.save())
    with setting(model), torch.no_grad(), model.trace(ids):
        mixers[0].set_state_after(mid, 2 * mixers[0].state_after(mid))
        logits.append(model.logits.save())
    return every, logits[0]


def relative(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check(name: str, family: dict, device: str, args, report: Report) -> None:
    """The fast path's states and write against a float32 routed read, within the measured noise floor."""
    from benchmarks.cases import prompt

    model = family["model"]
    ids = prompt(model, args.check_length, seed=0).to(device)
    mid = args.check_length // 2
    truth = read(family["reference"], routed, ids, mid)
    rounded = read(model, routed, ids, mid)
    first = read(model, fast, ids, mid)
    sync(device)
    begun = time.perf_counter()
    again = read(model, fast, ids, mid)
    sync(device)
    family["per_token_s"] = (time.perf_counter() - begun) / 2 / args.check_length  # read() is two traces, warm
    names = [f"layer {i} states" for i in range(len(truth[0]))] + [f"logits after set_state_after({mid})"]
    found = report.family(name)
    for what, t, r, a, b in zip(names, [*truth[0], truth[1]], [*rounded[0], rounded[1]], [*first[0], first[1]], [*again[0], again[1]]):
        floor, difference = max(relative(r, t), relative(b, a)), relative(a, t)
        tolerance = max(FLOOR_FACTOR * floor, MIN_TOLERANCE)
        report.failed += difference > tolerance
        found["checks"].append(f"| {what} | {difference:.1e} | {floor:.1e} | {tolerance:.1e} | {'pass' if difference <= tolerance else '**fail**'} |")


def row(name: str, family: dict, length: int, device: str, args, left, report: Report) -> None:
    """One timing row at ``length``, or the reason it has none (skipped by the budget, out of memory, an error)."""
    import torch

    import nnterp
    from benchmarks.cases import prompt

    plain, model = family["plain"], family["model"]
    rows = report.family(name)["rows"]
    calls_per_rep = 4
    if family["per_token_s"] is None:
        rows.append(f"| {length} | skipped: no warm trace to project from (the checks raised) | | | |")
        return
    projected = (args.reps + 1) * calls_per_rep * family["per_token_s"] * length
    if projected > left():
        rows.append(f"| {length} | skipped: projected {projected:.0f} s, {max(left(), 0):.0f} s left of --budget-s | | | |")
        return
    mixers = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    ids = prompt(model, length, seed=length).to(device)
    mid = length // 2

    def trace_nothing():
        with model.trace(ids):
            pass

    def fast_states():
        with nnterp.fast_states(model), model.trace(ids):
            for mix in mixers:
                mix.states.save()

    def write():
        with nnterp.fast_states(model), model.trace(ids):
            mixers[0].set_state_after(mid, mixers[0].state_after(mid) * 2)

    calls = {"plain": lambda: plain(ids), "trace": trace_nothing, "states": fast_states, "write": write}
    times: dict = {key: [] for key in calls}
    begun = time.perf_counter()
    try:
        with torch.no_grad():
            for call in calls.values():
                call()  # warm-up: kernels compiled and autotuned outside the timed repeats
            for rep in range(args.reps):
                for key in list(calls)[rep % len(calls):] + list(calls)[: rep % len(calls)]:
                    sync(device)
                    start = time.perf_counter()
                    calls[key]()
                    sync(device)
                    times[key].append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError:
        rows.append(f"| {length} | out of memory | | | |")
        return
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    # The next length's projection: this row's mean call, warm-up included, per token (the states grow with the length).
    family["per_token_s"] = (time.perf_counter() - begun) / ((args.reps + 1) * calls_per_rep * length)
    base = statistics.median(times["plain"])
    ratios = [f"**{statistics.median(times[key]) / base:.2f}**" for key in ("trace", "states", "write")]
    rows.append(f"| {length} | {base:.4f} | " + " | ".join(ratios) + " |")


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
