"""The GPU benchmark of issue 17: fast-path states against the routed path, timed against the plain forward, on a GPU.

    python benchmarks/gpu.py --out $OUT/gpu.md          # on a machine with a CUDA GPU
    python benchmarks/gpu.py --cpu-dry-run             # tiny models on the CPU, float32: checks this script

Not a test: the test suite never needs a GPU. Without one (and without
``--cpu-dry-run``) it prints why and exits with status 2, so nothing mistakes
"nothing measured" for a result.

Per family, a medium random-weight model in bfloat16 (a Qwen3.5-like gated
DeltaNet hybrid: hidden 1024, 16 key and value heads of 128, three DeltaNet
blocks per attention block; a Mamba-2: hidden 1024, 32 heads of 64, state
128), built from its config class and saved with nnterp's tiny tokenizer:

1. which kernels transformers bound for the mixer (flash-linear-attention's
   ``chunk_gated_delta_rule``, mamba_ssm / causal-conv1d; "pure torch" where
   the package is missing there);
2. correctness, untimed, at ``--check-length`` tokens: every recurrent layer's
   ``states`` through ``nnterp.fast_states(model)`` (the optimized kernel stays
   bound) against the routed path (``route_kernels(family, "torch")``; Mamba-2:
   ``chunk_per_token``), and the logits after ``set_state_after(mid, 2 *
   state_after(mid))`` both ways, within bfloat16 tolerance;
3. timing, per ``--lengths``: the plain transformers forward (the optimized
   kernels bound), an nnsight trace reading nothing, the fast-path states of
   every recurrent layer, and ``set_state_after(mid)`` on the fast path;
   interleaved repeats with ``torch.cuda.synchronize()`` around each call, each
   row the median's ratio to the plain forward of the same repeats.

It prints a markdown section (date, GPU, versions, the tables) and, with
``--out``, writes it there; ``--page docs/performance.md`` replaces the page's
GPU section with it (`benchmarks/run.py` keeps that section).

Carrying what the GPU machine lacks (its image has torch but an older
transformers, no nnsight, no fla): download the wheels here, per the device
tool's README (Python 3.12, manylinux x86-64), into ``.whl``:
``transformers==5.24.0 nnsight==0.8.1 flash-linear-attention fla-core
huggingface-hub tokenizers safetensors jaxtyping`` and their missing needs;
causal-conv1d and mamba_ssm ship no PyPI wheels (sources only), so without
them the convolution and Mamba-2's scan stay transformers' pure torch there,
and step 1 says so. Then one command: ``pip install --target /tmp/site
.whl/*.whl && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu.py --out
$OUT/gpu.md``.

Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = ("gated_deltanet", "mamba2")
#: bfloat16 keeps 8 bits of mantissa: two ways of summing the same recurrence agree to about 1e-2 of the scale.
TOLERANCE = 3e-2
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


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--check-length", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--page", help="a performance page whose GPU section this run replaces")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny models on the CPU in float32, to check this script")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu.py: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was measured.")
        return 2
    device = "cpu" if args.cpu_dry_run else "cuda"
    dtype = torch.float32 if args.cpu_dry_run else torch.bfloat16
    lines: list[str] = []
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        for name, config in configs(args.cpu_dry_run).items():
            if name not in args.families:
                continue
            section, bad = measure(name, config, Path(folder), device, dtype, args)
            lines += section
            failed += bad
            if device == "cuda":
                torch.cuda.empty_cache()  # the family's models are gone with measure's frame
    header = describe(device, args.cpu_dry_run, failed)
    text = "\n".join([SECTION, "## GPU", "", *header, "", *lines, END]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.page:
        replace_section(Path(args.page), text)
    return 1 if failed else 0


def describe(device: str, dry: bool, failed: int) -> list:
    import nnsight
    import torch
    import transformers

    where = "the CPU (dry run, float32, tiny models: the numbers mean nothing)" if dry else torch.cuda.get_device_name(0)
    return [
        f"* `python benchmarks/gpu.py` on {where}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"* torch {torch.__version__}, transformers {transformers.__version__}, nnsight {nnsight.__version__}, "
        f"flash-linear-attention {version('flash-linear-attention')}, mamba_ssm {version('mamba_ssm')}, "
        f"causal-conv1d {version('causal_conv1d')}.",
        f"* Checks: {'all passed' if not failed else f'{failed} failed'}.",
    ]


def measure(name: str, config, folder: Path, device: str, dtype, args) -> tuple[list, int]:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    import nnterp
    from benchmarks.cases import build, prompt
    from nnterp import StandardizedTransformer
    from nnterp.recurrent.kernels import compiled_package

    path = build(name, config, folder)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model = StandardizedTransformer(str(path), dispatch=True, device_map=device, dtype=dtype)
    family = model.family
    mixer = family.MIXER
    bound = {fn: compiled_package(family.MODELING.__dict__.get(fn)) or "pure torch"
             for fn in (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)}
    lines = [f"### {name}", "", "Kernels bound: " + ", ".join(f"`{fn}` -> {pkg}" for fn, pkg in bound.items()) + ".", ""]
    mixers = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    routed = (lambda: nnterp.chunk_per_token(model)) if mixer.CHUNKED_SCAN else (lambda: nnterp.route_kernels(family, "torch"))

    ids = prompt(model, args.check_length, seed=0).to(device)
    mid = args.check_length // 2
    read: dict = {}
    for way, setting in (("fast", lambda: nnterp.fast_states(model)), ("routed", routed)):
        every: list = []  # filled inside the traces: a name bound inside one does not outlive it in a function
        logits: list = []
        with setting(), torch.no_grad(), model.trace(ids):
            for mix in mixers:
                every.append(mix.states.save())
        with setting(), torch.no_grad(), model.trace(ids):
            mixers[0].set_state_after(mid, 2 * mixers[0].state_after(mid))
            logits.append(model.logits.save())
        read[way] = (every, logits[0])
    failed = 0
    lines += ["| check | max abs diff / max abs | |", "|---|---:|---|"]
    pairs = [(f"layer {i} states, fast vs routed", a, b) for i, (a, b) in enumerate(zip(read["fast"][0], read["routed"][0]))]
    pairs.append((f"logits after set_state_after({mid}), fast vs routed", read["fast"][1], read["routed"][1]))
    for what, a, b in pairs:
        relative = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        ok = relative <= TOLERANCE
        failed += not ok
        lines.append(f"| {what} | {relative:.1e} | {'pass' if ok else '**fail**'} |")
    lines.append("")

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lines += ["| L | plain forward (s) | trace, nothing read | states, fast path | set_state_after(mid), fast path |", "|---:|---:|---:|---:|---:|"]
    for length in args.lengths:
        ids = prompt(model, length, seed=length).to(device)
        mid = length // 2

        def plain_forward(ids=ids):
            plain(ids)

        def trace_nothing(ids=ids):
            with model.trace(ids):
                pass

        def fast_states(ids=ids):
            with nnterp.fast_states(model), model.trace(ids):
                for mix in mixers:
                    mix.states.save()

        def write(ids=ids, mid=mid):
            with nnterp.fast_states(model), model.trace(ids):
                mixers[0].set_state_after(mid, mixers[0].state_after(mid) * 2)

        calls = {"plain": plain_forward, "trace": trace_nothing, "states": fast_states, "write": write}
        times = {key: [] for key in calls}
        with torch.no_grad(), contextlib.suppress(torch.cuda.OutOfMemoryError):
            for call in calls.values():
                call()  # warm-up: kernels compiled and autotuned outside the timed repeats
            for rep in range(args.reps):
                for key in list(calls)[rep % len(calls):] + list(calls)[: rep % len(calls)]:
                    sync()
                    start = time.perf_counter()
                    calls[key]()
                    sync()
                    times[key].append(time.perf_counter() - start)
        if len(times["plain"]) < args.reps:
            lines.append(f"| {length} | out of memory | | | |")
            continue
        base = statistics.median(times["plain"])
        ratios = [f"**{statistics.median(times[key]) / base:.2f}**" for key in ("trace", "states", "write")]
        lines.append(f"| {length} | {base:.4f} | " + " | ".join(ratios) + " |")
    lines.append("")
    return lines, failed


def version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def replace_section(page: Path, text: str) -> None:
    old = page.read_text()
    start, end = old.find(SECTION), old.find(END)
    if start < 0 or end < 0:
        page.write_text(old.rstrip("\n") + "\n\n" + text)
    else:
        page.write_text(old[:start] + text + old[end + len(END) + 1:])


if __name__ == "__main__":
    sys.exit(main())
