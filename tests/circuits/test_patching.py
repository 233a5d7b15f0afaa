"""`nnterp.circuits`: the node map and edge patching.

Oracles: a plain transformers forward (every edge patched must be the corrupt prompt's forward, no edge
patched the clean one's), and a single edge patched with torch hooks on the plain transformers model, written
here from the definitions (a head's share: the output projection's columns of the head applied to its slice
of the projection's input; the destination's input: its input norm's input).
"""

from __future__ import annotations

import re

import pytest
import torch

from nnterp import StandardizedTransformer, Unavailable, circuits
from nnterp.components.short_convolution import ShortConvolution
from nnterp.recurrent.no_cache import run_kwargs
from nnterp.testing import tiny_checkpoint

from .kinds import BY_KIND, PLAIN, SERVED


def _pairs(vocab: int, n: int = 2, seq: int = 7, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, min(vocab, 200), (n, seq), generator=generator)
    corrupt = torch.randint(3, min(vocab, 200), (n, seq), generator=generator)
    return clean, corrupt


@pytest.mark.parametrize("model_type", SERVED)
def test_every_edge_patched_is_the_corrupt_forward_and_none_the_clean_one(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt = _pairs(plain.config.get_text_config().vocab_size)
    graph = circuits.node_map(model)
    with torch.no_grad():
        kwargs = run_kwargs(model)
        want_clean, want_corrupt = plain(clean, **kwargs).logits, plain(corrupt, **kwargs).logits
    assert not torch.allclose(want_clean, want_corrupt, atol=1e-2)
    torch.testing.assert_close(circuits.patch_edges(model, clean, corrupt, []), want_clean, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(circuits.patch_edges(model, clean, corrupt, graph.edges), want_corrupt, atol=1e-4, rtol=1e-4)


def test_the_node_map_names_heads_parts_and_single_node_mixers(load):
    llama = circuits.node_map(load("llama"))
    heads = load("llama").config.num_attention_heads
    assert llama.sources == ["embed", *[f"a0.h{h}" for h in range(heads)], "mlp0", *[f"a1.h{h}" for h in range(heads)], "mlp1"]
    assert llama.destinations == ["a0", "mlp0", "a1", "mlp1", "logits"]
    assert llama.upstream == {"a0": 1, "mlp0": 1 + heads, "a1": 2 + heads, "mlp1": 2 + 2 * heads, "logits": 3 + 2 * heads}
    assert circuits.node_map(load("mamba")).sources == ["embed", "m0", "m1"]  # Mamba-1 has no heads
    whole = circuits.node_map(load("qwen3_5_text"), nodes=("attention", "mixers"))
    assert whole.sources == ["embed", "m0", "m1", "m2", "a3"] and "mlp0" not in whole.destinations
    rows = circuits.support(load("mamba"))
    assert rows["circuits.mixers"] is None and "no attention" in rows["circuits.attention_heads"] and "no heads" in rows["circuits.mixer_heads"]
    with pytest.raises(ValueError, match="not node kinds"):
        circuits.node_map(load("llama"), nodes=("heads",))
    with pytest.raises(ValueError, match="not an edge"):
        llama.edge_mask([("mlp1", "a0")])  # downstream of its destination


def _hooked(plain, clean, corrupt, source_layer, head, destination_norm):
    """Logits of ``clean`` with head ``head`` of ``source_layer``'s attention patched into the module
    ``destination_norm`` reads (plain torch hooks)."""
    attention = plain.model.layers[source_layer].self_attn
    seen = {}
    hook = attention.o_proj.register_forward_pre_hook(lambda module, args: seen.__setitem__("x", args[0].detach()))
    with torch.no_grad():
        plain(corrupt)
        corrupt_in = seen["x"]
        plain(clean)
        clean_in = seen["x"]
    hook.remove()
    width = corrupt_in.shape[-1] // plain.config.num_attention_heads
    columns = slice(head * width, (head + 1) * width)
    delta = (corrupt_in[..., columns] - clean_in[..., columns]) @ attention.o_proj.weight[:, columns].T
    hook = destination_norm.register_forward_pre_hook(lambda module, args: (args[0] + delta,))
    with torch.no_grad():
        logits = plain(clean).logits
    hook.remove()
    return logits


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_one_edge_patched_is_the_plain_models_hooked_patch(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt = _pairs(plain.config.get_text_config().vocab_size, seed=1)
    layer = next(i for i, block in enumerate(model.layers) if block.self_attn is not None)
    last = len(model.layers) - 1
    cases = [
        ((f"a{layer}.h1", "logits"), plain.model.norm),
        ((f"a{layer}.h0", f"mlp{layer}"), plain.model.layers[layer].post_attention_layernorm),
    ]
    if layer < last:
        cases.append(((f"a{layer}.h1", f"mlp{last}"), plain.model.layers[last].post_attention_layernorm))
    for edge, norm in cases:
        head = int(edge[0].split(".h")[1])
        want = _hooked(plain, clean, corrupt, layer, head, norm)
        got = circuits.patch_edges(model, clean, corrupt, [edge])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, circuits.patch_edges(model, clean, corrupt, []), atol=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_every_single_edge_and_a_set_of_edges_patch_as_the_plain_hook_oracle(model_type, load, plains):
    from .plain_hooks import PlainEdges

    model, plain = load(model_type), plains(model_type)
    oracle = PlainEdges(plain)
    clean, corrupt = _pairs(plain.config.get_text_config().vocab_size, seed=3)
    graph = circuits.node_map(model)
    assert graph.sources == oracle.sources() and graph.destinations == oracle.destinations()
    assert graph.edges == [(u, v) for v in oracle.destinations() for u in oracle.sources() if oracle.upstream(u, v)]

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 7]

    base = float(metric(circuits.patch_edges(model, clean, corrupt, [])).sum())
    ours = [float(metric(circuits.patch_edges(model, clean, corrupt, [edge])).sum()) - base for edge in graph.edges]
    theirs = oracle.edge_effects(clean, corrupt, metric, graph.edges)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=1e-4)
    assert max(abs(x) for x in theirs) > 1e-2
    # A set of edges: each patch is relative to the run (a part that read a patched input wrote a changed output).
    chosen = graph.edges[::3]
    patched: dict = {}
    for u, v in chosen:
        patched.setdefault(v, set()).add(u)
    with torch.no_grad():
        _, corrupt_outputs = oracle.outputs(corrupt)
        want = oracle.outputs(clean, patched, corrupt_outputs)[0]
    torch.testing.assert_close(circuits.patch_edges(model, clean, corrupt, chosen), want, atol=1e-4, rtol=1e-4)


#: Each node kind's row in ``model.support()``, and the sources of that kind in a node map built for it.
_SOURCES = {"attention_heads": r"a\d+\.h\d+$", "mixer_heads": r"m\d+\.h\d+$", "mixers": r"m\d+(\.h\d+)?$", "mlp": r"mlp\d+$"}


# one family per mixer kind, falcon_h1 (two parts read one destination) and zamba2 (a shared block beside the stream)
@pytest.mark.parametrize("model_type", [PLAIN, *dict.fromkeys(BY_KIND.values()), "falcon_h1", "zamba2"])
def test_model_support_lists_the_node_kinds_the_node_map_builds(model_type, load):
    # The oracle is the node map itself: a kind's row is None exactly where a map built for that kind has its
    # sources, and a refused family's rows carry the reason the map raises.
    model = load(model_type)
    table = model.support()
    rows = {key: value for key, value in table.items() if key.startswith("circuits.")}
    assert set(rows) == {f"circuits.{kind}" for kind in ("embed", "logits", "positional", *_SOURCES)}
    assert rows["circuits.embed"] is None and rows["circuits.logits"] is None
    for kind, pattern in _SOURCES.items():
        has = any(re.match(pattern, name) for name in circuits.node_map(model, nodes=(kind,)).sources)
        assert (rows[f"circuits.{kind}"] is None) == has, (kind, rows[f"circuits.{kind}"])


def test_model_support_says_when_edges_split_by_position(load):
    def eager(model_type):
        return StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device="cpu", enable_attention_probs=True)

    # Plain: sdpa attention forms no pattern; eager does. Recurrent-only: the selective scan splits.
    assert "enable_attention_probs=True" in load(PLAIN).support()["circuits.positional"]
    assert eager(PLAIN).support()["circuits.positional"] is None
    assert load("mamba").support()["circuits.positional"] is None
    hybrid = eager("qwen3_5_text")
    assert hybrid.support()["circuits.positional"] is None
    graph = circuits.edge_attribution(hybrid, *_pairs(200, n=1, seq=4), _last, positional=True, progress=False)
    assert graph.seq == 4 and len(graph.edges[0]) == 3  # (source, destination, position)
    assert "ShortConvolution" in load(BY_KIND[ShortConvolution]).support()["circuits.positional"]
    with pytest.raises(Unavailable, match="ShortConvolution"):
        model = load(BY_KIND[ShortConvolution])
        circuits.edge_attribution(model, *_pairs(200, n=1, seq=4), _last, positional=True, progress=False)


def _last(logits, pairs):
    return logits[:, -1, 0]
