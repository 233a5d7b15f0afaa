"""Qwen3.5-MoE: the gated-DeltaNet oracle suite (tests/components/test_gated_deltanet.py), and what the family adds."""

import torch
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling
from transformers import AutoConfig

from tests.components.test_gated_deltanet import PROMPT, GatedDeltaNetSuite


class TestQwen3_5Moe(GatedDeltaNetSuite):
    MODEL_TYPE = "qwen3_5_moe_text"

    def test_mlp_is_the_sparse_block(self, model):
        for layer in model.layers:
            assert isinstance(layer.mlp._module, modeling.Qwen3_5MoeSparseMoeBlock)

    def test_the_hub_composite_loads_as_the_same_text_model(self, load, checkpoint):
        composite, text = load("qwen3_5_moe"), load("qwen3_5_moe_text")
        assert composite.family is text.family
        assert AutoConfig.from_pretrained(checkpoint("qwen3_5_moe")).model_type == "qwen3_5_moe", "the composite"
        assert type(composite._module) is type(text._module) is modeling.Qwen3_5MoeForCausalLM
        with torch.no_grad(), composite.trace(PROMPT):
            state = composite.layers[0].linear_attn.state_output.save()
        assert state.shape[1:] == (4, 16, 8)
