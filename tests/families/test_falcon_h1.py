"""Falcon-H1: the state-space-duality oracle suite (tests/components/test_state_space.py), and what the family adds."""

import torch

from nnterp.components.attention import Attention
from nnterp.components.state_space import StateSpace
from tests.components.test_state_space import PROMPT, StateSpaceSuite


class TestFalconH1(StateSpaceSuite):
    MODEL_TYPE = "falcon_h1"

    def test_every_block_has_both_mixers_in_parallel_and_the_mlp(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            block = hf_layers[index]._module
            assert isinstance(layer.linear_attn, StateSpace) and layer.linear_attn._module is block.mamba
            assert isinstance(layer.self_attn, Attention) and layer.self_attn._module is block.self_attn
            assert layer.mlp._module is block.feed_forward

    def test_the_block_sums_both_scaled_mixers_then_the_mlp(self, model):
        config = model._module.config
        first = model.layers[0]
        with torch.no_grad(), model.trace(PROMPT):
            embedded = model.embed_tokens.output.save()
            entering = first.layer_input.save()
            ssm = first.linear_attn.attention_output.save()
            attn_in = first.self_attn.input.save()
            attn = first.self_attn.attention_output.save()
            fed = first.mlp.output.save()
            leaving = first.layer_output.save()
            head = model.lm_head.output.save()
            logits = model.logits.save()
        torch.testing.assert_close(entering, embedded * config.embedding_multiplier)
        normed = first.input_layernorm._module(entering)
        torch.testing.assert_close(attn_in, normed * config.attention_in_multiplier)
        mixed = entering + ssm * config.ssm_out_multiplier + attn * config.attention_out_multiplier
        torch.testing.assert_close(leaving, mixed + fed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, head * config.lm_head_multiplier, rtol=0, atol=0)

    def test_kernel_arguments_are_after_the_input_multipliers(self, model):
        mix = model.layers[0].linear_attn
        module = mix._module
        config = model._module.config
        with torch.no_grad(), model.trace(PROMPT):
            normed = model.layers[0].linear_attn.input.save()
            dt = mix.dt.save()
        projected = module.in_proj(normed * config.ssm_in_multiplier) * module.mup_vector
        torch.testing.assert_close(dt, projected[..., -module.num_heads :], rtol=1e-5, atol=1e-6)
        assert config.ssm_multipliers[4] != 1 and config.ssm_in_multiplier != 1
