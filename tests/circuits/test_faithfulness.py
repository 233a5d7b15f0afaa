"""`nnterp.circuits.faithfulness` and its curve.

Oracles: plain transformers forwards (the full graph's run is the clean forward, the empty circuit's is the
corrupt forward), and the corrupt ablation itself (a mean over copies of one corrupt prompt is that prompt).
"""

from __future__ import annotations

import pytest
import torch

from nnterp import circuits
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.lightning_attention import LightningAttention
from nnterp.components.short_convolution import ShortConvolution
from nnterp.components.state_space import StateSpace
from nnterp.components.wkv import WKV
from nnterp.recurrent.no_cache import run_kwargs

from .kinds import BY_KIND, PLAIN

N, SEQ = 3, 7


def _task(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 200, (N, SEQ), generator=generator)
    corrupt = torch.randint(3, 200, (N, SEQ), generator=generator)
    good, bad = torch.randint(3, 200, (N,), generator=generator), torch.randint(3, 200, (N,), generator=generator)
    return clean, corrupt, circuits.logit_difference(good, bad)


@pytest.mark.parametrize("model_type", [PLAIN, *(BY_KIND[kind] for kind in (LinearAttention, LightningAttention, StateSpace, WKV, ShortConvolution))])
def test_the_full_graph_recovers_one_and_the_empty_circuit_zero(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt, metric = _task()
    graph = circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    full = circuits.faithfulness(model, graph.circuit(fraction=1.0), clean, corrupt, metric)
    empty = circuits.faithfulness(model, graph.circuit(k=0), clean, corrupt, metric)
    with torch.no_grad():
        kwargs = run_kwargs(model)
        pairs = torch.arange(N)
        want_clean = float(metric(plain(clean, **kwargs).logits, pairs).mean())
        want_corrupt = float(metric(plain(corrupt, **kwargs).logits, pairs).mean())
    assert full.clean == pytest.approx(want_clean, abs=1e-4) and full.circuit == pytest.approx(want_clean, abs=1e-4)
    assert empty.circuit == pytest.approx(want_corrupt, abs=1e-4) and empty.empty == pytest.approx(want_corrupt, abs=1e-4)
    assert full.recovered == pytest.approx(1.0, abs=1e-6) and empty.recovered == pytest.approx(0.0, abs=1e-5)
    for ablation in ("corrupt", "mean"):
        some = circuits.faithfulness(model, graph.circuit(fraction=0.3), clean, corrupt, metric, ablation=ablation)
        assert some.edges == round(0.3 * len(graph.edges)) and some.recovered == some.recovered  # a number
    curve = circuits.faithfulness_curve(model, graph, clean, corrupt, metric, fractions=(0.0, 0.5, 1.0), progress=False)
    assert curve.sizes == [0, round(0.5 * len(graph.edges)), len(graph.edges)]
    assert curve.recovered[0] == pytest.approx(0.0, abs=1e-5) and curve.recovered[-1] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", BY_KIND[LightningAttention]])
def test_a_mean_over_copies_of_one_corrupt_prompt_is_that_prompts_ablation(model_type, load):
    model = load(model_type)
    clean, corrupt, metric = _task(1)
    same = corrupt[:1].expand(N, SEQ)
    graph = circuits.edge_attribution(model, clean, same, metric, progress=False)
    circuit = graph.circuit(fraction=0.2)
    by_mean = circuits.faithfulness(model, circuit, clean, same, metric, ablation="mean")
    by_pair = circuits.faithfulness(model, circuit, clean, same, metric, ablation="corrupt")
    assert by_mean.circuit == pytest.approx(by_pair.circuit, abs=1e-4) and by_mean.empty == pytest.approx(by_pair.empty, abs=1e-4)
    other = circuits.faithfulness(model, circuit, clean, corrupt, metric, ablation="mean")
    assert other.empty != pytest.approx(by_mean.empty, abs=1e-3)


def test_the_graph_serializes_with_its_documented_schema(load):
    import json

    model = load("qwen3_5_text")
    clean, corrupt, metric = _task(2)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    data = json.loads(graph.dumps())
    assert set(data) == {"method", "clean", "corrupt", "nodes", "destinations", "positional", "edges"}
    kinds = {node["name"]: node["kind"] for node in data["nodes"]}
    assert kinds["embed"] == "embed" and kinds["m0.h0"] == "mixer_head" and kinds["a3.h0"] == "attention_head" and kinds["mlp0"] == "mlp"
    assert [d["name"] for d in data["destinations"]][-1] == "logits"
    assert [(e["source"], e["destination"]) for e in data["edges"]] == graph.edges
    assert [e["score"] for e in data["edges"]] == pytest.approx(graph.scores.tolist())
    top = graph.top(5)
    assert [abs(s) for *_, s in top] == sorted((abs(s) for s in graph.scores.tolist()), reverse=True)[:5]
    assert len(graph.top(fraction=0.1)) == round(0.1 * len(graph.edges))
    with pytest.raises(ValueError, match="one of k"):
        graph.top()


def test_the_graph_and_the_curve_plot_what_they_hold(load):
    model = load("qwen3_5_text")
    clean, corrupt, metric = _task(4)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    figure = graph.plot(k=7)
    ax = figure.axes[0]
    assert len(ax.lines) == 7  # one line per edge drawn
    widths = [line.get_linewidth() for line in ax.lines]
    assert max(widths) == pytest.approx(4.5)  # the strongest edge: 0.5 + 4
    labels = {text.get_text() for text in ax.texts}
    assert set(graph.nodes.sources) | set(graph.nodes.destinations) <= labels
    curve = circuits.faithfulness_curve(model, graph, clean, corrupt, metric, fractions=(0.0, 1.0), progress=False)
    line = curve.plot().axes[0].lines[0]
    assert list(line.get_ydata()) == pytest.approx(curve.recovered)
