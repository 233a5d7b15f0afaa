"""`nnterp.circuits.edge_attribution`: EAP and EAP-IG scores.

Oracles: the single-edge patch itself (`patch_edges`, checked against plain transformers in
test_patching.py): EAP is the derivative of the metric along that patch at zero (a central finite
difference of a patch scaled by ±ε), and each method's rank correlation with the full patch's effect is
measured over seeds (`benchmarks/edge_ranking.py`, the docs table), with the same edge patched back in the
corrupt run as the diagnostic of why EAP-IG misses 0.9; EAP-IG's scores out of the embeddings sum to the
metric's change along the path from corrupt to clean (completeness of integrated gradients, against two plain
forwards).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import edge_ranking
from nnterp import circuits
from nnterp.circuits.patching import trace_nodes
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.components.lightning_attention import LightningAttention
from nnterp.components.mlstm import MLSTM
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.short_convolution import ShortConvolution
from nnterp.components.state_space import StateSpace
from nnterp.components.wkv import WKV

from .kinds import BY_KIND, PLAIN

#: One family per mixer kind, plus a plain transformer: gated DeltaNet, Kimi, Mamba-1, Mamba-2, RWKV-4, mLSTM, RG-LRU, short convolution.
KINDS = [PLAIN, *sorted(BY_KIND.values())]
N = 4  # the prompt pairs of `_task`
SEEDS = range(5)
#: Families whose MLPs are mixtures of experts: a patched edge can switch the router, a step no gradient sees.
ROUTED = {BY_KIND[SelectiveScan], BY_KIND[KimiDeltaAttention], BY_KIND[LightningAttention]}
_APART = "edges whose patch moves the metric otherwise in the clean run than in the corrupt one"
#: ``{kind: (floor, why)}``: where EAP-IG's mean Spearman with the one-edge patch is under 0.9 (the docs table);
#: each floor is the measured mean less 0.1, rounded down to 0.05.
BELOW_BAR = {
    BY_KIND[SelectiveScan]: (0.65, f"a mixture of experts; {_APART}"),
    BY_KIND[KimiDeltaAttention]: (0.6, f"a mixture of experts; {_APART}"),
    "kimi_linear_dense": (0.75, f"{_APART}, into the MLPs"),
    BY_KIND[ShortConvolution]: (0.7, f"{_APART}, into the MLPs"),
    BY_KIND[LightningAttention]: (0.55, f"a mixture of experts; {_APART}"),
    BY_KIND[LinearAttention]: (0.75, f"{_APART}, into the MLPs"),
    BY_KIND[MLSTM]: (0.7, _APART),
}
#: Where EAP-IG-activations' mean is under 0.9: the mixtures of experts, and the short convolution's 0.89.
ACTIVATIONS_BELOW_BAR = {*ROUTED, BY_KIND[ShortConvolution]}


_task = edge_ranking.ranking_task  # N pairs of 8 tokens, the logit difference of the clean and corrupt top tokens


def _patched(model, graph, clean, donor, metric, weights) -> float:
    return float(trace_nodes(model, graph, clean, patch=weights, corrupt=donor, metric=metric, pairs=torch.arange(N)).values.mean())


@pytest.mark.parametrize("model_type", [*KINDS, "falcon_h1"])  # falcon_h1: a destination two parts read
def test_eap_is_the_derivative_of_the_one_edge_patch(model_type, load):
    model = load(model_type)
    clean, corrupt, metric = _task(model, 0)
    graph = circuits.node_map(model)
    scores = circuits.edge_attribution(model, clean, corrupt, metric, method="eap", progress=False).scores
    donor = trace_nodes(model, graph, corrupt)
    epsilon, derivative = 1e-2, []
    for edge in graph.edges:
        weights = graph.weights([edge])
        up = _patched(model, graph, clean, donor, metric, {v: w * epsilon for v, w in weights.items()})
        down = _patched(model, graph, clean, donor, metric, {v: -w * epsilon for v, w in weights.items()})
        derivative.append((up - down) / (2 * epsilon))
    derivative = torch.tensor(derivative)
    assert scores.abs().max() > 1e-2
    # A mixture of experts' router can switch within ±ε (a step the gradient does not see): compare where it did not.
    smooth = (scores - derivative).abs() < 0.5 * derivative.abs().max()
    assert smooth.float().mean() >= 0.95
    torch.testing.assert_close(scores[smooth], derivative[smooth], atol=2e-2 * float(derivative.abs().max()), rtol=2e-2)


@pytest.mark.parametrize("model_type", [*KINDS, "kimi_linear_dense"])
def test_scores_rank_the_edges_as_their_patches_do(model_type):
    """Measured, not tuned: each score against the full single-edge patch, Spearman averaged over `SEEDS`
    (`benchmarks/edge_ranking.py` prints the docs table from the same function). EAP-IG meets the issue's 0.9
    where `BELOW_BAR` does not list the kind; there its floor sits 0.1 under the measured mean."""
    model = edge_ranking.load(model_type)
    runs = [edge_ranking.correlations(model, seed) for seed in SEEDS]
    mean = {key: sum(run[key] for run in runs) / len(runs) for key in runs[0] if key != "effects"}
    print(model_type, {key: round(value, 2) for key, value in mean.items()})
    floor, _ = BELOW_BAR.get(model_type, (0.9, None))
    assert mean["eap-ig"] >= floor
    assert mean["eap-ig-activations"] >= (0.9 if model_type not in ACTIVATIONS_BELOW_BAR else 0.6)
    assert mean["eap"] >= 0.5
    # Why EAP-IG misses the bar: an edge's patch moves the metric differently in the clean run than in the corrupt
    # one. Against the mean of the two, EAP-IG ranks at 0.9 wherever no router switches.
    assert mean["contexts"] < 0.9 or model_type not in BELOW_BAR
    assert mean["eap-ig~average"] >= (0.9 if model_type not in ROUTED else 0.6)


@pytest.mark.parametrize("model_type", [PLAIN, BY_KIND[LinearAttention], BY_KIND[MLSTM]])
def test_eap_ig_activations_into_a_destination_sums_to_patching_all_its_edges(model_type, load):
    # Completeness of integrated gradients along one destination's input: its edges' scores sum to the effect of
    # patching every edge into it (the patch itself, `patch_edges`, checked against plain transformers).
    model = load(model_type)
    clean, corrupt, metric = _task(model, seed=5)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, method="eap-ig-activations", steps=24, progress=False)
    base = float(metric(circuits.patch_edges(model, clean, corrupt, []), torch.arange(N)).mean())
    checked = 0
    for v in graph.nodes.destinations:
        into = [edge for edge in graph.edges if edge[1] == v]
        effect = float(metric(circuits.patch_edges(model, clean, corrupt, into), torch.arange(N)).mean()) - base
        total = sum(graph.score(*edge) for edge in into)
        assert total == pytest.approx(effect, rel=0.05, abs=2e-2), v
        checked += abs(effect) > 0.1
    assert checked >= 2


# RWKV-4: its first block normalizes the embeddings (pre_ln), so the path is straight only where the "embed" source is.
@pytest.mark.parametrize("model_type", [PLAIN, BY_KIND[LinearAttention], BY_KIND[StateSpace], BY_KIND[WKV]])
def test_eap_ig_out_of_the_embeddings_sums_to_the_metrics_change(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt, metric = _task(model, seed=2, at=slice(None))
    steps = 64
    graph = circuits.edge_attribution(model, clean, corrupt, metric, method="eap-ig", steps=steps, progress=False)
    total = sum(score for (u, _), score in zip(graph.edges, graph.scores.tolist()) if u == "embed")
    with torch.no_grad():
        kwargs = circuits.patching.run_kwargs(model)
        change = float((metric(plain(corrupt, **kwargs).logits, torch.arange(N)) - metric(plain(clean, **kwargs).logits, torch.arange(N))).mean())
    assert abs(change) > 1.0
    # A left Riemann sum over `steps` points: within a few percent of the path integral.
    assert total == pytest.approx(change, rel=0.1)


def test_scores_are_averaged_over_pairs_and_batches_alike(load):
    model = load("qwen3_5_text")
    clean, corrupt, metric = _task(model, seed=3)
    whole = circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    batched = circuits.edge_attribution(model, clean, corrupt, metric, batch_size=3, progress=False)
    torch.testing.assert_close(whole.scores, batched.scores, atol=1e-4, rtol=1e-4)
    one = circuits.edge_attribution(model, clean[:1], corrupt[:1], metric, progress=False)
    assert not torch.allclose(one.scores, whole.scores, atol=1e-4)


def test_a_wrong_call_says_what_to_pass_and_leaves_the_model_as_it_was(load):
    from nnterp import ShapeError, Unavailable

    model = load("qwen3_5_text")
    clean, corrupt, metric = _task(model, seed=4)
    before = {name: p.detach().clone() for name, p in model._model.named_parameters()}
    with pytest.raises(ShapeError, match="one value per prompt"):
        circuits.edge_attribution(model, clean, corrupt, lambda logits, pairs: logits.sum(), progress=False)
    with pytest.raises(ValueError, match="method is one of"):
        circuits.edge_attribution(model, clean, corrupt, metric, method="ig", progress=False)
    with pytest.raises(ShapeError, match="pairs of prompts of one length"):
        circuits.edge_attribution(model, clean, corrupt[:, :-1], metric, progress=False)
    with torch.inference_mode(), pytest.raises(Unavailable, match="inference_mode"):
        circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    assert all(torch.equal(p, before[name]) for name, p in model._model.named_parameters())
    assert all(p.grad is None for p in model._model.parameters())
    torch.testing.assert_close(circuits.patch_edges(model, clean, corrupt, []), trace_nodes(model, circuits.node_map(model), clean).logits)
