"""`nnterp.circuits` on zamba2, whose hybrid blocks run a shared transformer block beside the residual stream:
``a = attention(norm([x, e]))``, ``m = mlp(norm(a))``, ``x' = x + mixer(norm(x + linear(m)))``, with ``e`` the
embeddings.

Oracle: plain torch hooks on the plain transformers model, written here from the definitions: a head's share,
the output projection's columns of the head applied to its slice of the projection's input; the shared MLP's
output, the hybrid block's ``linear`` output; a destination's input, its norm's input, where the shared
attention's is ``[x, e]``: the embeddings' difference enters both halves, a mixer head's the first.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable, circuits

MODEL = "zamba2"


def _outputs(plain, ids):
    """``({source: [batch, seq, hidden]}, logits)`` of a plain call, read with hooks."""
    found, hooks = {}, [plain.model.embed_tokens.register_forward_hook(lambda m, a, out: found.__setitem__("embed", out))]

    def heads(name, count):
        def hook(module, args):
            width = args[0].shape[-1] // count
            for h in range(count):
                columns = slice(h * width, (h + 1) * width)
                found[f"{name}.h{h}"] = args[0][..., columns] @ module.weight[:, columns].T
        return hook

    for index, block in enumerate(plain.model.layers):
        mamba = getattr(block, "mamba_decoder", block).mamba
        hooks.append(mamba.out_proj.register_forward_pre_hook(heads(f"m{index}", mamba.num_heads)))
        if hasattr(block, "shared_transformer"):
            attention = block.shared_transformer.self_attn
            hooks.append(attention.o_proj.register_forward_pre_hook(heads(f"a{index}", plain.config.num_attention_heads)))
            hooks.append(block.linear.register_forward_hook(lambda m, a, out, i=index: found.__setitem__(f"mlp{i}", out)))
    with torch.no_grad():
        logits = plain(ids).logits
    for hook in hooks:
        hook.remove()
    return found, logits


def _hooked(plain, clean, corrupt, edge):
    u, v = edge
    delta = _outputs(plain, corrupt)[0][u] - _outputs(plain, clean)[0][u]
    layers = plain.model.layers
    if v == "logits":
        norm = plain.model.final_layernorm
    elif v.startswith("a"):
        norm = layers[int(v[1:])].shared_transformer.input_layernorm
        delta = torch.cat([delta, delta if u == "embed" else torch.zeros_like(delta)], -1)  # [x, e]
    elif v.startswith("mlp"):
        norm = layers[int(v[3:])].shared_transformer.pre_ff_layernorm
    else:
        block = layers[int(v[1:])]
        norm = getattr(block, "mamba_decoder", block).input_layernorm
    hook = norm.register_forward_pre_hook(lambda m, args: (args[0] + delta,))
    with torch.no_grad():
        logits = plain(clean).logits
    hook.remove()
    return logits


def test_the_shared_block_reads_its_chain_and_one_edge_patches_as_the_plain_hooks(load, plains):
    model, plain = load(MODEL), plains(MODEL)
    graph = circuits.node_map(model)
    hybrid = next(i for i, block in enumerate(model.layers) if block.self_attn is not None)
    later = next(i for i in range(hybrid + 1, len(model.layers)) if model.layers[i].self_attn is None)
    stream = [u for u in graph.sources if u == "embed" or (u.startswith("m") and not u.startswith("mlp"))]
    sources = {v: [u for u, w in graph.edges if w == v] for v in graph.destinations}
    assert sources[f"a{hybrid}"] == [u for u in stream if graph.layers[u] < hybrid or u == "embed"]
    assert sources[f"mlp{hybrid}"] == [u for u in graph.sources if u.startswith(f"a{hybrid}.")]
    assert sources[f"m{hybrid}"] == sources[f"a{hybrid}"] + [f"mlp{hybrid}"]
    assert sources["logits"] == stream
    generator = torch.Generator().manual_seed(5)
    clean, corrupt = torch.randint(3, 200, (2, 7), generator=generator), torch.randint(3, 200, (2, 7), generator=generator)
    want_clean = _outputs(plain, clean)[1]
    edges = [
        ("embed", f"a{hybrid}"), ("m0.h1", f"a{hybrid}"), (f"a{hybrid}.h2", f"mlp{hybrid}"), (f"mlp{hybrid}", f"m{hybrid}"),
        ("embed", f"m{hybrid}"), (f"m{hybrid}.h0", f"m{later}"), (f"m{hybrid}.h3", "logits"),
    ]
    for edge in edges:
        got = circuits.patch_edges(model, clean, corrupt, [edge])
        torch.testing.assert_close(got, _hooked(plain, clean, corrupt, edge), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, want_clean, atol=1e-3), edge
    with pytest.raises(ValueError, match="not an edge"):
        graph.edge_mask([(f"a{hybrid}.h0", "logits")])  # the shared attention writes into its MLP alone


def test_eap_on_zamba2_is_the_derivative_of_the_one_edge_patch(load):
    from nnterp.circuits.patching import trace_nodes

    model = load(MODEL)
    graph = circuits.node_map(model)
    generator = torch.Generator().manual_seed(6)
    clean = torch.randint(3, 200, (2, 6), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 200, (2,), generator=generator)
    metric = circuits.logit_difference(5, 7)
    scores = circuits.edge_attribution(model, clean, corrupt, metric, progress=False).scores
    donor, epsilon = trace_nodes(model, graph, corrupt), 1e-3  # the mixers' curvature: ('embed', 'm0') is off by 14% at 1e-2

    def patched(weights):
        return float(trace_nodes(model, graph, clean, patch=weights, corrupt=donor, metric=metric, pairs=torch.arange(2)).values.mean())

    derivative = []
    for edge in graph.edges:
        weights = graph.weights([edge])
        up, down = patched({v: w * epsilon for v, w in weights.items()}), patched({v: -w * epsilon for v, w in weights.items()})
        derivative.append((up - down) / (2 * epsilon))
    torch.testing.assert_close(scores, torch.tensor(derivative), atol=1e-2, rtol=2e-2)
    assert scores.abs().max() > 1e-2
    assert "enable_attention_probs=True" in model.support()["circuits.positional"]  # sdpa forms no pattern
    with pytest.raises(Unavailable, match="enable_attention_probs"):
        circuits.edge_attribution(model, clean, corrupt, metric, positional=True, progress=False)


def test_a_shared_block_first_reads_the_embeddings_at_its_own_input(tmp_path, checkpoint):
    # The released models start with Mamba-2 blocks; a hybrid first block is read where it reads the stream, its input.
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from nnterp import StandardizedTransformer
    from nnterp.testing import tiny_config

    sizes = dict(tiny_config(MODEL).to_dict(), layers_block_type=["hybrid", "linear_attention"], num_hidden_layers=2)
    sizes.pop("hybrid_layer_ids", None)
    config = AutoConfig.for_model(**sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint(MODEL) / name, tmp_path / name)
    model = StandardizedTransformer(str(tmp_path), dispatch=True, device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.hybrid_layer_ids == [0] and circuits.node_map(model).destinations[:3] == ["a0", "mlp0", "m0"]
    generator = torch.Generator().manual_seed(7)
    clean, corrupt = torch.randint(3, 200, (2, 5), generator=generator), torch.randint(3, 200, (2, 5), generator=generator)
    for edge in [("embed", "a0"), ("embed", "m0"), ("embed", "m1"), ("mlp0", "m0"), ("m0.h2", "logits")]:
        got = circuits.patch_edges(model, clean, corrupt, [edge])
        torch.testing.assert_close(got, _hooked(plain, clean, corrupt, edge), atol=1e-4, rtol=1e-4)


def _terms(plain, ids, layer):
    """``(A [batch, heads, seq, seq], v [batch, seq, heads, dim])`` of the shared attention at ``layer``: the eager
    weights it returns, and its values, ``v_proj`` plus its depth's adapter, from its input (plain hooks)."""
    attention, seen = plain.model.layers[layer].shared_transformer.self_attn, {}

    def hook(module, args, kwargs, out):
        x = kwargs["hidden_states"]
        values = module.v_proj(x) + module.linear_v_adapter_list[module.layer_dic[kwargs["layer_idx"]]](x)
        seen["A"], seen["v"] = out[1], values.unflatten(-1, (-1, module.head_dim))

    handle = attention.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        plain(ids)
    handle.remove()
    return seen["A"], seen["v"]


def test_a_positional_edge_of_the_shared_attention_is_the_plain_models_term(eager_models, plains):
    # The term of head h, source s, at every target t: W_o,h (A[t, s] v_s), v with the depth's adapter.
    model, plain = eager_models(MODEL), plains(MODEL, attn_implementation="eager")
    layer = next(i for i, block in enumerate(model.layers) if block.self_attn is not None)
    generator = torch.Generator().manual_seed(8)
    clean = torch.randint(3, 200, (2, 6), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 1:3] = torch.randint(3, 200, (2, 2), generator=generator)
    (a_clean, v_clean), (a_corrupt, v_corrupt) = _terms(plain, clean, layer), _terms(plain, corrupt, layer)
    attention = plain.model.layers[layer].shared_transformer.self_attn
    weight = attention.o_proj.weight.unflatten(1, (-1, attention.head_dim))  # [hidden, heads, dim]
    for h, s in [(1, 2), (3, 1), (0, 4)]:
        delta = (a_corrupt[:, h, :, s, None] * v_corrupt[:, s, None, h] - a_clean[:, h, :, s, None] * v_clean[:, s, None, h]) @ weight[:, h].T
        norm = plain.model.layers[layer].shared_transformer.pre_ff_layernorm
        hook = norm.register_forward_pre_hook(lambda m, args, delta=delta: (args[0] + delta,))
        with torch.no_grad():
            want = plain(clean).logits
        hook.remove()
        got = circuits.patch_edges(model, clean, corrupt, [(f"a{layer}.h{h}", f"mlp{layer}", s)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, circuits.patch_edges(model, clean, corrupt, []), atol=1e-3)
