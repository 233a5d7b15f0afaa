"""Bamba: the state-space-duality oracle suite (tests/components/test_state_space.py), and what the family adds."""

import pytest
import transformers.models.bamba.modeling_bamba as modeling

from nnterp.components.attention import Attention
from nnterp.components.state_space import StateSpace
from tests.components.test_state_space import StateSpaceSuite, built


class TestBamba(StateSpaceSuite):
    MODEL_TYPE = "bamba"

    def test_each_block_has_its_mixer_and_the_mlp(self, model):
        hf_layers = model._at(model.family.LAYERS)
        assert model._module.config.layers_block_type == ["linear_attention"] * 2 + ["full_attention", "linear_attention"]
        for index, layer in enumerate(model.layers):
            block = hf_layers[index]._module
            assert layer.mlp._module is block.feed_forward, f"layer {index}"
            if index == 2:
                assert isinstance(layer.self_attn, Attention) and layer.self_attn._module is block.self_attn
                assert layer.linear_attn is None
            else:
                assert isinstance(layer.linear_attn, StateSpace) and layer.linear_attn._module is block.mamba
                assert type(block.mamba) is modeling.BambaMixer and layer.self_attn is None

    @pytest.mark.parametrize("indices", [[0, 3], []])
    def test_block_layout_follows_the_config(self, indices):
        model = built(self.MODEL_TYPE, attn_layer_indices=indices)
        config = model._module.config
        expected = [{"self_attn" if i in indices else "linear_attn", "mlp"} for i in range(4)]
        assert [set(layer.parts()) for layer in model.layers] == expected == model.family.layer_parts(config)
