"""``docs/performance.md`` from the runner's results: the tables, the targets, the checks, the command."""

from __future__ import annotations

from collections.abc import Callable

NAMES = {
    "gated_deltanet": "Gated DeltaNet hybrid (Qwen3.5-like)", "mamba": "Mamba-1", "mamba2": "Mamba-2",
    "kimi_delta_attention": "Kimi delta attention hybrid (Kimi-Linear-like)", "lightning_attention": "Lightning attention hybrid (MiniMax-Text-01-like)",
    "rg_lru": "RG-LRU hybrid (RecurrentGemma-like)", "wkv": "RWKV-4 WKV", "mlstm": "mLSTM (xLSTM-like)",
    "short_convolution": "Gated short convolution hybrid (LFM2-like)",
}
CONFIGS = {
    "gated_deltanet": "`Qwen3_5TextConfig`: hidden 1024, 4 blocks (3 gated DeltaNet, 1 attention), 16 key heads and 16 value heads of 128 (Qwen3.5-0.8B's linear attention), MLP 3584",
    "mamba": "`MambaConfig`: hidden 768, 4 layers, state 16, expand 2",
    "mamba2": "`Mamba2Config`: hidden 768, 4 layers, 24 heads of 64, state 128, 1 group, chunk 256",
}
#: Why a missed target is missed and what would reach it, per target (shown only when missed).
WHY = {
    "sweep_cell": (
        "A cell is one batch row of the sweep's batched trace, so its cost is the batched forward's per row plus the "
        "knockout's own work (the layer's effective-attention rows at the targets, computed once for the batch's rows, "
        "and the output edit). Where a kind's row is over the bound, compare it with the row '"
        "invokes of the prompt, nothing knocked out': on Kimi delta attention transformers' pure-torch chunked kernel "
        "costs about 1.6x per row in a batch of 8 on this CPU (memory traffic), before anything is knocked out. What "
        "would reach it there: a smaller batch_size (a batch of one costs about 1.25 forwards per cell), or the fused kernel."
    ),
    "layer_output": (
        "A trace costs nnsight a fixed few milliseconds per forward (starting and ending the worker, one mediator event "
        "per read): at 64 tokens that is a visible fraction of a ~150 ms forward, and on this shared machine a short "
        "forward's ratio also moves with other tenants' load (see the [min, max]). It is within target from 512 tokens. "
        "What would reach it at short prompts: batching prompts so the fixed cost is shared."
    ),
    "fast_states": (
        "The one pass (the default row) skips the kernel call and does its chunked transform once, so what remains "
        "beyond the plain forward is writing every per-token state: at least one pass over memory of the states' size "
        "(1 MiB per token per DeltaNet layer here). On this CPU each state is written by one multiply into the buffer "
        "and one in-place rank-one update (measured 1.8x the time of merely filling the buffer; fused into one pass it "
        "would be about 1x), from a buffer reused across reads (no page faults). What would reach it: a fused kernel "
        "writing each state once (Triton/CUDA: `benchmarks/gpu.py`; on CUDA the fill already runs by closed-form blocks, "
        "with no loop over tokens, untimed there yet), bfloat16 states (`nnterp.fast`'s functions store them given a "
        "bfloat16 `out`; `fast_states` keeps float32), or reading only the layers and positions needed "
        "(`model.states_of(positions, layers)`: cost and memory follow the selection)."
    ),
    "write": (
        "A write splits the kernel call in two (token t's own output as computed, the rest from the written state). "
        "On Mamba-1 and Mamba-2 both parts run the fast path's own pass, cheaper than transformers' torch kernels; on "
        "the delta rules both run the bound kernel, whose two chunked calls can cost more than one. What would reach "
        "it: one kernel call whose state is replaced at t inside it (a kernel taking a write position)."
    ),
    "memory": (
        "The states are written into a buffer of their own size; what a read adds beyond it is the kernel's own "
        "temporaries and the process's allocator. `states_of(positions)` keeps only the selection."
    ),
    "own_states": (
        "These kinds' own strategy is their fast path (`FromArguments` with no setting: lightning attention, the mLSTM and "
        "the short convolution), so this row and the fast states row time the same code. Lightning attention "
        "and the mLSTM compute the outputs with the states in one pass and skip the forward's own recurrence (the block "
        "loop's products; the backend call), as RWKV-4 skips its kernel's loop; the row with one_pass off shows the "
        "forward's recurrence followed by a states pass. What remains is writing every state: one multiply and one "
        "rank-one update per token into a buffer reused across reads, each block of states read by its queries while "
        "still in cache. On this CPU a write to the buffer first reads the cache line it replaces, so writing the "
        "states costs about twice merely filling the buffer: for lightning attention's 3 GiB at 2048 tokens (512 KiB "
        "per token and layer) about 0.07 of this forward by itself. The mLSTM's and lightning attention's rows have "
        "measured 1.35-1.51 from run to run on this machine (the [min, max] shows how far a repeat moves), before and "
        "after they joined `FromArguments`. What would reach it: a fused "
        "kernel writing each state once with streaming stores (a GPU kernel), bfloat16 states, or reading the layers "
        "and positions needed (`model.states_of(positions, layers)`: cost and memory follow the selection)."
    ),
    "skipped": "Not measured in this run: the length was skipped (the family's notes say why); rerun with a larger `--max-forward-s`.",
    "tl": "TransformerLens replays the scan token by token from its activation cache; the fast path should be ahead at every length.",
    "mamba2_growth": (
        "With the one pass the chunk scan is skipped when the states are read: the whole traced forward with every "
        "state now grows less than the plain forward does. The 'computed alone' row is the states' own pass, linear in "
        "arithmetic; at 2048 tokens it writes 6 GiB against 1.5 GiB at 512, and its growth sits at the target's edge "
        "(4.10 in the previous run, 4.26 in this one): memory, not a quadratic term."
    ),
    "generate": (
        "Not the state read itself. Reading a value inside a mixer's forward makes nnsight run an instrumented copy "
        "of that forward and stop at the operation read. Measured alone on this machine (2026-12-01, Mamba-2, 32 "
        "steps, every layer every step): one source operation's output cost 1.05-1.10x plain `generate`, the "
        "kernel call's output 1.09x, and `state_output` 1.17-1.21x, against 1.02-1.06x with nothing read. "
        "`state_output` stops three times per call where the kernel's output alone stops once: at the mixer's "
        "input (to choose the kernel the call runs), at the kernel's arguments (the call's record) and at its "
        "output. On a decode step of this small model (about 12 ms) these fixed costs per call are a visible share, "
        "and the run-to-run spread is about 0.05. What would reach it: a record that stops once, at the kernel's "
        "output, when nothing but the final state is read."
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
        "pure-torch prompt kernel is already the token loop). Fast path: `nnterp.fast_states(model)`, no routing. "
        "Own strategy: what `linear_attn.states` does with no setting, on the kinds that need none (their fast path).",
        "* A family's tables have the rows that apply to it; its notes say why the others are absent, in nnterp's own words "
        "(a refusal, a value's description). \u2013: not measured at that length.",
        "",
    ]
    for name, family in results["families"].items():
        lines += _family(name, family, cell)
    lines += [
        "## Targets", "",
        "The memory target is checked where a read's states (all layers) are at least 256 MiB; below that the "
        "process's peak during the read is the forward's own activations, not the states (the per-token tables show it).", "",
        "| target | where | value | |", "|---|---|---:|---|",
    ]
    missed = set()
    for target, where, value, met, key in results["targets"]:
        status = "not run" if met is None else "met" if met else "**missed**"
        lines.append(f"| {target} | {where} | {'–' if value is None else f'{value:.2f}'} | {status} |")
        if not met:
            missed.add(key)
    if missed:
        lines += ["", "Why the missed (or not run) targets are missed, and what would reach them:", ""]
        lines += [f"* **{key}**: {WHY[key]}{_growth(results) if key == 'mamba2_growth' else ''}" for key in WHY if key in missed]
    return "\n".join(lines) + "\n"


#: The per-token states table's rows: label, key in a length's checks, whether it is a size (shown as a share of the states).
MEMORY = (
    ("size of the states (all recurrent layers)", "states_bytes", False),
    ("peak memory of the read, fast path", "peak_rss_fast", True),
    ("peak memory of the read, routed", "peak_rss_routed", True),
    ("peak memory of the read, own strategy", "peak_rss_own", True),
    ("fast vs routed states, max abs diff / max abs state", "states_fast_vs_routed", None),
    ("fast vs routed `set_state_after(mid)` logits, max abs diff", "write_fast_vs_routed", None),
    ("logits of a trace reading every layer's states (fast path: one pass) vs the plain forward, max abs diff / max abs logit", "one_pass_logits_vs_plain", None),
    ("own strategy's states at the last token vs `state_output`, max abs diff", "own_last_vs_state_output", None),
)


def _family(name: str, family: dict, cell: Callable) -> list:
    """One family's section: its timed rows, its states' size and memory, generate, TransformerLens, its notes."""
    lengths = list(family["lengths"])
    lines = [f"## {NAMES.get(name, name)}", "", family.get("config", CONFIGS.get(name, "")) + "; random weights.", ""]
    if "elapsed_s" in family:
        lines += [f"Wall time of this family in the run: {family['elapsed_s'] / 60:.1f} min.", ""]
    header = ["| measurement | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    base = [family["lengths"][length]["rows"]["plain forward"] for length in lengths]
    lines += header + ["| plain forward (baseline), median ms | " + " | ".join(f"{row['median_s'] * 1e3:.0f}" for row in base) + " |"]
    names: list = []
    for length in lengths:
        names += [n for n in family["lengths"][length]["rows"] if n not in names and n != "plain forward"]
    for row_name in names:
        cells = []
        for length in lengths:
            data = family["lengths"][length]
            skipped = data.get("routed_skipped") and "routed" in row_name
            cells.append("skipped (quadratic)" if skipped else cell(data["rows"].get(row_name)))
        lines.append(f"| {row_name} | " + " | ".join(cells) + " |")
    tl = family.get("tl", {})
    if tl.get("lengths"):
        tl_cells = [cell(tl["lengths"].get(str(length), {}).get("total")) for length in lengths]
        mode = f", {tl['mode']}" if tl.get("mode") and tl.get("mode") != "default" else ""
        lines.append(f"| TransformerLens 4.3 `run_with_cache` + `compute_ssm_state()`{mode} (own process, vs its own HF forward) | " + " | ".join(tl_cells) + " |")
    lines += ["", "| per-token states | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for label, key, share in MEMORY:
        values = [family["lengths"][length]["checks"].get(key) for length in lengths]
        if all(value is None for value in values):
            continue
        sizes = [family["lengths"][length]["checks"].get("states_bytes") if share else None for length in lengths]
        shown = [_num(v) for v in values] if share is None else [_bytes(v, size) for v, size in zip(values, sizes)]
        lines.append(f"| {label} | " + " | ".join(shown) + " |")
    lines.append("")
    generated = family.get("generate")
    if generated:
        lines += [f"`generate` of 32 new tokens from a {generated['prompt']}-token prompt, as ratios to plain `generate`:", "",
                  "| measurement | ratio |", "|---|---:|"]
        for row_name, row in generated["rows"].items():
            extra = f" ({row['median_s'] * 1e3:.0f} ms)" if row_name == "generate, plain" else ""
            lines.append(f"| {row_name}{extra} | {cell(row)} |")
        lines.append("")
    lines += _transformer_lens(tl)
    notes = list(family.get("notes", [])) + [f"L={length} not run: {why}." for length, why in family.get("skipped", {}).items()]
    if notes:
        lines += ["Notes:", ""] + [f"* {note}" for note in notes] + [""]
    return lines


def _transformer_lens(tl: dict) -> list:
    """TransformerLens' check and notes; one line where it has no adapter, or no per-token state reading for the mixer."""
    if not tl.get("lengths") and tl.get("errors") and "adapter" in tl:
        error = tl["errors"][-1].removeprefix("every length: ")
        if tl["adapter"] is None:
            return [f"TransformerLens 4.3: no adapter for this architecture (`{error}`).", ""]
        return [f"TransformerLens 4.3 has an adapter (`{tl['adapter']}`) but no per-token state reading for this mixer "
                f"(`run_with_cache` + `compute_ssm_state()`: `{error}`).", ""]
    lines = []
    checked = {length: data.get("check") for length, data in tl.get("lengths", {}).items() if data.get("check") is not None}
    if checked:
        lines += ["TransformerLens' state at the last token against transformers' cached final state, max abs diff: "
                  + ", ".join(f"{value:.1e} (L={length})" for length, value in checked.items()) + ".", ""]
    if tl.get("errors"):
        lines += ["TransformerLens notes: " + "; ".join(f"`{e}`" for e in tl["errors"]), ""]
    return lines


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
