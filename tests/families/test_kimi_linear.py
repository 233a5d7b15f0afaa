"""Kimi-Linear: the delta-rule oracle suite (tests/components/test_kimi_delta_attention.py) with Kimi's per-channel decay, and its layout."""

import transformers
import transformers.models.kimi_linear.modeling_kimi_linear as modeling

from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from tests.components.test_gated_deltanet import assert_layer_map_follows_the_config
from tests.components.test_kimi_delta_attention import KimiDeltaAttentionSuite


class TestKimiLinear(KimiDeltaAttentionSuite):
    MODEL_TYPE = "kimi_linear"

    def test_delta_attention_under_self_attn_is_linear_attn(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            hf_mixer = hf_layers[index]._module.self_attn
            if isinstance(hf_mixer, modeling.KimiLinearDeltaAttention):
                assert isinstance(layer.linear_attn, KimiDeltaAttention) and layer.self_attn is None
                assert layer.linear_attn._module is hf_mixer
            else:
                assert isinstance(hf_mixer, modeling.KimiLinearAttention)
                assert layer.linear_attn is None and layer.self_attn._module is hf_mixer

    def test_mlp_is_the_sparse_block_or_the_dense_one_the_config_says(self, model):
        for layer, kind in zip(model.layers, model._module.config.mlp_layer_types):
            expected = modeling.KimiLinearMoE if kind == "sparse" else modeling.KimiLinearMLP
            assert isinstance(layer.mlp._module, expected)

    def test_the_hub_layer_list_makes_the_layer_map(self):
        from nnterp.testing import tiny_config

        config = tiny_config("kimi_linear").to_dict()
        config.pop("layer_types")
        config["linear_attn_config"] = {"full_attn_layers": [1, 3], "kda_layers": [2, 4]}  # 1-indexed, as on the hub
        made = transformers.KimiLinearConfig(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
        assert made.layer_types == ["full_attention", "linear_attention", "full_attention", "linear_attention"]
        assert_layer_map_follows_the_config("kimi_linear", made.layer_types)
