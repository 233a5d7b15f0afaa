"""Qwen3-Next: the gated-DeltaNet oracle suite (tests/components/test_gated_deltanet.py), and what the family adds."""

import transformers.models.qwen3_next.modeling_qwen3_next as modeling

from tests.components.test_gated_deltanet import GatedDeltaNetSuite, assert_layer_map_follows_the_config


class TestQwen3Next(GatedDeltaNetSuite):
    MODEL_TYPE = "qwen3_next"

    def test_mlp_is_the_sparse_block(self, model):
        for layer in model.layers:
            assert isinstance(layer.mlp._module, modeling.Qwen3NextSparseMoeBlock)

    def test_a_dense_layer_is_still_mlp(self):
        from nnterp.testing import tiny_config

        config = tiny_config("qwen3_next")
        assert config.mlp_only_layers == []
        assert_layer_map_follows_the_config("qwen3_next", list(config.layer_types))
