"""Train the toy checkpoints that ship in ``nnterp/testing/toys/`` (the script is their source of truth).

    python scripts/train_toys.py                 # every toy, one after the other
    python scripts/train_toys.py deltanet hybrid # only these
    python scripts/train_toys.py --out DIR       # write elsewhere (default: nnterp/testing/toys)

Each toy is a transformers model class, randomly initialised from its config
class under a fixed seed, trained on CPU with at most 2 threads on a synthetic
task of `nnterp.testing.tasks` (the batches come from a seeded
``random.Random``, so a rerun is the same run), then evaluated on fresh
samples from another seed (the prompt ends at the query; accuracy = the
argmax of the last position is the answer). Each folder gets the model
(``save_pretrained``, safetensors), the word-level tokenizer and
``manifest.json``: config, seed, steps, accuracy, the first logged losses,
the wall time and the weights' sha256.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import transformers.models.mamba.modeling_mamba as mamba_modeling
from transformers import AutoModelForCausalLM, Mamba2Config, MambaConfig, Qwen3_5TextConfig

from nnterp.testing.tasks import TASKS, VOCAB, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "nnterp" / "testing" / "toys"
SEED = 0
# One thread: on a shared machine a second one mostly waits at barriers (2 at most, the budget this script is held to).
THREADS = 1
EVAL_SEED = 10_000
EVAL_SAMPLES = 1000
TARGET, BUDGET_SECONDS = 0.95, 15 * 60
CHECK_SEED, CHECK_SAMPLES, CHECK_EVERY, CHECK_TARGET = 20_000, 200, 100, 0.99
TOKENS = dict(vocab_size=len(VOCAB), eos_token_id=0, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def _qwen(layer_types: list[str]) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, max_position_embeddings=512, **TOKENS,
    )


#: name -> (config, task, training settings). ``pairs`` is the curriculum's final range of context pairs.
TOYS = {
    "deltanet": dict(config=lambda: _qwen(["linear_attention"] * 2), task="associative_recall",
                     steps=1500, batch=64, lr=3e-3),
    "hybrid": dict(config=lambda: _qwen(["linear_attention", "full_attention"]), task="associative_recall",
                   steps=1500, batch=64, lr=3e-3),
    "mamba2": dict(config=lambda: Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                                               n_groups=1, state_size=32, expand=2, conv_kernel=4, chunk_size=16,
                                               **TOKENS),
                   task="associative_recall", steps=1500, batch=64, lr=3e-3),
    # Hidden size 128: at 64 (state 16 or 32, with or without the A redraw, 1500 steps, or 2700 at batch 32) every run
    # stayed on the plateau of "a value of the context" (loss 1 to 2, about 10% held-out accuracy).
    "mamba": dict(config=lambda: MambaConfig(hidden_size=128, num_hidden_layers=2, state_size=16, expand=2,
                                             conv_kernel=4, use_mambapy=False, **TOKENS),
                  task="associative_recall", steps=1500, batch=64, lr=3e-3, kernel=lambda: mamba_scan_for_training()),
    "facts": dict(config=lambda: _qwen(["linear_attention"] * 2), task="planted_facts", steps=1500, batch=64, lr=3e-3),
}


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, **kwargs):
    """transformers' pure-torch Mamba-1 prompt kernel (``mamba_selective_scan``, the same arguments, channel-first
    ``[batch, channels, seq]``), computed as it computes it, one token at a time in the same order of operations,
    without its per-token indexing of ``[batch, channels, seq, state_size]`` tensors.

    That indexing is what makes transformers' body slow to train on a CPU (8 s for a step of 64 sequences of 63 tokens
    on this script's Mamba-1 toy, against 0.8 s here): the backward of each ``discrete_A[:, :, t]`` writes a gradient as large as the whole tensor, once
    per token. Here each token's decay and write are built from that token's slices of ``dt``, ``B`` and ``x``
    (``unbind``: one backward for all tokens), so the values are transformers' own (tests/test_toys.py checks the
    logits and the gradients against transformers' forward) and a step takes a fraction of a second.
    """
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    state = hidden_states.new_zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1])
    outputs = []
    for step, b, c, x in zip(dt.unbind(2), B.unbind(2), C.unbind(2), hidden_states.unbind(2)):
        state = torch.exp(A[None] * step[:, :, None]) * state + (step[:, :, None] * b[:, None, :].float()) * x[:, :, None].float()
        outputs.append(torch.matmul(state.to(input_dtype), c[:, :, None])[:, :, 0])
    out = torch.stack(outputs, -1)
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, state) if return_last_state else out


@contextlib.contextmanager
def mamba_scan_for_training():
    """Bind `selective_scan` as transformers' Mamba-1 prompt kernel (the module-level name ``MambaMixer.forward``
    calls, as its hub dispatcher binds a compiled one) while training; what was bound is put back on exit, so the
    held-out accuracy and every later use of the toy run transformers' own forward."""
    bound = mamba_modeling.mamba_selective_scan
    mamba_modeling.mamba_selective_scan = selective_scan
    try:
        yield
    finally:
        mamba_modeling.mamba_selective_scan = bound


def batch(task, rng: random.Random, size: int, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` sequences of one length (no padding) and their labels (-100 except at the answers).

    Curriculum: the context's pair count is drawn up to a bound that grows from 4
    to 16 over the first half of training.
    """
    top = min(16, 4 + int(12 * step / max(1, int(steps * 0.4))))
    n_pairs = rng.randint(4, top)
    ids, labels = [], []
    vocab = {w: i for i, w in enumerate(VOCAB)}
    for _ in range(size):
        words, targets = task.sequence(rng, n_pairs, n_pairs)
        row = [vocab[w] for w in words]
        label = [-100] * len(row)
        for t in targets:
            label[t] = row[t + 1]
        ids.append(row[:-1])
        labels.append(label[:-1])
    return torch.tensor(ids), torch.tensor(labels)


def build(name: str) -> torch.nn.Module:
    """The toy's model, randomly initialised from its config class under `SEED`.

    One init is redrawn: transformers draws a gated DeltaNet's decay rate ``A``
    from U(0.01, 16), so most heads keep ``exp(g)`` below 1e-4 of their state per
    token and recall over a 40-token context starts on a long plateau; here the
    per-token forgetting ``A * softplus(dt_bias)`` starts log-uniform in
    [0.002, 0.05] (a memory of 20 to 500 tokens), as Mamba's ``dt`` init does.
    Mamba-1's ``A`` (S4D-real, ``A[:, n] = -(n + 1)``) is redrawn the same way, per channel and
    state entry: at its init ``Δ``, state entries past the first few forget within a few tokens.
    """
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(TOYS[name]["config"]()).float()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                rate = torch.empty(module.A_log.shape).uniform_(math.log(0.002), math.log(0.05), generator=generator).exp()
                module.A_log.copy_((rate / torch.nn.functional.softplus(module.dt_bias.float())).log())
            elif type(module).__name__ == "MambaMixer":
                rate = torch.empty(module.A_log.shape).uniform_(math.log(0.002), math.log(0.05), generator=generator).exp()
                module.A_log.copy_((rate / torch.nn.functional.softplus(module.dt_proj.bias.float())[:, None]).log())
    return model


@torch.no_grad()
def accuracy(model: torch.nn.Module, task, n: int = EVAL_SAMPLES, seed: int = EVAL_SEED) -> float:
    """The share of fresh samples whose last position's argmax is the answer (plain transformers forward)."""
    model.eval()
    vocab = {w: i for i, w in enumerate(VOCAB)}
    right = 0
    for sample in task.samples(n, seed=seed):
        ids = torch.tensor([[vocab[w] for w in sample.words]])
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        right += int(int(logits.argmax()) == vocab[sample.answer])
    model.train()
    return right / n


def train(name: str, steps: int | None = None, log_every: int = 50, quiet: bool = False) -> tuple:
    """Train toy ``name`` from scratch; returns ``(model, losses, seconds)``, ``losses`` every step.

    A toy's ``kernel`` (the Mamba-1 toy's `mamba_scan_for_training`) is bound for the training only."""
    with TOYS[name].get("kernel", contextlib.nullcontext)():
        return _train(name, steps, log_every, quiet)


def _train(name: str, steps: int | None, log_every: int, quiet: bool) -> tuple:
    torch.set_num_threads(THREADS)
    spec = TOYS[name]
    total = spec["steps"]
    steps = total if steps is None else steps
    task = TASKS[spec["task"]]()
    model = build(name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))
    )
    rng = random.Random(SEED)
    losses, start = [], time.time()
    for step in range(steps):
        ids, labels = batch(task, rng, spec["batch"], step, total)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if not quiet and (step % log_every == 0 or step == steps - 1):
            print(f"{name} step {step:5d}  loss {losses[-1]:.4f}  {time.time() - start:6.1f}s", flush=True)
        # Early stop once the full range of pairs is reached and a check set (not the eval's seed) is solved.
        if step + 1 >= total // 2 and (step + 1) % CHECK_EVERY == 0 and steps == total:
            check = accuracy(model, task, n=CHECK_SAMPLES, seed=CHECK_SEED)
            if not quiet:
                print(f"{name} step {step:5d}  check accuracy {check:.3f}", flush=True)
            if check >= CHECK_TARGET:
                break
    return model.eval(), losses, time.time() - start


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(name: str, model: torch.nn.Module, losses: list, seconds: float, acc: float, out: Path) -> Path:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save_pretrained(folder)
    spec = TOYS[name]
    manifest = {
        "name": name,
        "task": spec["task"],
        "model_type": model.config.model_type,
        "config": model.config.to_dict(),
        "seed": SEED,
        "steps": len(losses),
        "max_steps": spec["steps"],
        "batch": spec["batch"],
        "lr": spec["lr"],
        "first_losses": losses[:5],
        "final_loss": losses[-1],
        "eval": {"seed": EVAL_SEED, "samples": EVAL_SAMPLES, "accuracy": acc},
        "train_seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sha256": {"model.safetensors": sha256(folder / "model.safetensors")},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("names", nargs="*", default=list(TOYS), help=f"toys to train (default: all of {', '.join(TOYS)})")
    args.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args.add_argument("--steps", type=int, default=None, help="stop after this many steps (calibration; not saved)")
    ns = args.parse_args(argv)
    failed = False
    for name in ns.names:
        if name not in TOYS:
            print(f"unknown toy {name!r}; known: {', '.join(TOYS)}", file=sys.stderr)
            return 2
        model, losses, seconds = train(name, ns.steps)
        acc = accuracy(model, TASKS[TOYS[name]["task"]]())
        print(f"{name}: {len(losses)} steps in {seconds:.0f}s, held-out accuracy {acc:.3f}", flush=True)
        if ns.steps is not None:
            continue
        if acc < TARGET or seconds > BUDGET_SECONDS:  # a toy that ships has learned its task within the budget
            print(f"  not saved: a toy ships at {TARGET:.0%} held-out accuracy or more, trained in {BUDGET_SECONDS}s or less",
                  file=sys.stderr)
            failed = True
            continue
        print(f"  saved {save(name, model, losses, seconds, acc, ns.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
