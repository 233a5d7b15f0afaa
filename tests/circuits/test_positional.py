"""Positional edges: a head's edge split by source position, and the same split patched.

Oracles: the head's own edge score (the positional edges of a head must sum to it: the pattern's and the
effective attention's decomposition is exact), the plain transformers forward (every positional edge patched is
the corrupt forward), and a positional edge patched against its per-source term computed here from the plain
model's attention weights and values.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable, circuits
from nnterp.circuits.positional import EXACT
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.components.lightning_attention import LightningAttention
from nnterp.components.mlstm import MLSTM
from nnterp.components.rg_lru import RGLRU
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.short_convolution import ShortConvolution
from nnterp.components.state_space import StateSpace
from nnterp.components.wkv import WKV
from nnterp.recurrent.no_cache import run_kwargs

from .kinds import BY_KIND, PLAIN

#: Attention (plain, and in the hybrids) and every recurrent kind with a positional split; Kimi's attention layers
#: are multi-head latent attention, with no v_proj: left out of its graph.
FAMILIES = [PLAIN, *(BY_KIND[kind] for kind in EXACT), "falcon_h1", "zamba2"]  # falcon_h1: two parts read one destination; zamba2: a shared block
NODES = {BY_KIND[KimiDeltaAttention]: ("mixer_heads", "mlp")}
N, SEQ = 2, 7


def _task(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 200, (N, SEQ), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 2:4] = torch.randint(3, 200, (N, 2), generator=generator)
    good, bad = torch.randint(3, 200, (N,), generator=generator), torch.randint(3, 200, (N,), generator=generator)
    return clean, corrupt, circuits.logit_difference(good, bad)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_positional_edges_of_a_head_sum_to_its_edge(model_type, method, eager_models):
    model = eager_models(model_type)
    clean, corrupt, metric = _task()
    nodes = NODES.get(model_type, circuits.NODE_KINDS[::2])
    whole = circuits.edge_attribution(model, clean, corrupt, metric, nodes=nodes, method=method, steps=3, progress=False)
    split = circuits.edge_attribution(model, clean, corrupt, metric, nodes=nodes, method=method, steps=3, positional=True, progress=False)
    assert len(split.edges) > len(whole.edges)
    sums: dict = {}
    for (u, v, s), score in zip(split.edges, split.scores.tolist()):
        sums[u, v] = sums.get((u, v), 0.0) + score
        assert s is None or 0 <= s < SEQ
    heads = circuits.node_map(model, nodes).heads_of()
    assert any(u in heads for u, _ in whole.edges)
    for edge, score in zip(whole.edges, whole.scores.tolist()):
        assert sums[edge] == pytest.approx(score, abs=1e-4 + 1e-4 * abs(score))
    assert sum(abs(score) for (u, v, s), score in zip(split.edges, split.scores.tolist()) if s is not None) > 1e-3


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_positional_edge_patched_is_the_corrupt_forward(model_type, eager_models, plains):
    model, plain = eager_models(model_type), plains(model_type)
    clean, corrupt, metric = _task(1)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, positional=True, progress=False, nodes=NODES.get(model_type, circuits.NODE_KINDS[::2]))
    with torch.no_grad():
        kwargs = run_kwargs(model)
        want_clean, want_corrupt = plain(clean, **kwargs).logits, plain(corrupt, **kwargs).logits
    full = circuits.faithfulness(model, graph.circuit(fraction=1.0), clean, corrupt, metric)
    empty = circuits.faithfulness(model, graph.circuit(k=0), clean, corrupt, metric)
    pairs = torch.arange(N)
    if model_type not in NODES:  # with a kind left out of the graph, the empty circuit keeps that kind clean
        assert empty.empty == pytest.approx(float(metric(want_corrupt, pairs).mean()), abs=1e-4)
    assert full.circuit == pytest.approx(float(metric(want_clean, pairs).mean()), abs=1e-4)
    assert full.recovered == pytest.approx(1.0) and empty.recovered == pytest.approx(0.0, abs=1e-6)


def test_one_positional_edge_is_the_plain_models_term(eager_models, plains):
    """Head 1 of llama's layer 0, source 3 -> logits: the term ``W_o,h (a[t, 3] v_3)`` of the corrupt run
    minus the clean run's, added to the final norm's input (plain torch hooks)."""
    model, plain = eager_models("llama"), plains("llama", attn_implementation="eager")
    clean, corrupt, _ = _task(2)
    attention = plain.model.layers[0].self_attn
    config = plain.config
    heads, width = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    group = heads // config.num_key_value_heads
    seen = {}
    hooks = [
        attention.register_forward_hook(lambda module, args, output: seen.__setitem__("weights", output[1])),
        attention.v_proj.register_forward_hook(lambda module, args, output: seen.__setitem__("v", output)),
    ]
    terms = []
    with torch.no_grad():
        for ids in (corrupt, clean):
            plain(ids, output_attentions=True)
            v = seen["v"].reshape(N, SEQ, -1, width)[:, :, 1 // group]  # head 1's key/value head
            a = seen["weights"][:, 1, :, 3]  # [batch, t]: weight of source 3
            w = attention.o_proj.weight[:, width : 2 * width]
            terms.append(a[..., None] * (v[:, 3] @ w.T)[:, None])
    for hook in hooks:
        hook.remove()
    delta = terms[0] - terms[1]
    hook = plain.model.norm.register_forward_pre_hook(lambda module, args: (args[0] + delta,))
    with torch.no_grad():
        want = plain(clean).logits
    hook.remove()
    nodes = circuits.node_map(model)
    graph = circuits.graph.Circuit(nodes, [("a0.h1", "logits", 3)], seq=SEQ)
    whole, positional = graph.patches(graph.edges)
    donor = circuits.patching.trace_nodes(model, nodes, corrupt, positional=True)
    got = circuits.patching.trace_nodes(model, nodes, clean, patch=whole, patch_terms=positional, corrupt=donor, positional=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type, kind", [(BY_KIND[ShortConvolution], "ShortConvolution")])
def test_a_kind_with_a_skip_term_or_no_heads_says_its_split_is_not_served(model_type, kind, load):
    clean, corrupt, metric = _task()
    with pytest.raises(Unavailable, match=f"{kind}.*not served"):
        circuits.edge_attribution(load(model_type), clean, corrupt, metric, positional=True, progress=False)


def test_attention_needs_eager_weights_for_positional_edges(load, eager_models):
    assert "enable_attention_probs" in circuits.support(load("llama"))["circuits.positional"]
    assert circuits.support(eager_models("llama"))["circuits.positional"] is None
    assert circuits.support(load(BY_KIND[StateSpace]))["circuits.positional"] is None
    assert "ShortConvolution" in circuits.support(load(BY_KIND[ShortConvolution]))["circuits.positional"]
    clean, corrupt, metric = _task()
    with pytest.raises(Unavailable, match="enable_attention_probs"):
        circuits.edge_attribution(load("llama"), clean, corrupt, metric, positional=True, progress=False)


def test_patch_edges_takes_positional_edges_as_the_plain_term_test_does(eager_models):
    """A head's positional edges over every source, patched together, are its whole edge patched."""
    model = eager_models("qwen3_5_text")
    clean, corrupt, _ = _task(3)
    whole = circuits.patch_edges(model, clean, corrupt, [("m0.h1", "logits")])
    split = circuits.patch_edges(model, clean, corrupt, [("m0.h1", "logits", s) for s in range(SEQ)])
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)
    some = circuits.patch_edges(model, clean, corrupt, [("m0.h1", "logits", 3)])
    assert not torch.allclose(some, whole, atol=1e-3)


#: Where each recurrent kind's kernel output (what its positional split distributes) is read, as a child of the HF
#: mixer module: the gated norm's input, or the output projection's (Mamba-1: skip and gate applied; RWKV-4: times
#: sigmoid(receptance)), or the RG-LRU module's output.
KERNEL_OUTPUT = {
    LinearAttention: "norm", LightningAttention: "norm", KimiDeltaAttention: "o_norm", StateSpace: "norm", SelectiveScan: "out_proj",
    MLSTM: "multihead_norm", RGLRU: "rg_lru", WKV: "output",
}


@pytest.mark.parametrize("kind", EXACT, ids=lambda kind: kind.__name__)
def test_the_split_distributes_the_kernels_own_output(kind, load):
    """``Σ_s A[t, s] v_s`` from nnterp's effective attention is the kernel output the HF modules compute in a plain
    call of the model (read with torch hooks, no trace), so the factor ``f`` is the gate and norm alone."""
    from nnterp.circuits.positional import read_core

    model = load(BY_KIND[kind])
    clean, _, _ = _task(4)
    layer = next(i for i, block in enumerate(model.layers) if isinstance(block.linear_attn, kind))
    mixer = model.layers[layer].linear_attn._module
    module, seen = mixer.get_submodule(KERNEL_OUTPUT[kind]), {}
    if kind is RGLRU:  # the RG-LRU module returns the scan's output
        hooks = [module.register_forward_hook(lambda m, args, out: seen.__setitem__("x", out.detach()))]
    else:
        hooks = [module.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].detach()))]
    if kind is WKV:  # the output projection reads sigmoid(receptance) ⊙ the kernel's output
        hooks.append(mixer.receptance.register_forward_hook(lambda m, args, out: seen.__setitem__("r", out.detach())))
    try:
        with torch.no_grad():
            model._model(clean, **run_kwargs(model))
    finally:
        for hook in hooks:
            hook.remove()
    if kind is WKV:
        seen["x"] = seen["x"] / torch.sigmoid(seen["r"])
    saved = []
    with torch.no_grad(), model.trace(clean, **run_kwargs(model)):
        pattern, values = read_core(model.layers[layer].linear_attn, "mixer")
        saved.append(torch.einsum("bhts,bshe->bthe", pattern.float(), values.float()).save())
    torch.testing.assert_close(saved[0].reshape(-1), seen["x"].float().reshape(-1), atol=1e-4, rtol=1e-4)
