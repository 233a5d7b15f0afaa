"""TransformerLens 4.3's per-token states on a saved model, timed against that process's own HF forward.

Run by `benchmarks/run.py` with TransformerLens' interpreter (its own venv,
so its pins never touch nnterp's); it imports neither nnterp nor the runner.
It loads the folder the runner saved (same weights, same tokenizer), builds
``TransformerBridge.boot_transformers(folder, hf_model=<a copy>)``, and per
length times, interleaved with the plain HF forward, ``run_with_cache``
(``use_cache=False``, as TransformerLens documents for the gated DeltaNet)
and ``cache.compute_ssm_state()``. Where the default path fails (Mamba-1 and
Mamba-2 on transformers 5.24: ``conv1d.hook_out`` never fires), it records
the error and retries with ``eager_scan = True`` on every SSM mixer bridge;
where it fails at the first length with nothing else to try (an adapter whose
mixers ``compute_ssm_state`` does not cover), it records that once and stops.
``adapter`` names the architecture adapter (``None``: no adapter).
Prints one JSON object to the file given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--long-reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", required=True)
    parser.add_argument("--max-seconds", type=float, default=150.0, help="skip a length whose one call is projected (quadratically) to take longer")
    args = parser.parse_args()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import transformer_lens
    from timing import Method, interleave, summary
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(args.model).eval()
    copy = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    result = {"version": getattr(transformer_lens, "__version__", "4.3"), "lengths": {}, "errors": []}
    try:
        bridge = TransformerBridge.boot_transformers(args.model, hf_model=copy, tokenizer=tokenizer, device="cpu")
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        result["errors"].append(f"boot_transformers: {type(error).__name__}: {_short(str(error))}")
        result["adapter"] = None
        json.dump(result, open(args.json, "w"))
        return
    result["adapter"] = type(getattr(bridge, "adapter", None)).__name__
    result["mode"] = "default"
    import time

    last = None  # (length, seconds of one states() call)
    for length in args.lengths:
        if last is not None and last[1] * (length / last[0]) ** 2 > args.max_seconds:
            projected = last[1] * (length / last[0]) ** 2
            result["errors"].append(f"L={length} skipped: one call projected to take {projected:.0f}s (from {last[1]:.0f}s at L={last[0]}, assuming quadratic growth)")
            continue
        vocab = plain.config.vocab_size
        ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        ids = torch.where(ids == tokenizer.eos_token_id, (ids + 1) % vocab, ids)

        def states(ids=ids):
            _, cache = bridge.run_with_cache(ids, use_cache=False)
            return cache, cache.compute_ssm_state()

        began = time.perf_counter()
        try:
            cache, found = states()
        except Exception as error:  # noqa: BLE001
            result["errors"].append(f"L={length} {result['mode']}: {type(error).__name__}: {str(error)[:300]}")
            eager = [m for m in bridge.modules() if hasattr(m, "eager_scan")]
            if last is None and not eager:  # the first length fails with no other path to try: so would every length
                result["errors"][-1] = f"every length: {result['errors'][-1].split(': ', 1)[1]}"
                break
            if result["mode"] == "eager_scan" or not eager:
                continue
            for module in eager:
                module.eager_scan = True
            result["mode"] = "eager_scan"
            try:
                cache, found = states()
            except Exception as again:  # noqa: BLE001
                result["errors"].append(f"L={length} eager_scan: {type(again).__name__}: {str(again)[:300]}")
                continue
        last = (length, time.perf_counter() - began)
        check = _last_state_check(plain, ids, found)
        del cache, found
        base = Method("plain forward", lambda ids=ids: plain(ids))
        both = Method("TL run_with_cache + compute_ssm_state", states)
        reps = args.reps if length < max(args.lengths) else args.long_reps
        interleave([base, both], reps, log=lambda line: print(line, flush=True))
        result["lengths"][str(length)] = {"total": summary(both, base), "base_s": summary(base, base)["median_s"], "check": check}
    json.dump(result, open(args.json, "w"))


def _short(message: str) -> str:
    """An error message without the list of every architecture TransformerLens supports (hundreds of names)."""
    import re

    return re.sub(r"Available architectures: \[[^\]]*\]", lambda m: f"({m.group(0).count(',') + 1} architectures available)", message)


def _last_state_check(plain, ids, found) -> float:
    """max |TL state at the last token - HF's cached final state| over layers (nan where shapes do not line up)."""
    out = plain(ids, use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)
    worst = 0.0
    items = found.items() if isinstance(found, dict) else enumerate(found)
    for layer, states in items:
        final = cache.layers[int(layer)].recurrent_states[0]
        axis = next((a for a in range(1, states.dim()) if states.shape[a] == ids.shape[1] and states.dim() == final.dim() + 1), None)
        if axis is None:
            return float("nan")
        last = states.select(axis, ids.shape[1] - 1)
        if last.shape != final.shape:
            return float("nan")
        worst = max(worst, (last.float() - final.float()).abs().max().item())
    return worst


if __name__ == "__main__":
    main()
