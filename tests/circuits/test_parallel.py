"""`nnterp.circuits` on falcon_h1, whose blocks run a Mamba-2 mixer and attention in parallel on one norm's output:
``x' = x + ssm_out · mixer(norm(x)) + attn_out · attention(attn_in · norm(x))``.

Oracle: plain torch hooks on the plain transformers model, written here from the definitions: one destination,
the input norm's input, shared by both parts; a head's output, its part's output multiplier times the output
projection's columns of the head applied to its slice of the projection's input.
"""

from __future__ import annotations

import torch

from nnterp import circuits

MODEL = "falcon_h1"


def _shares(plain, ids):
    """``{source: [batch, seq, hidden]}`` of every head of both parts, read with hooks on a plain call."""
    shares, hooks = {}, []
    for index, block in enumerate(plain.model.layers):
        for prefix, projection, heads, multiplier in (
            ("m", block.mamba.out_proj, block.mamba.num_heads, block.ssm_out_multiplier),
            ("a", block.self_attn.o_proj, plain.config.num_attention_heads, block.attn_out_multiplier),
        ):
            def hook(module, args, prefix=prefix, index=index, heads=heads, multiplier=multiplier):
                width = args[0].shape[-1] // heads
                for h in range(heads):
                    columns = slice(h * width, (h + 1) * width)
                    shares[f"{prefix}{index}.h{h}"] = multiplier * args[0][..., columns] @ module.weight[:, columns].T

            hooks.append(projection.register_forward_pre_hook(hook))
    with torch.no_grad():
        logits = plain(ids).logits
    for hook in hooks:
        hook.remove()
    return shares, logits


def _hooked(plain, clean, corrupt, edge):
    u, v = edge
    delta = _shares(plain, corrupt)[0][u] - _shares(plain, clean)[0][u]
    layers = plain.model.layers
    norm = plain.model.final_layernorm if v == "logits" else (
        layers[int(v[3:])].pre_ff_layernorm if v.startswith("mlp") else layers[int(v[1:])].input_layernorm
    )
    hook = norm.register_forward_pre_hook(lambda m, args: (args[0] + delta,))
    with torch.no_grad():
        logits = plain(clean).logits
    hook.remove()
    return logits


def test_both_parts_read_one_destination_and_one_edge_patches_as_the_plain_hooks(load, plains):
    model, plain = load(MODEL), plains(MODEL)
    graph = circuits.node_map(model)
    layers = len(model.layers)
    assert graph.destinations == [name for i in range(layers) for name in (f"m{i}", f"mlp{i}")] + ["logits"]
    assert graph.sources.index("m0.h0") < graph.sources.index("a0.h0") < graph.sources.index("mlp0")
    generator = torch.Generator().manual_seed(4)
    clean, corrupt = torch.randint(3, 200, (2, 7), generator=generator), torch.randint(3, 200, (2, 7), generator=generator)
    want_clean = _shares(plain, clean)[1]
    last = layers - 1
    edges = [("m0.h1", "mlp0"), ("a0.h2", "logits"), ("a0.h0", f"m{last}"), ("m0.h3", f"mlp{last}"), (f"a{last}.h1", "logits")]
    for edge in edges:
        got = circuits.patch_edges(model, clean, corrupt, [edge])
        torch.testing.assert_close(got, _hooked(plain, clean, corrupt, edge), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, want_clean, atol=1e-3), edge
