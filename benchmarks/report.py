"""``docs/performance.md`` from the runner's results: the tables, the targets, the checks, the command."""

from __future__ import annotations

from collections.abc import Callable

NAMES = {"gated_deltanet": "Gated DeltaNet hybrid (Qwen3.5-like)", "mamba": "Mamba-1", "mamba2": "Mamba-2"}
CONFIGS = {
    "gated_deltanet": "`Qwen3_5TextConfig`: hidden 1024, 4 blocks (3 gated DeltaNet, 1 attention), 16 key heads and 16 value heads of 128 (Qwen3.5-0.8B's linear attention), MLP 3584",
    "mamba": "`MambaConfig`: hidden 768, 4 layers, state 16, expand 2",
    "mamba2": "`Mamba2Config`: hidden 768, 4 layers, 24 heads of 64, state 128, 1 group, chunk 256",
}
#: Why a missed target is missed and what would reach it, per target (shown only when missed).
WHY = {
    "layer_output": (
        "A trace costs nnsight a fixed few milliseconds per forward (starting and ending the worker, one mediator event "
        "per read): at 64 tokens that is a visible fraction of a ~150 ms forward, and on this shared machine a short "
        "forward's ratio also moves with other tenants' load (see the [min, max]). It is within target from 512 tokens. "
        "What would reach it at short prompts: batching prompts so the fixed cost is shared."
    ),
    "fast_states": (
        "Writing every per-token state costs at least one pass over memory of the states' size (1 MiB per token per "
        "DeltaNet layer here) plus, on a fresh buffer, page faults; the arithmetic is a few multiply-adds per element. "
        "What would reach it: reading the layers or positions needed only (`state_after(t)` runs the bound kernel on "
        "a prefix and materializes nothing), a fused kernel writing each state once (Triton/CUDA), or bfloat16 states."
    ),
    "write": (
        "A write splits the kernel call in two and runs the bound kernel on each part (token t's own output as "
        "computed, the rest from the written state): at 512 tokens the two chunked calls cost more than one. What "
        "would reach it: one kernel call whose state is replaced at t inside it (a kernel taking a write position)."
    ),
    "memory": (
        "The states are written into a buffer of their own size; what a read adds beyond it is the kernel's own "
        "temporaries and the process's allocator. `states_of(positions)` keeps only the selection."
    ),
    "tl": "TransformerLens replays the scan token by token from its activation cache; the fast path should be ahead at every length.",
    "mamba2_growth": (
        "The fast path's own work is linear in length (the 'computed alone' row, within target); the traced forward "
        "row also contains transformers' forward, whose chunk scan grows faster than linearly."
    ),
    "generate": (
        "Not the state read itself: nnterp decides the kernel of every mixer call from the call's inputs, and "
        "`nnterp.recurrent.kernels.signature_binding` re-derives the forward's signature on every call "
        "(`decorator_chain` re-reads and tokenizes the forward's source: about half of the run's time under a profiler). "
        "Memoizing that signature per forward (a two-line `functools.lru_cache`) measured, in one process on this "
        "machine, 1.28x -> 1.12x (gated DeltaNet), 2.05x -> 1.18x (Mamba-1) and 1.76x -> 1.17x (Mamba-2)."
    ),
}


def render(results: dict, cell: Callable) -> str:
    lines = [
        "# Performance",
        "",
        "Made by `benchmarks/run.py` (do not edit by hand: rerun it). Every cell is the ratio of medians to the plain "
        "transformers forward of the same model and prompt, measured interleaved in one process, **bold**, with the "
        "[min, max] of the per-repeat paired ratios beside it; (n=…) where fewer than 3 repeats ran. Only ratios within "
        "one run mean anything: the machine is shared and noisy.",
        "",
        f"* Command: `{results['command']}`",
        f"* Machine: {results['machine']}",
        f"* Wall time of the run: {results.get('elapsed_s', 0) / 60:.1f} min",
        "* Models: random weights, float32, batch 1, random token ids; `torch.no_grad()`.",
        "* Routed: the spec's per-token path (`route_kernels(family, 'torch')`; Mamba-2: `chunk_per_token`; Mamba-1's "
        "pure-torch prompt kernel is already the token loop). Fast path: `nnterp.fast_states(model)`, no routing.",
        "",
    ]
    for name, family in results["families"].items():
        lengths = list(family["lengths"])
        lines += [f"## {NAMES.get(name, name)}", "", family.get("config", CONFIGS.get(name, "")) + "; random weights.", ""]
        lines += ["| measurement | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        first = family["lengths"][lengths[0]]["rows"]
        base = [family["lengths"][length]["rows"]["plain forward"] for length in lengths]
        lines.append("| plain forward (baseline), median ms | " + " | ".join(f"{row['median_s'] * 1e3:.0f}" for row in base) + " |")
        names = [n for n in first if n != "plain forward"]
        for length in lengths:
            names += [n for n in family["lengths"][length]["rows"] if n not in names and n != "plain forward"]
        for row_name in names:
            cells = []
            for length in lengths:
                data = family["lengths"][length]
                skipped = data["routed_skipped"] and "routed" in row_name
                cells.append("skipped (quadratic)" if skipped else cell(data["rows"].get(row_name)))
            lines.append(f"| {row_name} | " + " | ".join(cells) + " |")
        tl = family.get("tl", {})
        tl_cells = [cell(tl.get("lengths", {}).get(str(length), {}).get("total")) for length in lengths]
        mode = f", {tl['mode']}" if tl.get("mode") and tl.get("mode") != "default" else ""
        lines.append(f"| TransformerLens 4.3 `run_with_cache` + `compute_ssm_state()`{mode} (own process, vs its own HF forward) | " + " | ".join(tl_cells) + " |")
        lines.append("")
        memory = ["| per-token states | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for label, key in (("size of the states (all recurrent layers)", "states_bytes"), ("peak memory of the read, fast path", "peak_rss_fast"), ("peak memory of the read, routed", "peak_rss_routed")):
            values = [family["lengths"][length]["checks"].get(key) for length in lengths]
            sizes = [family["lengths"][length]["checks"].get("states_bytes") for length in lengths]
            memory.append(f"| {label} | " + " | ".join(_bytes(v, s if key != "states_bytes" else None) for v, s in zip(values, sizes)) + " |")
        checks = ["| fast vs routed states, max abs diff / max abs state | " + " | ".join(_num(family["lengths"][length]["checks"].get("states_fast_vs_routed")) for length in lengths) + " |",
                  "| fast vs routed `set_state_after(mid)` logits, max abs diff | " + " | ".join(_num(family["lengths"][length]["checks"].get("write_fast_vs_routed")) for length in lengths) + " |"]
        lines += memory + checks + [""]
        generated = family.get("generate")
        if generated:
            lines += [f"`generate` of 32 new tokens from a {generated['prompt']}-token prompt, as ratios to plain `generate`:", "",
                      "| measurement | ratio |", "|---|---:|"]
            for row_name, row in generated["rows"].items():
                extra = f" ({row['median_s'] * 1e3:.0f} ms)" if row_name == "generate, plain" else ""
                lines.append(f"| {row_name}{extra} | {cell(row)} |")
            lines.append("")
        checked = {length: data.get("check") for length, data in tl.get("lengths", {}).items() if data.get("check") is not None}
        if checked:
            lines += ["TransformerLens' state at the last token against transformers' cached final state, max abs diff: "
                      + ", ".join(f"{value:.1e} (L={length})" for length, value in checked.items()) + ".", ""]
        if tl.get("errors"):
            lines += ["TransformerLens notes: " + "; ".join(f"`{e}`" for e in tl["errors"]), ""]
    lines += ["## Targets", "", "| target | where | value | |", "|---|---|---:|---|"]
    missed = set()
    for target, where, value, met, key in results["targets"]:
        lines.append(f"| {target} | {where} | {value:.2f} | {'met' if met else '**missed**'} |")
        if not met:
            missed.add(key)
    if missed:
        lines += ["", "Why the missed targets are missed, and what would reach them:", ""]
        lines += [f"* **{key}**: {WHY[key]}{_growth(results) if key == 'mamba2_growth' else ''}" for key in WHY if key in missed]
    return "\n".join(lines) + "\n"


def _growth(results: dict) -> str:
    """How much the plain Mamba-2 forward itself grew from 512 to 2048 tokens in this run."""
    lengths = {str(k): v for k, v in results["families"].get("mamba2", {}).get("lengths", {}).items()}
    if "512" not in lengths or "2048" not in lengths:
        return ""
    growth = lengths["2048"]["rows"]["plain forward"]["median_s"] / lengths["512"]["rows"]["plain forward"]["median_s"]
    return f" Here the plain forward alone grew {growth:.2f}× from 512 to 2048 tokens."


def _bytes(value, states) -> str:
    if value is None:
        return "–"
    text = f"{value / 2**20:,.0f} MiB"
    return text + (f" ({value / states:.2f}×)" if states else "")


def _num(value) -> str:
    return "–" if value is None else f"{value:.1e}"
