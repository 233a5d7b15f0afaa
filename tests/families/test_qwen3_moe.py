"""Qwen3-MoE: attention-only, as `qwen3`, with the whole sparse block as ``mlp`` (router and experts inside it);
its logits are plain transformers' (the contract suite runs the rest)."""

import torch
import transformers.models.qwen3_moe.modeling_qwen3_moe as modeling

from tests.suites.plain import PlainTransformerSuite


class TestQwen3Moe(PlainTransformerSuite):
    MODEL_TYPE = "qwen3_moe"

    def test_blocks_have_self_attn_and_the_sparse_block_as_mlp(self, model):
        hf_layers = model._at(model.family.LAYERS)
        assert model.family.MIXER is None
        for index, layer in enumerate(model.layers):
            hf_layer = hf_layers[index]._module
            assert isinstance(hf_layer, modeling.Qwen3MoeDecoderLayer), f"layer {index}"
            assert set(layer.parts()) == {"self_attn", "mlp"}, f"layer {index}"
            assert layer.self_attn._module is hf_layer.self_attn, f"layer {index}"
            assert layer.mlp._module is hf_layer.mlp, f"layer {index}"
            assert isinstance(hf_layer.mlp, modeling.Qwen3MoeSparseMoeBlock), f"layer {index}: every block sparse"
            assert layer.linear_attn is None, f"layer {index}"

    def test_mlp_is_router_and_experts_together(self, model, ids):
        # ``mlp``'s output is the whole sparse block's: the routed experts' weighted sum, not one expert's.
        with torch.no_grad(), model.trace(ids):
            entering = model.layers[0].mlp.input.save()
            out = model.layers[0].mlp.output.save()
        block = model._at(model.family.LAYERS)[0]._module.mlp
        assert out.shape == (*ids.shape, model._module.config.hidden_size)
        with torch.no_grad():
            torch.testing.assert_close(out, block(entering), rtol=0, atol=1e-6)
