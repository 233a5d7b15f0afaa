"""`nnterp.circuits` on MiniMax, whose blocks carry the normalized stream: ``x' = α · norm(x) + β · part(norm(x))``.

Oracle: plain torch hooks on the plain transformers model, written here from the definitions (`NodeMap.carries`):
what a source adds to a destination's input is its output (``β`` times a head's share, the output projection's
columns of the head applied to its slice of the projection's input; ``β`` times the MLP's output) times
``α · norm(x) / x`` of every block norm between them, with the factors of the same run; patching ``(u, v)`` has
``v``'s part read its norm (the HF module itself) of the clean input plus ``u``'s corrupt − clean addition, while
the stream the block carries on stays the clean one.
"""

from __future__ import annotations

import torch

from nnterp import circuits

MODEL = "minimax"


def _record(plain, ids):
    """``(norms, sources)``: ``[(input, output, alpha)]`` of every block norm in forward order, and each source's
    output ``{name: [batch, seq, hidden]}`` with the index of the first norm after it."""
    norms, sources, hooks = [], {}, []
    config = plain.config
    for index, block in enumerate(plain.model.layers):
        mixer = "m" if config.layer_types[index] == "linear_attention" else "a"
        for name, alpha in (("input_layernorm", block.attn_alpha_factor), ("post_attention_layernorm", block.mlp_alpha_factor)):
            hooks.append(getattr(block, name).register_forward_hook(lambda m, a, o, alpha=alpha: norms.append((a[0], o, alpha))))
        projection = block.self_attn.out_proj if mixer == "m" else block.self_attn.o_proj
        heads = config.num_attention_heads

        def heads_hook(module, args, index=index, mixer=mixer, beta=block.attn_beta_factor, heads=heads):
            x = args[0]
            width = x.shape[-1] // heads
            for h in range(heads):
                columns = slice(h * width, (h + 1) * width)
                sources[f"{mixer}{index}.h{h}"] = (beta * x[..., columns] @ module.weight[:, columns].T, len(norms))

        hooks.append(projection.register_forward_pre_hook(heads_hook))
        hooks.append(block.mlp.register_forward_hook(
            lambda m, a, o, index=index, beta=block.mlp_beta_factor: sources.__setitem__(f"mlp{index}", (beta * (o[0] if isinstance(o, tuple) else o), len(norms)))
        ))
    with torch.no_grad():
        logits = plain(ids).logits
    for hook in hooks:
        hook.remove()
    sources["embed"] = (norms[0][0], 0)
    return norms, sources, logits


def _reaching(norms, source, stop):
    """What ``source`` (its output, first norm after it) adds to the input of a reader after ``stop`` norms."""
    out, start = source
    for x, y, alpha in norms[start:stop]:
        out = out * alpha * y / x
    return out


def _hooked(plain, clean, corrupt, edge):
    clean_norms, clean_sources, _ = _record(plain, clean)
    corrupt_norms, corrupt_sources, _ = _record(plain, corrupt)
    u, v = edge
    layers = plain.model.layers
    if v == "logits":
        stop, module = 2 * len(layers), None
    else:
        layer = int(v.removeprefix("mlp")) if v.startswith("mlp") else int(v[1:])
        stop = 2 * layer + (1 if v.startswith("mlp") else 0)
        module = layers[layer].mlp if v.startswith("mlp") else layers[layer].self_attn
    delta = _reaching(corrupt_norms, corrupt_sources[u], stop) - _reaching(clean_norms, clean_sources[u], stop)
    if module is None:
        hook = plain.model.norm.register_forward_pre_hook(lambda m, args: (args[0] + delta,))
    else:
        norm = layers[layer].post_attention_layernorm if v.startswith("mlp") else layers[layer].input_layernorm
        reads = clean_norms[stop][0]  # the clean residual the part's norm reads

        def replace(m, args, kwargs):
            edited = norm(reads + delta)
            return ((edited, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": edited})

        hook = module.register_forward_pre_hook(replace, with_kwargs=True)
    with torch.no_grad():
        logits = plain(clean).logits
    hook.remove()
    return logits


def test_one_edge_patched_is_the_plain_models_hooked_patch(load, plains):
    model, plain = load(MODEL), plains(MODEL)
    generator = torch.Generator().manual_seed(2)
    clean, corrupt = torch.randint(3, 200, (2, 7), generator=generator), torch.randint(3, 200, (2, 7), generator=generator)
    _, _, want_clean = _record(plain, clean)
    graph = circuits.node_map(model)
    assert {"m0.h1", "a3.h2", "mlp1"} <= set(graph.sources) and graph.reads["logits"] == 2 * len(model.layers)
    edges = [("m0.h1", "mlp2"), ("m1.h2", "logits"), ("embed", "a3"), ("mlp0", "m2"), ("m2.h3", "a3"), ("a3.h0", "mlp3")]
    for edge in edges:
        got = circuits.patch_edges(model, clean, corrupt, [edge])
        torch.testing.assert_close(got, _hooked(plain, clean, corrupt, edge), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, want_clean, atol=1e-3), edge


def test_every_edge_mean_ablated_reads_the_mean_corrupt_stream(load, plains):
    # With every edge patched to its mean, each destination reads its corrupt input averaged over the corrupt
    # prompts: the mean of what the sources add *as they arrive* (each prompt's own norm factors), so the logits
    # are the final norm and unembedding of the mean corrupt final residual.
    model, plain = load(MODEL), plains(MODEL)
    generator = torch.Generator().manual_seed(5)
    clean, corrupt = torch.randint(3, 200, (2, 7), generator=generator), torch.randint(3, 200, (3, 7), generator=generator)
    seen = {}
    hook = plain.model.norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    with torch.no_grad():
        plain(corrupt)
        hook.remove()
        want = plain.lm_head(plain.model.norm(seen["x"].mean(0, keepdim=True)))
    got = circuits.patch_edges(model, clean, corrupt, circuits.node_map(model).edges, ablation="mean")
    torch.testing.assert_close(got, want.expand_as(got), atol=1e-4, rtol=1e-4)
