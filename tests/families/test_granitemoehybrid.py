"""Granite-4.0 hybrids: the state-space-duality oracle suite (tests/components/test_state_space.py), and what the family adds."""

import pytest
import torch
import transformers.models.granitemoehybrid.modeling_granitemoehybrid as modeling

from tests.components.test_state_space import PROMPT, StateSpaceSuite, built


class TestGraniteMoeHybrid(StateSpaceSuite):
    MODEL_TYPE = "granitemoehybrid"

    def test_mlp_is_the_mixture_of_experts_beside_the_shared_mlp(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            block = hf_layers[index]._module
            assert type(layer.mlp._module) is modeling.GraniteMoeHybridMoE and layer.mlp._module is block.block_sparse_moe
            assert layer.shared_mlp._module is block.shared_mlp

    def test_a_dense_config_has_the_shared_mlp_as_mlp(self):
        model = built(self.MODEL_TYPE, num_local_experts=0)
        hf_layers = model._at(model.family.LAYERS)
        assert all(layer.mlp._module is hf_layers[i]._module.shared_mlp for i, layer in enumerate(model.layers))

    @pytest.mark.parametrize("kinds", [["full_attention", "linear_attention"] * 2, ["linear_attention"] * 4])
    def test_block_layout_follows_the_config(self, kinds):
        model = built(self.MODEL_TYPE, layer_types=kinds)
        expected = [{"self_attn" if kind == "full_attention" else "linear_attn", "mlp"} for kind in kinds]
        assert [set(layer.parts()) for layer in model.layers] == expected == model.family.layer_parts(model._module.config)

    def test_multipliers_apply_where_the_docstring_says(self, model):
        config = model._module.config
        first = model.layers[0]
        with torch.no_grad(), model.trace(PROMPT):
            embedded = model.embed_tokens.output.save()
            entering = first.layer_input.save()
            mixed = first.linear_attn.attention_output.save()
            fed = (first.mlp.output + first.shared_mlp.output).save()
            leaving = first.layer_output.save()
            head = model.lm_head.output.save()
            logits = model.logits.save()
        torch.testing.assert_close(entering, embedded * config.embedding_multiplier)
        r = config.residual_multiplier
        torch.testing.assert_close(leaving, entering + r * mixed + r * fed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, head / config.logits_scaling, rtol=0, atol=0)

    def test_logits_written_reach_the_output_as_logits(self, model):
        with torch.no_grad(), model.trace(PROMPT):
            model.logits = torch.zeros_like(model.logits)
            probs = model.next_token_probs.save()
            out = model.output.logits.save()
        assert torch.count_nonzero(out) == 0 and torch.allclose(probs, torch.full_like(probs, 1 / probs.shape[-1]))
