"""TransformerLens 4.3's ``compute_effective_attention`` on a saved model, with what its cache holds to check it.

Run by `benchmarks/compare_effective.py` with TransformerLens' interpreter (its
own venv; it imports neither nnterp nor the runner). It loads the folder (same
weights, same tokenizer), builds ``TransformerBridge.boot_transformers(folder,
hf_model=...)``, runs ``run_with_cache(ids, use_cache=False)`` and calls each
recurrent block's ``compute_effective_attention(cache, layer)``. Where that fails
on the default path (Mamba-1 and Mamba-2 on transformers 5.24: the conv1d and
dt_proj hooks never fire), it records the error, sets ``eager_scan = True`` on
every SSM mixer bridge and runs again. Per layer it saves, under the hook names
it read them from:

- ``matrix``: what ``compute_effective_attention(cache, layer)`` returns (its defaults);
- ``matrix_dt``: the same with ``include_dt_scaling=True`` (Mamba-1, Mamba-2: TL's reconstruction form);
- ``values``: TL's cache's values for that mixer (the gated DeltaNet's ``hook_v``,
  ``[batch, seq, heads, head_dim]``; Mamba-1's ``x = act(conv1d.hook_out)``,
  ``[batch, seq, channels]``; Mamba-2's per-head ``x`` from ``conv1d.hook_out``,
  ``[batch, seq, heads, head_dim]``);
- ``kernel_out``: the kernel's output as TL's cache holds it (``hook_recurrence_out``;
  Mamba-1's gated scan output ``out_proj.hook_in``; Mamba-2's pre-gate scan output
  ``inner_norm.hook_in``), in the values' layout;
- ``extra``: what completes TL's reconstruction form (Mamba-1: ``D`` and the gate
  ``act(z)``; Mamba-2: ``D``; gated DeltaNet: the cached ``q``, ``k``, ``beta``, ``log_decay``).

Writes ``{"version", "mode", "errors", "ids", "layers": {index: {...}}}`` with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a saved checkpoint folder (model + tokenizer)")
    parser.add_argument("--ids", type=int, nargs="+", required=True, help="the prompt's token ids")
    parser.add_argument("--out", required=True, help="the .pt file to write")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    import transformer_lens
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.generalized_components.ssm_protocol import find_ssm_mixer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor([args.ids])
    result = {"version": getattr(transformer_lens, "__version__", "4.3"), "mode": "default", "errors": [], "ids": args.ids, "layers": {}}
    try:
        bridge = TransformerBridge.boot_transformers(args.model, hf_model=model, tokenizer=tokenizer, device="cpu")
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        result["errors"].append(f"boot_transformers: {type(error).__name__}: {error}")
        torch.save(result, args.out)
        return
    mixers = {index: mixer for index, block in enumerate(bridge.blocks) if (mixer := find_ssm_mixer(block)) is not None}
    if not mixers:
        result["errors"].append("no block has an SSM mixer (compute_effective_attention)")
    failed = _layers(bridge, mixers, ids, result)
    eager = [m for m in bridge.modules() if hasattr(m, "eager_scan")]
    if failed and eager:
        for module in eager:
            module.eager_scan = True
        result["mode"] = "eager_scan"
        _layers(bridge, mixers, ids, result)
    torch.save(result, args.out)


def _layers(bridge, mixers, ids, result) -> bool:
    """Fill ``result["layers"]``; True where some layer's call failed (its error recorded)."""
    _, cache = bridge.run_with_cache(ids, use_cache=False)
    failed = False
    for index, mixer in mixers.items():
        try:
            result["layers"][index] = _layer(mixer, cache, index)
        except Exception as error:  # noqa: BLE001
            failed = True
            result["errors"].append(f"layer {index} ({result['mode']}): {type(error).__name__}: {str(error)[:300]}")
    return failed


def _layer(mixer, cache, index: int) -> dict:
    kind = type(mixer).__name__
    entry = {"bridge": kind, "matrix": mixer.compute_effective_attention(cache, index), "matrix_dt": None, "extra": {}}
    if "GatedDeltaNet" in kind:
        prefix = f"blocks.{index}.linear_attn"
        names = {n: f"{prefix}.hook_{n}" for n in ("v", "recurrence_out", "q", "k", "beta", "log_decay")}
        entry["values"] = cache[names["v"]].float()
        entry["kernel_out"] = cache[names["recurrence_out"]].float()
        entry["extra"] = {n: cache[names[n]].float() for n in ("q", "k", "beta", "log_decay")}
        entry["hooks"] = {"matrix": [names[n] for n in ("q", "k", "beta", "log_decay")], "values": names["v"], "kernel_out": names["recurrence_out"]}
        return entry
    prefix = f"blocks.{index}.mixer"
    oc = mixer.original_component
    entry["matrix_dt"] = mixer.compute_effective_attention(cache, index, include_dt_scaling=True)
    conv = cache[f"{prefix}.conv1d.hook_out"].float()
    if "SSM2" in kind:  # Mamba-2: x per head from the conv output, the scan's pre-gate output at the inner norm's input
        terms = mixer._ssd_terms(cache, index)
        entry["values"] = terms.x
        out = cache[f"{prefix}.inner_norm.hook_in"].float()
        entry["kernel_out"] = out.view(*terms.x.shape)
        entry["extra"] = {"D": oc.D.float()}
        entry["hooks"] = {"matrix": [f"{prefix}.in_proj.hook_out", f"{prefix}.conv1d.hook_out"], "values": f"{prefix}.conv1d.hook_out",
                          "kernel_out": f"{prefix}.inner_norm.hook_in"}
        return entry
    # Mamba-1: x = act(conv1d output), the gated scan output at out_proj's input, the gate act(z) from in_proj
    seq = cache[f"{prefix}.x_proj.hook_out"].shape[1]
    entry["values"] = oc.act(conv[..., :seq]).transpose(1, 2)
    entry["kernel_out"] = cache[f"{prefix}.out_proj.hook_in"].float()
    z = cache[f"{prefix}.in_proj.hook_out"].float().chunk(2, dim=-1)[1]
    entry["extra"] = {"D": oc.D.float(), "gate": oc.act(z)}
    entry["hooks"] = {"matrix": [f"{prefix}.x_proj.hook_out", f"{prefix}.dt_proj.hook_out"], "values": f"{prefix}.conv1d.hook_out",
                      "kernel_out": f"{prefix}.out_proj.hook_in", "gate": f"{prefix}.in_proj.hook_out"}
    return entry


if __name__ == "__main__":
    main()
