"""Soak: many traces and ``generate`` runs reading and writing states, with the process's memory sampled as they go.

    python benchmarks/soak.py                          # the full run: 1,000 traces and 300 generate runs per kind
    python benchmarks/soak.py --runs 200 --generate 60 --every 10     # a shorter run

Not run in CI. On each recurrent kind (gated DeltaNet: ``qwen3_5_text``, Kimi
delta attention: ``kimi_linear``, Mamba-1, Mamba-2), loaded from its tiny
checkpoint (`nnterp.testing.tiny_checkpoint`), it runs ``--runs`` traces and then
``--generate`` runs of ``generate``. Traces cycle through the ways the family
serves the state after every token (the fast path, routed kernels, Mamba-2's
chunk boundaries, Mamba-1's own loop) and through three prompts (one short,
one long, a left-padded batch of two); even traces read ``states`` and
``state_output`` of every recurrent layer, odd ones write ``set_state_after``
mid-prompt on every recurrent layer. Each ``generate`` run (4 new tokens)
reads ``state_output`` of the prompt step and, on every decode step, reads
``state_input`` and writes a scaled copy back.

Every ``--every`` runs it collects garbage and samples the resident set size
(psutil when installed, else ``VmRSS`` of /proc/self/status, else the peak
from ``resource``). Memory is *flat* when the median of the last quarter's
samples is within ``--tolerance`` (3 %) of the second quarter's (the first
quarter is warm-up: instrumenting the forwards, filling the fast path's buffer
pool). Prints a markdown table, one row per kind and workload, for
docs/performance.md; exits 1 when a row is not flat.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import time

#: The recurrent kinds, by their mixer component; each is soaked on the family that introduces it (`kinds`).
LABELS = {"LinearAttention": "DeltaNet", "KimiDeltaAttention": "Kimi", "SelectiveScan": "Mamba-1", "StateSpace": "Mamba-2"}
PROMPTS = (
    "The Eiffel Tower is in the city of",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen",
    ["Hello world", "My favourite food is pizza with cheese and"],
)
NEW_TOKENS = 4


def kinds() -> dict[str, str]:
    """``{kind: model_type}``: each recurrent mixer component (`LABELS`) by the first family that declares it."""
    from nnterp.families import families

    found = {}
    for family in families():
        mixer, parent = family.MIXER, getattr(family.__mro__[1], "MIXER", None)
        if mixer is not None and mixer is not parent:
            found[LABELS.get(mixer.__name__, mixer.__name__)] = family.NAME
    return found


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="traces per kind")
    parser.add_argument("--generate", type=int, default=300, help="generate runs per kind")
    parser.add_argument("--every", type=int, default=25, help="sample the RSS every this many runs")
    parser.add_argument("--kinds", nargs="+", default=list(LABELS.values()), choices=list(LABELS.values()))
    parser.add_argument("--tolerance", type=float, default=0.03, help="largest relative growth called flat")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


# -- memory ------------------------------------------------------------------------------


def rss_source() -> str:
    try:
        import psutil  # noqa: F401

        return "psutil"
    except ImportError:
        pass
    if os.path.exists("/proc/self/status"):
        return "/proc/self/status"
    return "resource (peak)"


def rss_mib() -> float:
    """The resident set size now, in MiB (the peak where only `resource` is available)."""
    source = rss_source()
    if source == "psutil":
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    if source == "/proc/self/status":
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


class Sampler:
    def __init__(self, every: int) -> None:
        self.every, self.samples = every, []

    def tick(self, run: int, force: bool = False) -> None:
        if force or run % self.every == 0:
            gc.collect()
            self.samples.append((run, rss_mib()))

    def verdict(self, tolerance: float) -> dict:
        runs = [run for run, _ in self.samples]
        values = [mib for _, mib in self.samples]
        quarter = max(1, len(values) // 4)
        q2 = slice(quarter, 2 * quarter) if len(values) >= 2 * quarter else slice(0, len(values))
        q4 = slice(len(values) - quarter, len(values))
        second, last = statistics.median(values[q2]), statistics.median(values[q4])
        between = statistics.median(runs[q4]) - statistics.median(runs[q2])  # runs from the 2nd quarter's middle to the last's
        growth = (last - second) / second
        return {
            "start": values[0],
            "second": second,
            "last": last,
            "end": values[-1],
            "growth": growth,
            "per_run_kib": (last - second) * 1024 / between if between else 0.0,
            "samples": len(values),
            "flat": growth <= tolerance,
        }


# -- workloads ---------------------------------------------------------------------------


def strategies(model) -> list[str]:
    """The ways ``model`` serves the state after every token (fast path, routed kernels, chunk boundaries, Mamba-1's own loop)."""
    if model.family.MIXER.CHUNKED_SCAN:  # Mamba-2
        return ["fast", "routed+chunks", "chunks"]
    if model.family.MIXER.FAST is None:
        return ["routed", "default"]  # Mamba-1: the pure-torch scan is its own token loop
    return ["fast", "routed"]


@contextlib.contextmanager
def serving(model, strategy: str):
    import nnterp

    with contextlib.ExitStack() as stack:
        if "routed" in strategy:
            stack.enter_context(nnterp.route_kernels(model.family, "torch"))
        if "fast" in strategy:
            stack.enter_context(nnterp.fast_states(model))
        if "chunks" in strategy:
            stack.enter_context(nnterp.chunk_per_token(model))
        yield


def mixers(model) -> list:
    return [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]


def donors(model) -> dict:
    """A state of each recurrent layer's shape (batch 1, broadcast over rows by the write's own check)."""
    import torch

    found = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index, mix in enumerate(mixers(model)):
            found[index] = (0.5 * mix.state_output).save()
    return found


def trace(model, run: int, plan: list[str], values: dict) -> None:
    import torch

    prompt = PROMPTS[run % len(PROMPTS)]
    rows = len(prompt) if isinstance(prompt, list) else 1
    with serving(model, plan[(run // 2) % len(plan)]), torch.no_grad(), model.trace(prompt):
        for index, mix in enumerate(mixers(model)):
            if run % 2 == 0:
                mix.states.save()
                mix.state_output.save()
            else:
                mix.set_state_after(2, values[index].expand(rows, *values[index].shape[1:]))
        model.logits.save()


def generate(model, run: int) -> None:
    import torch

    prompt = PROMPTS[run % 2]
    with torch.no_grad(), model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False) as tracer:
        for step in tracer.iter[:NEW_TOKENS]:
            for mix in mixers(model):
                entering = mix.state_input
                if entering is not None:
                    mix.state_input = 0.9 * entering
                mix.state_output.save()
        tracer.result.save()


def soak(kind: str, args: argparse.Namespace) -> list[dict]:
    from nnterp import StandardizedTransformer
    from nnterp.testing import tiny_checkpoint

    model = StandardizedTransformer(str(tiny_checkpoint(kinds()[kind])), dispatch=True, device="cpu")
    plan = strategies(model)
    values = donors(model)
    rows = []
    for workload, count, step in (("trace", args.runs, lambda r: trace(model, r, plan, values)), ("generate", args.generate, lambda r: generate(model, r))):
        if count <= 0:
            continue
        sampler = Sampler(args.every)
        started = time.perf_counter()
        for run in range(count):
            sampler.tick(run)
            step(run)
        sampler.tick(count, force=True)  # after the last run
        seconds = time.perf_counter() - started
        row = {"kind": kind, "workload": workload, "runs": count, "seconds": seconds, **sampler.verdict(args.tolerance)}
        rows.append(row)
        print(f"{kind} {workload}: {count} runs in {seconds:.1f}s, RSS {row['start']:.0f} -> {row['end']:.0f} MiB", file=sys.stderr, flush=True)
    return rows


def fast_pool() -> str:
    try:
        from nnterp.fast.buffers import cached_bytes
    except ImportError:
        return "n/a"
    in_use, idle = cached_bytes()
    return f"{in_use / 2**20:.1f} MiB in use, {idle / 2**20:.1f} MiB idle"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"RSS from {rss_source()}, sampled every {args.every} runs after gc.collect(); flat: median of the last "
        f"quarter's samples within {args.tolerance:.0%} of the second quarter's. {platform.platform()}, "
        f"{args.threads} thread(s).",
        "",
        "| kind | workload | runs | time/run | RSS start (MiB) | 2nd quarter | last quarter | growth | per run (2nd to last quarter) | flat |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['workload']} | {r['runs']:,} | {r['seconds'] / r['runs'] * 1000:.0f} ms | {r['start']:.0f} | "
            f"{r['second']:.1f} | {r['last']:.1f} | {r['growth']:+.2%} | {r['per_run_kib']:+.1f} KiB | {'yes' if r['flat'] else '**no**'} |"
        )
    lines += ["", f"Fast path's state buffer pool at the end: {fast_pool()}."]
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for kind in args.kinds:
        rows += soak(kind, args)
    print(table(rows, args))
    return 0 if all(r["flat"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
