"""nnterp's exact `effective_attention` against TransformerLens 4.3's `compute_effective_attention`.

Usage (nnterp's venv, from the repository root)::

    PYTHONPATH=$PWD python benchmarks/compare_effective.py [--out table.md]

For each tiny checkpoint (`nnterp.testing.tiny_checkpoint`: gated DeltaNet,
Mamba-1, Mamba-2, Kimi), it runs `tl_effective.py` with TransformerLens'
interpreter (its own venv, `--tl`), on the same folder and the same token ids,
and reads nnterp's ``linear_attn.effective_attention``, ``attention_values`` and
the kernel call's output on the same prompt. Per layer and per form of TL's
matrix it reports:

- whether TL's call runs (and on which path: default, or with ``eager_scan``);
- TL's shape and nnterp's (both ``[batch, heads, seq, seq]``; Mamba-1 per
  channel, ``[batch, channels, seq, seq]``, on both sides, so compared entry by entry);
- ``‖A_TL − A_nnterp‖ / ‖A_nnterp‖`` (Frobenius), and ``‖A_TL‖ / ‖A_nnterp‖``;
- each one's reconstruction error ``‖Σ_s A[t, s] v_s − out‖ / ‖out‖``, each with
  its own values and kernel output (TL: its cache's values and kernel-output
  hook, named in `tl_effective.py`; nnterp: ``attention_values`` and the kernel
  call's output);
- the Spearman rank correlation of the last row (what the last token reads,
  over every earlier token), per head or channel, averaged.

TL's forms: what ``compute_effective_attention(cache, layer)`` returns; for
Mamba-1/Mamba-2 also ``include_dt_scaling=True`` (TL's documented
reconstruction form, without the skip ``D``) and that form completed by hand
with ``D`` on the diagonal (and Mamba-1's gate ``act(z_t)``, which nnterp's
pattern includes); for the gated DeltaNet also TL's formula on l2-normalized,
``key_dim^-1/2``-scaled q, k (what the kernel uses), which isolates the
delta rule's dropped key removal. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.state_space import StateSpace
from nnterp.families import families

#: The first family of each mixer TransformerLens has an effective attention for, from the registry (a model_type
#: list is kept in nnterp/families alone), with the DeltaNet's slow-decay copy beside it.
KINDS = {LinearAttention: "gated DeltaNet", SelectiveScan: "Mamba-1", StateSpace: "Mamba-2", KimiDeltaAttention: "Kimi (KDA)"}
FAMILIES = {}
for _family in (f for f in families() if f.MIXER in KINDS and KINDS[f.MIXER] not in FAMILIES.values()):
    FAMILIES[_family.NAME] = KINDS[_family.MIXER]
    if _family.MIXER is LinearAttention:
        FAMILIES[f"{_family.NAME}:slow"] = "gated DeltaNet, slow decay"
#: ``A_log`` of every gated DeltaNet layer in the ``:slow`` variant: exp(g) ≈ 0.9 per step instead of ≈ 0.02.
SLOW_A_LOG = -2.5
PROMPT = "The Eiffel Tower is in the city of"
TL_PYTHON = Path("~/.cache/nnterp-bench/tl-venv/bin/python").expanduser()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tl", default=str(TL_PYTHON), help="TransformerLens' interpreter (benchmarks/run.py makes its venv)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    rows, notes, version = [], [], "?"
    scratch = tempfile.TemporaryDirectory()
    for family in args.families:
        folder = _folder(family, scratch.name)
        tl, mine = _run_tl(args, folder), _run_nnterp(folder, args.prompt)
        version = tl.get("version", version)
        label = FAMILIES.get(family, family)
        if tl["ids"] != mine["ids"]:
            raise SystemExit(f"{family}: token ids differ")
        if not tl["layers"]:
            rows.append([label, "all", "compute_effective_attention", "no: " + _short(tl["errors"]), "", _shape(next(iter(mine["layers"].values()))["A"]), "", "", "", "", ""])
            continue
        if tl["errors"]:
            notes.append(f"{label}: default path failed ({_short(tl['errors'])}); rerun with eager_scan = True")
        for index, ours in mine["layers"].items():
            theirs = tl["layers"].get(index)
            if theirs is None:
                rows.append([label, str(index), "compute_effective_attention", "no", "", _shape(ours["A"]), "", "", "", "", ""])
                continue
            own = _recon(ours["A"], ours["v"], ours["out"])
            notes.append(
                f"{label} layer {index}: TL's cached values vs nnterp's attention_values, max |Δ| {_gap(theirs['values'], ours['v']):.1e}; "
                f"TL's kernel-output hook vs the kernel's output {_gap(theirs['kernel_out'], ours['out']):.1e}"
            )
            for form, matrix in _forms(theirs):
                rows.append([
                    label, str(index), form, f"yes ({tl['mode']})", _shape(matrix), _shape(ours["A"]),
                    f"{_rel(matrix, ours['A']):.2g}", f"{float(matrix.norm() / ours['A'].norm()):.2g}", f"{_recon(matrix, theirs['values'], theirs['kernel_out']):.2g}", f"{own:.1e}",
                    f"{_spearman_last(matrix, ours['A']):.2f}",
                ])
    head = ["family", "layer", "TL matrix", "TL runs", "TL shape", "nnterp shape", "‖TL − nnterp‖/‖nnterp‖", "‖TL‖/‖nnterp‖", "TL recon. error", "nnterp recon. error", "last-row Spearman"]
    lines = [
        f"TransformerLens {version}, prompt {args.prompt!r}, tiny checkpoints (nnterp.testing.tiny_checkpoint), float32, CPU.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *(f"- {note}" for note in notes),
    ]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)


def _folder(family: str, scratch: str) -> Path:
    """The tiny checkpoint; for ``<type>:slow``, a copy whose gated DeltaNet layers decay slowly.

    The tiny checkpoints' random ``A_log`` makes every DeltaNet layer forget
    about 98% of its state per token, so the pattern is nearly diagonal, where
    the delta rule's key removal has nothing to remove. The copy sets
    ``A_log = SLOW_A_LOG`` in every layer (same weights otherwise), so earlier
    tokens stay in the state as they do in a trained model.
    """
    from nnterp.testing import tiny_checkpoint

    name, _, variant = family.partition(":")
    folder = tiny_checkpoint(name)
    if not variant:
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    for key, parameter in model.state_dict().items():
        if key.endswith("linear_attn.A_log"):
            parameter.fill_(SLOW_A_LOG)
    copy = Path(scratch) / family.replace(":", "-")
    model.save_pretrained(copy)
    AutoTokenizer.from_pretrained(folder).save_pretrained(copy)
    return copy


def _run_tl(args, folder: Path) -> dict:
    ids = _ids(folder, args.prompt)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tl.pt"
        command = [args.tl, str(Path(__file__).with_name("tl_effective.py")), "--model", str(folder), "--out", str(out),
                   "--threads", str(args.threads), "--ids", *map(str, ids)]
        env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}  # TL's interpreter must not see nnterp
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"ids": ids, "layers": {}, "errors": [f"tl_effective exited {done.returncode}: " + " | ".join(tail)], "mode": "-"}
        return torch.load(out, weights_only=False)


def _ids(folder, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(prompt).input_ids


def _run_nnterp(folder: Path, prompt: str) -> dict:
    from nnterp import StandardizedTransformer

    model = StandardizedTransformer(str(folder), dispatch=True, device="cpu")
    mixers = [(i, layer.linear_attn) for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    saved = {}
    with model.trace(prompt):
        for index, mix in mixers:
            cls = type(mix)
            kernel = cls.KERNEL(mix)
            table = cls.RECURRENT_ARGUMENTS if kernel == cls.RECURRENT_KERNEL else cls.CHUNK_ARGUMENTS
            attention, values = mix.effective_attention.save(), mix.attention_values.save()  # arguments before the kernel's output
            output = getattr(mix.source, kernel).output
            output = output[0] if isinstance(output, tuple) else output
            saved[index] = {"A": attention, "v": values, "out": table["v" if "v" in table else "x"][1].read(output).save()}
    layers = {index: {name: value.float() for name, value in entry.items()} for index, entry in saved.items()}
    return {"ids": model.tokenizer(prompt).input_ids, "layers": layers}


def _forms(theirs: dict) -> list[tuple[str, torch.Tensor]]:
    """TL's matrix as returned, and the forms that separate what it leaves out."""
    forms = [("compute_effective_attention", theirs["matrix"])]
    extra = theirs["extra"]
    if theirs["matrix_dt"] is not None:
        dt = theirs["matrix_dt"]
        forms.append(("include_dt_scaling=True", dt))
        seq = dt.shape[-1]
        eye = torch.eye(seq)
        if "gate" in extra:  # Mamba-1: D[c] on the diagonal, times the gate act(z_t)[c] (rows)
            done = (dt + extra["D"][None, :, None, None] * eye) * extra["gate"].permute(0, 2, 1)[..., None]
            forms.append(("dt form + D·δ, × act(z_t) (by hand)", done))
        else:  # Mamba-2: D[h] on the diagonal (the scan output is before the gate)
            forms.append(("dt form + D·δ (by hand)", dt + extra["D"][None, :, None, None] * eye))
    elif "q" in extra:
        forms.append(("its formula on l2-normed, scaled q, k (by hand)", _gla(extra)))
    return forms


def _gla(extra: dict) -> torch.Tensor:
    """TL's gated-linear-attention formula with q, k as the kernel uses them (l2-normalized, q scaled by key_dim^-1/2)."""
    q, k, beta, g = extra["q"], extra["k"], extra["beta"], extra["log_decay"]
    heads = beta.shape[-1]
    q = q.repeat_interleave(heads // q.shape[2], 2)
    k = k.repeat_interleave(heads // k.shape[2], 2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    c = g.cumsum(1)
    decay = (c[:, :, None] - c[:, None, :]).permute(0, 3, 1, 2)  # [batch, heads, t, s]
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    return torch.einsum("bthd,bshd->bhts", q, k) * decay.masked_fill(~mask, float("-inf")).exp() * beta.permute(0, 2, 1)[:, :, None]


def _apply(attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if values.dim() == 3:  # Mamba-1: [batch, seq, channels], one pattern per channel
        return torch.einsum("bcts,bsc->btc", attention, values)
    return torch.einsum("bhts,bshd->bthd", attention, values)


def _recon(attention, values, out) -> float:
    return float((_apply(attention, values) - out).norm() / out.norm())


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm()) if a.shape == b.shape else float("nan")


def _gap(a, b) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("nan")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def _spearman_last(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman correlation of the last rows (over the tokens s), per batch row and head or channel, averaged."""
    x, y = _ranks(a[..., -1, :]), _ranks(b[..., -1, :])
    x, y = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
    return float(((x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))).mean())


def _shape(t: torch.Tensor) -> str:
    return "×".join(map(str, t.shape))


def _short(errors: list[str]) -> str:
    return "; ".join(e[:90] + ("…" if len(e) > 90 else "") for e in errors[:1])


if __name__ == "__main__":
    main()
