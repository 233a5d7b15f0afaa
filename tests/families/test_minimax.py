"""MiniMax: the lightning-attention oracle suite (tests/components/test_lightning_attention.py), and what the family adds."""

import torch
import transformers.models.minimax.modeling_minimax as modeling

from nnterp.components.lightning_attention import LightningAttention
from tests.components.test_lightning_attention import LightningAttentionSuite, lightning_layers


class TestMiniMax(LightningAttentionSuite):
    MODEL_TYPE = "minimax"

    def test_lightning_attention_under_self_attn_is_linear_attn(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            hf_mixer = hf_layers[index]._module.self_attn
            if isinstance(hf_mixer, modeling.MiniMaxLightningAttention):
                assert isinstance(layer.linear_attn, LightningAttention) and layer.self_attn is None
                assert layer.linear_attn._module is hf_mixer
            else:
                assert isinstance(hf_mixer, modeling.MiniMaxAttention) and layer.linear_attn is None
                assert layer.self_attn._module is hf_mixer

    def test_every_block_is_a_mixture_of_experts_and_the_residuals_are_scaled(self, model, ids):
        config = model._module.config
        assert config.linear_attn_alpha_factor != 1 and config.mlp_alpha_factor != 1
        layer = model.layers[lightning_layers(model)[0]]
        hf_block = layer._module
        with torch.no_grad(), model.trace(ids):
            entering = layer.layer_input.save()
            mixed = layer.linear_attn.attention_output.save()
            logits = layer.mlp.router_logits.save()
            mlp = layer.mlp.mlp_output.save()
            leaving = layer.layer_output.save()
        assert logits.shape[-1] == config.num_local_experts
        # The block adds to its *normalized* input, each term scaled (the residual semantics nnterp's layer values keep).
        with torch.no_grad():
            normed = hf_block.input_layernorm(entering)
            middle = hf_block.post_attention_layernorm(normed * config.linear_attn_alpha_factor + mixed * config.linear_attn_beta_factor)
            expected = middle * config.mlp_alpha_factor + mlp * config.mlp_beta_factor
        torch.testing.assert_close(leaving, expected, atol=1e-5, rtol=1e-5)
