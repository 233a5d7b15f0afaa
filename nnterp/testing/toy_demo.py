"""``nnterp demo``'s default: the recipe on the trained toys, where the effects are real.

The toys (`nnterp.testing.toy_checkpoint`) learned multi-query associative
recall: ``k v k v ... k v`` then a queried key, answered with its value. The
demo shows, on the recurrent-only toy (two gated DeltaNet layers), the state
after every token, what the query's row of effective attention weighs, and
that swapping every layer's state and convolution window after the context for
a donor context's (same keys, other values) makes the model answer the
donor's value; on the hybrid (a gated DeltaNet layer, then an attention
layer), whether the same swap moves the answer or the attention layer carries
the recall, and what knocking that attention out at the query does. Rates are
over ``--samples`` fresh samples; every plot goes to ``--out``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

RECURRENT, HYBRID = "deltanet", "hybrid"
SEED = 7


def _rate(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got == want).float().mean())


def _bars(out: Path, filename: str, rates: dict, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.5, 1.3 * len(rates) + 1.5), 3.2), layout="constrained")
    ax = fig.add_subplot()
    names = list(rates)
    bars = ax.bar(range(len(names)), [rates[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("share of samples")
    ax.set_title(title, fontsize=10)
    fig.savefig(out / filename, dpi=90)
    print(f"  {out / filename}")


def _load(name: str, device: str) -> Any:
    from nnterp import StandardizedTransformer
    from nnterp.testing import toy_checkpoint, toy_manifest

    manifest = toy_manifest(name)
    model = StandardizedTransformer(str(toy_checkpoint(name)), dispatch=True, device=device)
    kinds = ["attention" if layer.self_attn is not None else "gated DeltaNet" for layer in model.layers]
    print(f"\n== toy {name!r}: {model.family.NAME}, layers {kinds}, {manifest['parameters']:,} parameters, trained "
          f"{manifest['steps']} steps on {manifest['task']} (held-out accuracy {manifest['eval']['accuracy']:.3f}) ==")
    return model


def _swaps(model: Any, samples: list, donors: list) -> dict:
    from nnterp.testing import recall

    clean, donor = recall.answer_ids(model, samples), recall.answer_ids(model, donors)
    found = {"clean answer": _rate(recall.answers(model, samples), clean)}
    for label, state, window in (("state + window", True, True), ("state alone", True, False), ("window alone", False, True)):
        found[label] = _rate(recall.swap_memory(model, samples, donors, state=state, window=window), donor)
    return found


def recurrent_toy(out: Path | None, n: int, device: str) -> dict:
    """The recurrent-only toy: one sample read closely, then the swap's rates over ``n`` samples."""
    from nnterp import plot
    from nnterp.sweep import per_token_states
    from nnterp.testing import recall, toy_task

    model = _load(RECURRENT, device)
    task = toy_task(RECURRENT)
    rng = random.Random(SEED)
    sample = task.sample(rng, n_pairs=6)
    donor = task.donor(rng, sample)
    tokens = sample.words
    print(f"prompt {sample.prompt!r}: the query {tokens[-1]!r} asks for pair {sample.queried} "
          f"({sample.pairs[sample.queried][0]} -> {sample.answer})")
    layers = recall.recurrent_layers(model)
    states, patterns = [], []
    with per_token_states(model), torch.no_grad(), model.trace(sample.prompt, use_cache=False):
        for i in layers:  # forward order
            patterns.append(model.layers[i].linear_attn.effective_attention.save())
            states.append(model.layers[i].linear_attn.states.save())
        probs = model.next_token_probs[0].save()
    top = int(probs.argmax())
    print(f"  next token: {model.tokenizer.decode(top)!r} p={float(probs[top]):.3f} (the answer is {sample.answer!r})")
    print("  the state after every token, ‖S‖ per layer:")
    for t, word in enumerate(tokens):
        print(f"    {t:2d} {word:>4}" + "".join(f"{float(s[0, t].norm()):8.2f}" for s in states))
    last = patterns[-1][0, :, -1].abs().sum(0)  # the query's row, summed over heads
    ranked = [int(i) for i in last.topk(3).indices]
    print(f"  layer {layers[-1]}'s effective attention, the query's row (|A| summed over heads): the top positions "
          + ", ".join(f"{p} ({tokens[p]!r}, {float(last[p]):.2f})" for p in ranked)
          + f"; the queried pair sits at {sample.key_positions[sample.queried]}, {sample.value_positions[sample.queried]}")
    print(f"  donor context {donor.prompt!r} (same keys, other values): its answer is {donor.answer!r}")
    one = recall.swap_memory(model, [sample], [donor])
    print(f"  every layer's state and window after token {len(tokens) - 2} swapped for the donor's: "
          f"the model answers {model.tokenizer.decode(int(one[0]))!r}")
    samples = list(task.samples(n, seed=SEED + 1))
    donors = [task.donor(rng, s) for s in samples]
    found = _swaps(model, samples, donors)
    print(f"  over {n} fresh samples: " + "; ".join(f"{k} {v:.2f}" for k, v in found.items())
          + " (the swaps: the share answering the donor's value)")
    if out is not None:
        figures = {
            "toy_state_norms.png": plot.state_norms(dict(zip(layers, states)), tokens,
                                                    title="Toy DeltaNet: state norm after each token"),
            "toy_effective_attention.png": plot.effective_attention(
                patterns[-1], tokens, title=f"Toy DeltaNet, layer {layers[-1]}: effective attention"),
        }
        for filename, figure in figures.items():
            figure.savefig(out / filename, dpi=80)
            print(f"  {out / filename}")
        _bars(out, "toy_swap.png", found, f"Toy DeltaNet: the context's memory swapped ({n} samples)")
    return found


def hybrid_toy(out: Path | None, n: int, device: str) -> dict:
    """The hybrid toy: the same swap, then its attention layer knocked out / patched at the query."""
    from nnterp.testing import recall, toy_task

    model = _load(HYBRID, device)
    task = toy_task(HYBRID)
    rng = random.Random(SEED)
    samples = list(task.samples(n, seed=SEED + 1))
    donors = [task.donor(rng, s) for s in samples]
    found = _swaps(model, samples, donors)
    attention = next(i for i, layer in enumerate(model.layers) if layer.self_attn is not None)
    clean, donor = recall.answer_ids(model, samples), recall.answer_ids(model, donors)
    found[f"attention {attention} zeroed"] = _rate(recall.knock_out_attention(model, samples, attention), clean)
    found[f"attention {attention} from donor"] = _rate(recall.knock_out_attention(model, samples, attention, donors),
                                                      donor)
    print(f"  over {n} fresh samples: " + "; ".join(f"{k} {v:.2f}" for k, v in found.items()))
    print("  (swaps and the donor's attention: the share answering the donor's value; zeroed: the share still right)")
    carried = "the attention layer" if found["state + window"] < 0.5 else "the recurrent state"
    print(f"  so on this hybrid the recall runs through {carried}")
    if out is not None:
        _bars(out, "toy_hybrid.png", found, f"Toy hybrid: where the recall runs ({n} samples)")
    return found


def run(out: str | Path | None, samples: int = 100, device: str = "cpu") -> dict:
    """Both parts; returns ``{toy: {measurement: rate}}``. ``out=None`` writes no plot."""
    folder = None
    if out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            print(f"plots skipped: {error}")
        else:
            folder = Path(out)
            folder.mkdir(parents=True, exist_ok=True)
            print(f"the plots go to {folder.resolve()} (--out)")
    return {RECURRENT: recurrent_toy(folder, samples, device), HYBRID: hybrid_toy(folder, samples, device)}
