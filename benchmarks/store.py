"""Benchmark rows of the state store (issue 26): `nnterp.collect` over a dataset against plain batched forwards.

    taskset -c 0 python benchmarks/store.py --page docs/performance.md   # the page's "State store" section
    python benchmarks/store.py --size tiny --prompts 16 --reps 1        # a smoke run (printed only)

Mental model: a store's cost is what `collect` adds to the forwards it runs.
One random-weight gated DeltaNet hybrid (``--size``: ``small``, the
benchmark's medium ``gated_deltanet`` layout of `benchmarks.models`, three
DeltaNet blocks and one attention block, at hidden 256 with 4 key and value
heads of 64; ``medium``, Qwen3.5-0.8B's linear attention, 16 heads of 128;
``tiny``, the test suite's sizes), ``--prompts`` random
prompts of ``--length`` tokens (a quarter of them shorter, so batches are
left-padded), in batches of ``--batch``. Interleaved repeats
(`benchmarks.timing`) of three calls over the same prompts:

1. plain batched forwards: the plain transformers model on each tokenized batch (the baseline);
2. `collect` of every recurrent layer's ``state_output`` (a folder per repeat, removed after it);
3. `collect` of every recurrent layer's ``states``, ``factorized=True`` (``--checkpoint-every``);
4. the same with ``factorized="inputs"`` (the mixer's inputs, the arguments recomputed through the weights on reading).

A row's throughput is prompts per second; its ratio is the baseline's median
time over its median (issue 26's targets: ≥ 0.8x and ≥ 0.5x), ``[min, max]``
of the paired repeats beside it. Memory: the process's peak RSS above its
level before one more call of each (`timing.peak_rss`), and the bytes the
store holds per prompt, and for the factorized rows their fraction of the
float32 states they stand for (issue 26's storage bound: ``1/key_dim`` plus
the checkpoints). ``--page`` replaces the page's section between the
markers `SECTION` and `END` (`benchmarks/run.py` keeps it); without it the
section is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTION = "<!-- store: made by benchmarks/store.py; do not edit by hand -->"
END = "<!-- /store -->"
TARGETS = {"state_output": 0.8, "factorized": 0.5, "inputs": 0.5}


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--length", type=int, default=64, help="tokens of the longer prompts (a quarter have half as many)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", choices=("tiny", "small", "medium"), default="small", help="the model (`model_config`)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default=str(Path("~/.cache/nnterp-bench").expanduser()))
    parser.add_argument("--page", help="a performance page whose store section this run replaces")
    return parser.parse_args(argv)


def main(argv: list | None = None) -> str:
    args = parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    import nnterp
    from benchmarks import cases
    from benchmarks.timing import Method, interleave, peak_rss, summary

    started = time.time()
    config = model_config(args.size)
    plain, model = cases.load(cases.build("gated_deltanet", config, Path(args.cache)))
    model.tokenizer.padding_side = "left"
    prompts = texts(model, args.prompts, args.length)
    layers = [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]
    outputs = [f"layers.{i}.linear_attn.state_output" for i in layers]
    states = [f"layers.{i}.linear_attn.states" for i in layers]
    scratch = Path(tempfile.mkdtemp(prefix="nnterp-store-bench-"))
    sizes: dict = {}
    tokens: list = []  # tokens per prompt, from a store's index

    def forwards() -> None:
        with torch.no_grad():
            for lo in range(0, len(prompts), args.batch):
                plain(**model.tokenizer(prompts[lo : lo + args.batch], return_tensors="pt", padding=True))

    def collecting(name: str, values: list, **kwargs) -> Callable[[], None]:
        def run() -> None:
            folder = scratch / name
            store = nnterp.collect(model, prompts, folder, values, batch_size=args.batch, resume=False, progress=False, **kwargs)
            sizes[name] = sum(p.stat().st_size for p in folder.iterdir()) / len(store)
            tokens[:] = [sum(p["length"] for p in store.manifest["prompts"]) / len(store)]
            shutil.rmtree(folder)

        return run

    cpu: dict = {}

    def timed(name: str, run: Callable[[], None]) -> Method:
        """A method that also keeps the process's CPU time of each run (the wall clock counts the other processes)."""

        def both() -> None:
            start = time.process_time()
            run()
            cpu.setdefault(name, []).append(time.process_time() - start)

        return Method(name, both)

    methods = [
        timed("plain batched forwards", forwards),
        timed("collect, state_output of every recurrent layer", collecting("state_output", outputs)),
        timed(f"collect, states of every recurrent layer, factorized (checkpoint_every={args.checkpoint_every})",
              collecting("factorized", states, factorized=True, checkpoint_every=args.checkpoint_every)),
        timed(f"collect, states of every recurrent layer, factorized='inputs' (checkpoint_every={args.checkpoint_every})",
              collecting("inputs", states, factorized="inputs", checkpoint_every=args.checkpoint_every)),
    ]
    interleave(methods, args.reps)
    memory = [peak_rss(method.run)[0] for method in methods]
    for method in methods:
        method.cpu = cpu[method.name][: len(method.times)]
    shutil.rmtree(scratch, ignore_errors=True)
    # The float32 states a factorized row stands for: every token's, in every recurrent layer.
    state = 4 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    sizes["states"] = tokens[0] * len(layers) * state
    text = render(args, config, methods, memory, sizes, len(layers), time.time() - started, summary)
    if args.page:
        replace_section(Path(args.page), text)
    print(text)
    return text


def model_config(size: str):
    """The gated DeltaNet hybrid's config: the benchmark's tiny or medium one (`benchmarks.models`), or ``small``: the
    medium one's layout (three DeltaNet blocks, then attention) at hidden 256, 4 key and 4 value heads of 64."""
    from benchmarks.models import configs

    config = configs(size == "tiny")["gated_deltanet"]
    if size == "small":
        config = type(config)(**{
            **config.to_dict(), "hidden_size": 256, "intermediate_size": 768, "linear_num_key_heads": 4, "linear_num_value_heads": 4,
            "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        })
    return config


def texts(model, count: int, length: int) -> list:
    """``count`` prompts of random token ids, decoded: ``length`` tokens, every fourth of half as many (padded batches)."""
    from benchmarks.cases import prompt

    found = []
    for i in range(count):
        ids = prompt(model, length if i % 4 else length // 2, seed=i)[0]
        found.append(model.tokenizer.decode(ids))
    return found


def render(args, config, methods: list, memory: list, sizes: dict, recurrent: int, elapsed: float, summary) -> str:
    import nnterp
    from benchmarks.run import describe

    base = methods[0]
    base_cpu = statistics.median(base.cpu)
    rows = [
        "| call | prompts/s of CPU time | throughput vs plain forwards, CPU time | wall clock | peak RSS above the start | "
        "store on disk per prompt | of the states (bound: 1/key_dim + 1/checkpoint_every) | target (CPU time) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {base.name} | {args.prompts / base_cpu:.1f} | 1.00 | 1.00 | {memory[0] / 2**20:.0f} MiB | – | – | – |",
    ]
    for method, peak, key in zip(methods[1:], memory[1:], ("state_output", "factorized", "inputs")):
        wall = summary(method, base)
        ratio = base_cpu / statistics.median(method.cpu)
        paired = [b / m for b, m in zip(base.cpu, method.cpu)]
        met = "met" if ratio >= TARGETS[key] else "**missed**"
        bound = 1 / config.linear_key_head_dim + 1 / args.checkpoint_every
        fraction = "–" if key == "state_output" else f"{sizes[key] / sizes['states']:.4f} ({bound:.4f})"
        rows.append(
            f"| {method.name} | {args.prompts / statistics.median(method.cpu):.1f} | **{ratio:.2f}** [{min(paired):.2f}, {max(paired):.2f}] "
            f"| {1 / wall['ratio']:.2f} [{1 / wall['max']:.2f}, {1 / wall['min']:.2f}] | {peak / 2**20:.0f} MiB | {sizes[key] / 2**10:.0f} KiB "
            f"| {fraction} | ≥ {TARGETS[key]}x: {met} |"
        )
    return "\n".join([
        SECTION,
        "## State store (`nnterp.collect`)",
        "",
        f"Made by `benchmarks/store.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, nnterp {nnterp.__version__}, "
        f"{args.threads} thread, on cores {sorted(os.sched_getaffinity(0))}, {elapsed:.0f} s): {args.prompts} prompts of {args.length} "
        f"random tokens (every fourth of {args.length // 2}, so batches are left-padded) in batches of {args.batch}, "
        f"{args.reps} interleaved repeats, on a {args.size} random-weight gated DeltaNet hybrid "
        f"({recurrent} DeltaNet blocks; {describe(config)}). Throughput is prompts per second of the whole call (tokenizing, "
        "the trace, the copies, the shard written and synced); its ratio is the plain forwards' median time over the "
        "call's, `[min, max]` of the paired repeats, in the process's CPU time (the work done; the target is judged on "
        "it) and in wall-clock time (which also counts the other processes sharing the core, and the waits for the "
        f"disk: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end of this run). Peak RSS: one "
        "more call of each, above the process's RSS before it. Of the states: the store's bytes (its checkpoints, "
        f"one state per {args.checkpoint_every} tokens, included) over the float32 states of every token it stands for.",
        "",
        *rows,
        "",
        END,
        "",
    ])


def replace_section(page: Path, text: str, begin: str = SECTION, close: str = END) -> None:
    """Put ``text`` between the markers ``begin`` and ``close`` of ``page`` (appended where it has none)."""
    old = page.read_text()
    start, end = old.find(begin), old.find(close)
    if start < 0 or end < 0:
        page.write_text(old.rstrip("\n") + "\n\n" + text)
    else:
        page.write_text(old[:start] + text + old[end + len(close) + 1 :])


if __name__ == "__main__":
    main()
