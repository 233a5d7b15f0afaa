"""`PlainTransformerSuite`: what every attention-only family shares; a family's test file adds what differs.

Oracles: the plain transformers model's own module tree (each block's
attention and MLP are the HF block's children the family names) and its
logits on the same tiny checkpoint.
"""

from __future__ import annotations

import torch

from nnterp.components.attention import Attention

from .checkpoint import CheckpointFixtures


class PlainTransformerSuite(CheckpointFixtures):
    """Set ``MODEL_TYPE`` to an attention-only family."""

    def test_blocks_have_self_attn_and_mlp_and_no_linear_attn(self, model):
        family = model.family
        hf_layers = model._at(family.LAYERS)
        attention = tuple(cls for cls, component in family.COMPONENTS.items() if component is Attention)
        assert family.MIXER is None and attention
        for index, layer in enumerate(model.layers):
            hf_layer = hf_layers[index]._module
            assert isinstance(hf_layer, family.DECODER_LAYERS), f"layer {index}"
            assert set(layer.parts()) == {"self_attn", "mlp"}, f"layer {index}"
            assert isinstance(layer.self_attn._module, attention), f"layer {index}"
            assert any(child is layer.self_attn._module for child in hf_layer.children()), f"layer {index}: a child of the block"
            assert layer.mlp._module is getattr(hf_layer, family.LAYER.MLP), f"layer {index}"
            assert layer.linear_attn is None, f"layer {index}"

    def test_logits_equal_plain_transformers(self, model, plain, ids):
        with torch.no_grad():
            expected = plain(ids).logits
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6, msg="logits")
