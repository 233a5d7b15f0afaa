"""Bailing-Hybrid: the delta-rule oracle suite (tests/components/test_kimi_delta_attention.py) with Kimi's per-channel decay, its bounded gate and its layout."""

import torch
import transformers
import transformers.models.bailing_hybrid.modeling_bailing_hybrid as modeling
import transformers.models.kimi_linear.modeling_kimi_linear as kimi

from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.recurrent.labels import labels_for, source_of
from tests.components.test_gated_deltanet import assert_layer_map_follows_the_config
from tests.components.test_kimi_delta_attention import KimiDeltaAttentionSuite
from tests.suites.checkpoint import PROMPT


class TestBailingHybrid(KimiDeltaAttentionSuite):
    MODEL_TYPE = "bailing_hybrid"

    def test_delta_attention_under_self_attn_is_linear_attn(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            hf_mixer = hf_layers[index]._module.self_attn
            if isinstance(hf_mixer, modeling.BailingHybridDeltaAttention):
                assert type(layer.linear_attn) is KimiDeltaAttention and layer.self_attn is None
                assert layer.linear_attn._module is hf_mixer
            else:
                assert isinstance(hf_mixer, modeling.BailingHybridAttention)
                assert layer.linear_attn is None and layer.self_attn._module is hf_mixer

    def test_the_mixer_calls_kimis_kernels_found_as_on_kimi_linear(self):
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update"):
            assert source_of(getattr(modeling, name)) == source_of(getattr(kimi, name)), name
        ours = labels_for(KimiDeltaAttention, modeling.BailingHybridDeltaAttention)
        theirs = labels_for(KimiDeltaAttention, kimi.KimiLinearDeltaAttention)
        assert dict(ours.labels) == dict(theirs.labels)
        assert ours["CHUNK_KERNEL"].startswith("chunk_kimi_delta_attention_")
        assert ours["RECURRENT_KERNEL"].startswith("recurrent_kimi_delta_attention_")

    def test_mlp_is_the_sparse_block_or_the_dense_one_the_config_says(self, model):
        kinds = model._module.config.mlp_layer_types
        assert kinds == ["dense", "sparse", "sparse", "sparse"], "first_k_dense_replace=1"
        for layer, kind in zip(model.layers, kinds):
            expected = modeling.BailingHybridMoE if kind == "sparse" else modeling.BailingHybridMLP
            assert isinstance(layer.mlp._module, expected)

    def test_decays_are_the_bounded_gate(self, model):
        """With kda_safe_gate, g = lower_bound · sigmoid(exp(A_log) · (f + dt_bias)), in [lower_bound, 0]."""
        config = model._module.config
        mix = model.layers[0].linear_attn
        gate = mix._module.forget_gate
        assert config.kda_safe_gate and config.kda_lower_bound == -5.0
        with torch.no_grad(), model.trace(PROMPT):
            f = mix.forget_gate.f_proj.output.save()
        with torch.no_grad(), model.trace(PROMPT):
            g = mix.decays.save()
        shape = (*f.shape[:2], gate.num_heads, gate.head_dim)
        rate = gate.A_log.exp().view(1, 1, -1, 1)
        expected = config.kda_lower_bound * torch.sigmoid(rate * (f.view(shape) + gate.dt_bias.view(1, 1, *shape[2:])))
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
        assert ((g >= config.kda_lower_bound) & (g <= 0)).all()  # the sigmoid saturates in float32: closed bounds

    def test_the_group_size_makes_the_layer_map(self):
        from nnterp.testing import tiny_config

        config = tiny_config("bailing_hybrid").to_dict()
        for derived in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
            config.pop(derived)
        config.update(layer_group_size=2, head_dim=16)  # as on the hub: the group size, not a list
        made = transformers.BailingHybridConfig(**{k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
        assert made.layer_types == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
        assert_layer_map_follows_the_config("bailing_hybrid", made.layer_types)
