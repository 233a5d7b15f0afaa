"""The device checks of issue 12 that need a CUDA GPU: a model split over GPU and CPU, optimized kernels bound.

    python scripts/gpu_check.py                       # with the package's environment
    python scripts/gpu_check.py --kinds qwen3_5_text  # one family
    python scripts/gpu_check.py --cpu-dry-run         # on the CPU alone, to check this script

Not a test: the test suite never needs a GPU. Without one this prints why and
exits with status 2 (so a CI step cannot mistake "nothing checked" for a pass).
With one, per family (a gated DeltaNet hybrid, Mamba-2 by default), on its tiny
config (`nnterp.testing.tiny_config`) with head dims of 32 where smaller
(flash-linear-attention 0.6.0's kernels pad each head to a tile of at least 16
and assert at most 256; its own tests use 32 and up), saved in a temporary
folder:

1. loads it with ``device_map="auto"`` and a ``max_memory`` that fits only part of
   it on the GPU, so its layers are split over ``cuda:0`` and ``cpu``, and
   prints the map;
2. reports which optimized kernel package transformers bound for the mixer
   (flash-linear-attention for the gated DeltaNet, mamba_ssm / causal-conv1d for
   Mamba-2; each optional), and whether a trace of the split model runs or,
   where a compiled kernel meets a mixer's CPU tensors, raises
   ``nnterp.KernelFailure`` (the kernel's own error, naming ``route_kernels``);
3. reads ``states`` of every mixer through ``nnterp.fast_states(model)`` (the
   kernel stays the optimized one, routed only where the check refuses it) and
   compares them with the routed states (``route_kernels(family, "torch")``, and
   ``chunk_per_token`` where the scan is chunked), and the logits of both runs
   with a float32 CPU load's (routed: a kernel bound for the GPU refuses it);
4. writes ``set_state_after(1, 2 * state_after(0))`` on a GPU mixer and on a CPU
   one, the value built on each mixer's own device, and checks that a CPU value
   written to a GPU mixer is refused with a message naming ``.to(...)``;
5. prints one line per check, ``PASS`` / ``FAIL`` / ``NOTE`` (appended and synced
   to ``--out`` as it comes, so a kill keeps what finished; a check that raises
   is a ``FAIL`` and the next runs), and a summary with the date, the GPU and the
   installed versions, for docs/remote.md. A family that would start after
   ``--budget-s`` is skipped, and says so.

Float32 throughout: ``TRITON_F32_DEFAULT=ieee`` is set before anything imports
Triton, so fla's float32 matmuls are not TF32 (10 bits of mantissa), and the
tolerance below holds for float32's reordered sums.

Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

# Before Triton is imported (fla's kernels are compiled at their first call, reading it then): float32 dot products in IEEE
# float32, not TF32, which would miss TOLERANCE by orders of magnitude.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "The Eiffel Tower is in the city of Paris, which is in France"
KINDS = ("qwen3_5_text", "mamba2")
#: fla 0.6.0's own tests' smallest head dim; the tiny configs' are 16 and 8 (untested by fla, fine for torch).
HEAD_DIMS = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
#: States computed two ways agree to float rounding: the chunked kernels reorder the sums.
TOLERANCE = dict(rtol=1e-3, atol=1e-4)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the checks on the CPU alone, to check this script")
    parser.add_argument("--out", help="a file each result line is appended to as it comes")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="no family starts after this many seconds")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked. "
              "Run it on a machine with a GPU.")
        return 2

    import transformers

    import nnterp

    results: list[tuple[str, str, str]] = []
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended to for the whole run, closed below

    def say(line: str) -> None:
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()
            os.fsync(out.fileno())

    def report(status: str, what: str, detail: str = "") -> None:
        results.append((status, what, detail))
        say(f"{status:4} {what}" + (f": {detail}" if detail else ""))

    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds:
            if time.monotonic() - started > args.budget_s:
                report("NOTE", f"{kind}: skipped", f"--budget-s {args.budget_s:.0f} spent before it began")
                continue
            try:
                check(kind, Path(folder), report, gpu=not args.cpu_dry_run)
            except Exception as error:  # noqa: BLE001 - one family's failure is reported, the others still run
                report("FAIL", f"{kind}: raised", f"{type(error).__name__}: {error}")

    failed = sum(status == "FAIL" for status, _, _ in results)
    where = torch.cuda.get_device_name(0) if not args.cpu_dry_run else "the CPU (dry run)"
    say(f"\ngpu_check {datetime.date.today().isoformat()} on {where}: Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, nnterp {nnterp.__version__}, "
        f"flash-linear-attention {version('flash-linear-attention')}, triton {version('triton')}, mamba_ssm {version('mamba_ssm')}, "
        f"causal-conv1d {version('causal_conv1d')}: {len(results) - failed} of {len(results)} checks passed")
    if out is not None:
        out.close()
    return 1 if failed else 0


def version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def attempt(report, what: str, run) -> None:
    """Run one check; one that raises is reported as failed, and the next runs."""
    try:
        run()
    except Exception as error:  # noqa: BLE001 - reported, and the next check runs
        report("FAIL", f"{what}: raised", f"{type(error).__name__}: {str(error)[:300]}")


def check(kind: str, folder: Path, report, gpu: bool = True) -> None:
    import torch

    import nnterp
    from benchmarks.cases import build
    from benchmarks.gpu import transformers_mamba2
    from nnterp import StandardizedTransformer
    from nnterp.testing import tiny_config

    transformers_mamba2()  # with fla installed, a Mamba-2 checkpoint would load as fla's model
    config = tiny_config(kind)
    for key, dim in HEAD_DIMS.items():
        if getattr(config, key, dim) < dim:
            setattr(config, key, dim)
    path = str(build(kind, config, folder))
    plain = StandardizedTransformer(path, dispatch=True, device="cpu")
    size = sum(p.numel() * p.element_size() for p in plain._module.parameters())
    # A CPU load under a kernel bound for the GPU is refused: the reference runs transformers' pure torch.
    with nnterp.route_kernels(plain.family, "torch"), torch.no_grad(), plain.trace(PROMPT):
        reference = plain.logits.save()
    # About half the weights fit on the GPU, the rest go to the CPU; then every mixer on the GPU, the rest on the CPU
    # (so an optimized kernel bound for the mixers is never refused for a CPU tensor).
    memory = {0: size // 2, "cpu": 64 * size} if gpu else {"cpu": 64 * size}
    auto = StandardizedTransformer(path, dispatch=True, device_map="auto", max_memory=memory)
    placement = getattr(auto._module, "hf_device_map", None) or {}
    devices = {str(device) for device in placement.values()}
    if gpu:
        report("PASS" if {"0", "cpu"} <= devices or {"cuda:0", "cpu"} <= devices else "FAIL",
               f"{kind}: device_map='auto' splits the layers over GPU and CPU", str(placement))
    attempt(report, f"{kind} (device_map='auto')", lambda: check_placement(f"{kind} (device_map='auto')", auto, reference, report))
    layers = plain.family.LAYERS
    body = layers.rpartition(".")[0]
    mapping = {name: "cpu" for name, _ in plain._module.named_children() if name != body}
    mapping.update({f"{body}.{name}": "cpu" for name, _ in plain._at(body)._module.named_children() if f"{body}.{name}" != layers})
    mapping.update({f"{layers}.{i}": (0 if gpu and layer.linear_attn is not None else "cpu") for i, layer in enumerate(plain.layers)})
    split = StandardizedTransformer(path, dispatch=True, device_map=mapping)
    attempt(report, f"{kind} (mixers on the GPU)", lambda: check_placement(f"{kind} (mixers on the GPU)", split, reference, report))


def check_placement(name: str, model, reference, report) -> None:
    import contextlib

    import nnsight
    import torch

    import nnterp
    from nnterp.recurrent.kernels import compiled_package

    family = model.family
    component = family.MIXER
    bound = {fn: compiled_package(family.MODELING.__dict__.get(fn))
             for fn in (component.CHUNK_FUNCTION, component.RECURRENT_FUNCTION, *component.CONV_FUNCTIONS)}
    report("NOTE" if not any(bound.values()) else "PASS", f"{name}: optimized kernels bound",
           ", ".join(f"{fn} -> {package or 'pure torch'}" for fn, package in bound.items()))
    mixers = [(i, layer.linear_attn) for i, layer in enumerate(model.layers) if layer.linear_attn is not None]
    on_cpu = any(_device(mix).type == "cpu" for _, mix in mixers)
    reason = None
    try:
        with torch.no_grad(), model.trace(PROMPT):
            model.logits.save()
    except nnterp.KernelFailure as error:  # a compiled kernel refused a mixer's CPU tensors: its own error, and the fix
        reason = " ".join(str(error).split())
    possible = any(bound.values()) and on_cpu
    report("PASS" if reason is None or (possible and "route_kernels" in reason) else "FAIL",
           f"{name}: a trace runs, or fails only where a compiled kernel meets a CPU mixer, naming route_kernels",
           reason or "ran")
    # Failed: the fast path runs with the family routed (its states still come from the kernel call's arguments).
    fast_kernels = (lambda: nnterp.route_kernels(family, "torch")) if reason is not None else contextlib.nullcontext
    found: dict = {}

    def fast_read() -> None:
        with fast_kernels(), nnterp.fast_states(model), torch.no_grad(), model.trace(PROMPT):
            found["fast"] = nnsight.save([mix.states for _, mix in mixers])
            logits = model.logits.save()
        report("PASS" if close(logits, reference) else "FAIL", f"{name}: logits under fast_states equal a CPU load's",
               difference(logits, reference))

    def routed_read() -> None:
        per_token = nnterp.chunk_per_token(model) if component.CHUNKED_SCAN else contextlib.nullcontext()
        with nnterp.route_kernels(family, "torch"), per_token, torch.no_grad(), model.trace(PROMPT):
            found["routed"] = nnsight.save([mix.states for _, mix in mixers])
            logits = model.logits.save()
        report("PASS" if close(logits, reference) else "FAIL", f"{name}: logits routed equal a CPU load's",
               difference(logits, reference))

    attempt(report, f"{name}: states under fast_states", fast_read)
    attempt(report, f"{name}: states routed", routed_read)
    for (index, mix), a, b in zip(mixers, found.get("fast", ()), found.get("routed", ())):
        report("PASS" if close(a, b) else "FAIL", f"{name}: layer {index} ({_device(mix)}) fast-path states equal routed ones",
               difference(a, b))

    def write(index: int, mix, device_type: str) -> None:
        with fast_kernels(), nnterp.fast_states(model), torch.no_grad(), model.trace(PROMPT):
            first = mix.state_after(0)
            mix.set_state_after(1, 2 * first)
            after = mix.state_after(1).save()
            doubled = (2 * first).save()
        report("PASS" if torch.equal(after.cpu(), doubled.cpu()) else "FAIL",
               f"{name}: set_state_after on layer {index} ({device_type}) with a value built on its own device")

    def write_from_cpu(index: int, mix, device_type: str) -> None:
        try:
            with fast_kernels(), nnterp.fast_states(model), torch.no_grad(), model.trace(PROMPT):
                mix.set_state_after(1, torch.zeros_like(mix.state_after(0)).cpu())
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            good = ".to(" in str(error)
            report("PASS" if good else "FAIL", f"{name}: a CPU value written to layer {index} names the .to(...)", str(error)[:200])
        else:
            report("FAIL", f"{name}: a CPU value written to layer {index} ({device_type}) was accepted")

    first_on: dict = {}
    for index, mix in mixers:
        first_on.setdefault(_device(mix).type, (index, mix))
    for device_type, (index, mix) in sorted(first_on.items()):
        attempt(report, f"{name}: set_state_after on layer {index}", lambda i=index, m=mix, d=device_type: write(i, m, d))
        if device_type != "cpu":
            attempt(report, f"{name}: a CPU value written to layer {index}", lambda i=index, m=mix, d=device_type: write_from_cpu(i, m, d))


def _device(mix):
    import torch

    parameter = next(mix._module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def close(a, b) -> bool:
    import torch

    return torch.allclose(a.float().cpu(), b.float().cpu(), **TOLERANCE)


def difference(a, b) -> str:
    return f"max abs diff {(a.float().cpu() - b.float().cpu()).abs().max().item():.2e}"


if __name__ == "__main__":
    sys.exit(main())
