"""How well `nnterp.circuits.edge_attribution` ranks the edges (issue 27): Spearman of each edge's score with
the effect of patching that edge alone, per kind, method and seed.

    python benchmarks/edge_ranking.py                       # every kind and variant, seeds 0-4, the three methods
    python benchmarks/edge_ranking.py --kinds llama xlstm --seeds 0 1 2 3 4 --steps 10

Mental model: a seed draws ``pairs`` clean prompts of ``seq`` random tokens and corrupts each at one token
(`ranking_task`); the metric is the clean top token's logit minus the corrupt top token's at the last position.
The oracle is the patch itself (`nnterp.circuits.patch_edges`, checked against plain transformers in
tests/circuits/test_patching.py): the metric's change, averaged over the pairs, when that one edge is patched.
A score is averaged over the pairs as well. tests/circuits/test_attribution.py asserts on the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("eap", "eap-ig", "eap-ig-activations")


def ranking_task(model: Any, seed: int, pairs: int = 4, seq: int = 8, at: slice = slice(5, 6)) -> tuple:
    """``(clean, corrupt, metric)``: ``pairs`` prompts of ``seq`` random tokens differing at tokens ``at``, and the
    logit difference between the clean and the corrupt top token at the last position."""
    from nnterp import circuits
    from nnterp.circuits.patching import trace_nodes

    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 200, (pairs, seq), generator=generator)
    corrupt = clean.clone()
    corrupt[:, at] = torch.randint(3, 200, corrupt[:, at].shape, generator=generator)
    ends = [trace_nodes(model, circuits.node_map(model), ids).logits[:, -1] for ids in (clean, corrupt)]
    good = ends[0].argmax(-1)
    bad = torch.where(ends[1].argmax(-1) == good, ends[1].topk(2).indices[:, 1], ends[1].argmax(-1))
    return clean, corrupt, circuits.logit_difference(good, bad)


def patch_effects(model: Any, clean: Any, corrupt: Any, metric: Any) -> torch.Tensor:
    """``[edges]``: the metric's change (mean over the pairs) when each edge of the graph alone is patched."""
    from nnterp import circuits

    rows = torch.arange(len(clean))
    base = float(metric(circuits.patch_edges(model, clean, corrupt, []), rows).mean())
    edges = circuits.node_map(model).edges
    return torch.tensor([float(metric(circuits.patch_edges(model, clean, corrupt, [e]), rows).mean()) - base for e in edges])


#: Variants of a tiny family (config fields set over its tiny config): Kimi's mixer with dense MLPs, no router.
VARIANTS = {"kimi_linear_dense": ("kimi_linear", {"mlp_layer_types": ["dense"] * 4})}


def load(name: str) -> Any:
    """The tiny random-weight model of a family, or of one of `VARIANTS`."""
    from nnterp import StandardizedTransformer
    from nnterp.testing import tiny_checkpoint

    family, changes = VARIANTS.get(name, (name, None))
    return StandardizedTransformer(str(tiny_checkpoint(family, changes=changes)), dispatch=True, device="cpu")


def correlations(model: Any, seed: int, methods: tuple = METHODS, steps: int = 10, **task: Any) -> dict:
    """``{method: Spearman}`` of one seed's task against the one-edge patch, ``"effects"``: that oracle ``[edges]``.

    Two diagnostics of how much an edge's effect depends on the rest of the run: ``"contexts"``, the Spearman of
    the patch's effect in the clean run with minus the effect of patching the same edge corrupt -> clean in the
    corrupt run (equal where the edges add up); ``"eap-ig~average"``, EAP-IG's Spearman with the mean of the two.
    """
    from nnterp import circuits
    from nnterp.attribution import rank_correlation

    clean, corrupt, metric = ranking_task(model, seed, **task)
    effects = patch_effects(model, clean, corrupt, metric)
    found: dict = {"effects": effects}
    for method in methods:
        scores = circuits.edge_attribution(model, clean, corrupt, metric, method=method, steps=steps, progress=False).scores
        found[method] = rank_correlation(scores, effects)
        if method == "eap-ig":
            restored = -patch_effects(model, corrupt, clean, metric)
            found["contexts"] = rank_correlation(effects, restored)
            found["eap-ig~average"] = rank_correlation(scores, (effects + restored) / 2)
    return found


def main() -> None:
    from nnterp.families import families

    by_kind = {family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="*", default=[families()[0].NAME, *sorted(by_kind.values()), *VARIANTS])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    columns = [*args.methods, *(("contexts", "eap-ig~average") if "eap-ig" in args.methods else ())]
    print(f"| family | edges | {' | '.join(columns)} |  (seeds {args.seeds}: mean [min] (each))")
    for name in args.kinds:
        model = load(name)
        runs = [correlations(model, seed, tuple(args.methods), args.steps, pairs=args.pairs) for seed in args.seeds]
        cells = []
        for column in columns:
            values = torch.tensor([run[column] for run in runs])
            cells.append(f"{values.mean():.2f} [{values.min():.2f}] ({' '.join(f'{v:.2f}' for v in values.tolist())})")
        print(f"| {name} | {len(runs[0]['effects'])} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
