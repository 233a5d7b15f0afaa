"""Zamba2: the state-space-duality oracle suite (tests/components/test_state_space.py), and what the family adds: the shared transformer block."""

import torch

from nnterp.components.attention import Attention
from nnterp.components.state_space import StateSpace
from tests.components.test_state_space import PROMPT, StateSpaceSuite


class TestZamba2(StateSpaceSuite):
    MODEL_TYPE = "zamba2"

    def hybrids(self, model) -> list[int]:
        return list(model._module.config.hybrid_layer_ids)

    def test_every_block_has_the_mixer_and_hybrids_the_shared_block(self, model):
        hf_layers = model._at(model.family.LAYERS)
        hybrids = self.hybrids(model)
        assert hybrids == [1, 3]
        for index, layer in enumerate(model.layers):
            block = hf_layers[index]._module
            if index in hybrids:
                assert layer.linear_attn._module is block.mamba_decoder.mamba
                assert (
                    isinstance(layer.self_attn, Attention)
                    and layer.self_attn._module is block.shared_transformer.self_attn
                )
                assert layer.mlp._module is block.shared_transformer.feed_forward
            else:
                assert layer.linear_attn._module is block.mamba
                assert layer.self_attn is None and layer.mlp is None
            assert isinstance(layer.linear_attn, StateSpace)

    def test_the_shared_block_has_the_same_weights_at_every_depth_but_its_own_module(self, model):
        first, second = (model.layers[index] for index in self.hybrids(model))
        attn, other = first.self_attn._module, second.self_attn._module
        assert attn is not other and first.self_attn is not second.self_attn, "one module per depth, each its own envoy"
        assert attn.q_proj.weight is other.q_proj.weight and attn.o_proj.weight is other.o_proj.weight
        assert first.mlp._module.down_proj.weight is second.mlp._module.down_proj.weight
        # The per-depth adapters are shared too; each depth selects its own slot.
        assert attn.linear_q_adapter_list[1][0].weight is other.linear_q_adapter_list[1][0].weight
        hf_layers = model._at(model.family.LAYERS)
        assert hf_layers[1]._module.linear.weight is not hf_layers[3]._module.linear.weight, (
            "the linear map is per depth"
        )

    def test_the_shared_attention_read_at_two_depths_gives_each_depths_value(self, model):
        first, second = (model.layers[index] for index in self.hybrids(model))
        with torch.no_grad(), model.trace(PROMPT):
            a = first.self_attn.attention_output.save()
            fa = first.mlp.output.save()
            b = second.self_attn.attention_output.save()
            fb = second.mlp.output.save()
        assert a.shape == b.shape == fa.shape
        assert not torch.allclose(a, b) and not torch.allclose(fa, fb)

    def test_writing_the_shared_attention_at_one_depth_leaves_the_others_output_its_own(self, model):
        first, second = (model.layers[index] for index in self.hybrids(model))
        with torch.no_grad(), model.trace(PROMPT):
            before = second.self_attn.attention_output.save()
        with torch.no_grad(), model.trace(PROMPT):
            first.self_attn.attention_output = torch.zeros_like(first.self_attn.attention_output)
            zeroed = first.self_attn.attention_output.save()
            after = second.self_attn.attention_output.save()
        assert torch.count_nonzero(zeroed) == 0
        assert torch.count_nonzero(after) == after.numel(), "the second depth computes its own output"
        assert not torch.allclose(after, before), (
            "the write at the first depth reaches the second through the residual stream"
        )

    def test_a_hybrid_block_adds_only_the_mixer_and_the_shared_block_feeds_its_input(self, model):
        index = self.hybrids(model)[0]
        layer = model.layers[index]
        block = model._at(model.family.LAYERS)[index]._module
        with torch.no_grad(), model.trace(PROMPT):
            embedded = model.embed_tokens.output.save()
            entering = layer.layer_input.save()
            attn_in = layer.self_attn.input.save()
            shared = layer.mlp.output.save()
            mixer_in = layer.linear_attn.input.save()
            mixed = layer.linear_attn.attention_output.save()
            leaving = layer.layer_output.save()
        shared_block = block.shared_transformer
        torch.testing.assert_close(attn_in, shared_block.input_layernorm(torch.cat([entering, embedded], dim=-1)))
        expected_mixer_in = block.mamba_decoder.input_layernorm(entering + block.linear(shared))
        torch.testing.assert_close(mixer_in, expected_mixer_in, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(leaving, entering + mixed, rtol=0, atol=0)
