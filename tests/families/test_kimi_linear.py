"""Kimi-Linear: the delta-rule oracle suite (tests/suites/gated_deltanet.py) with Kimi's per-channel decay, and its layout."""

import torch
import transformers
import transformers.models.kimi_linear.modeling_kimi_linear as modeling

from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from tests.reference.recurrences import gated_delta_rule, kimi_delta_attention
from tests.suites.gated_deltanet import (
    PROMPT,
    GatedDeltaNetSuite,
    assert_kernel_arguments_reproduce_states,
    assert_layer_map_follows_the_config,
)


class TestKimiLinear(GatedDeltaNetSuite):
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

    def test_decays_are_one_per_key_channel_and_reproduce_the_states(self, routed):
        args = assert_kernel_arguments_reproduce_states(routed, 0, kimi_delta_attention)
        g, dims = args["g"], routed.layers[0].linear_attn.dims()
        assert g.shape[2:] == (dims["mixer_heads"], dims["key_dim"])
        assert (g.std(dim=-1) > 0).all(), "the channels of a head decay differently"
        # A scalar decay per head (the mean, or any channel) does not give Kimi's states.
        _, scalar = gated_delta_rule(args["q"], args["k"], args["v"], g.mean(-1), args["beta"])
        assert not torch.allclose(scalar, args["states"], atol=1e-3)

    def test_decays_write_back_change_the_model_as_the_kernel_says(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            g = mix.decays.save()
            baseline = model.next_token_probs.save()
        with torch.no_grad(), model.trace(PROMPT):
            mix.decays = torch.zeros_like(mix.decays)  # no forgetting at all
            probs = model.next_token_probs.save()
        assert g.shape[-1] == mix.dims()["key_dim"]
        assert not torch.allclose(probs, baseline, atol=1e-4)

    def test_the_hub_layer_list_makes_the_layer_map(self):
        from nnterp.testing import tiny_config

        config = tiny_config("kimi_linear").to_dict()
        config.pop("layer_types")
        config["linear_attn_config"] = {"full_attn_layers": [1, 3], "kda_layers": [2, 4]}  # 1-indexed, as on the hub
        made = transformers.KimiLinearConfig(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
        assert made.layer_types == ["full_attention", "linear_attention", "full_attention", "linear_attention"]
        assert_layer_map_follows_the_config("kimi_linear", made.layer_types)
