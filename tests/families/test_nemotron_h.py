"""Nemotron-H: the state-space-duality oracle suite (tests/components/test_state_space.py), and what the family adds."""

import pytest
import torch
import transformers.models.nemotron_h.modeling_nemotron_h as modeling

import nnterp
from nnterp.components.state_space import StateSpace
from tests.components.test_state_space import PROMPT, StateSpaceSuite, built

#: ``config.layers_block_type`` entry -> the HF class of the block's ``mixer``.
MIXERS = {
    "linear_attention": modeling.NemotronHMamba2Mixer,
    "full_attention": modeling.NemotronHAttention,
    "mlp": modeling.NemotronHMLP,
    "moe": modeling.NemotronHMoE,
}


class TestNemotronH(StateSpaceSuite):
    MODEL_TYPE = "nemotron_h"

    def test_each_block_has_the_one_part_its_block_type_says(self, model):
        kinds = model._module.config.layers_block_type
        assert kinds == ["linear_attention", "moe", "linear_attention", "full_attention", "mlp"]
        hf_layers = model._at(model.family.LAYERS)
        for index, (layer, kind) in enumerate(zip(model.layers, kinds)):
            (part, envoy), = layer.parts().items()
            assert part == model.family.BLOCK_TYPES[kind], f"layer {index}"
            assert envoy._module is hf_layers[index]._module.mixer and type(envoy._module) is MIXERS[kind], f"layer {index}"

    @pytest.mark.parametrize("pattern", ["*-ME", "E*M-M"])
    def test_block_layout_follows_the_config_pattern(self, pattern):
        model = built(self.MODEL_TYPE, layers_block_type=modeling.NemotronHConfig._pattern_to_list(pattern))
        config = model._module.config
        assert config.hybrid_override_pattern == pattern and len(model.layers) == len(pattern)
        assert [set(layer.parts()) for layer in model.layers] == model.family.layer_parts(config)
        letters = {"M": "linear_attn", "*": "self_attn", "-": "mlp", "E": "mlp"}
        assert [next(iter(layer.parts())) for layer in model.layers] == [letters[c] for c in pattern]
        assert all(isinstance(layer.linear_attn, StateSpace) for layer, c in zip(model.layers, pattern) if c == "M")
        with torch.no_grad(), model.trace(PROMPT):
            first = model.layers[pattern.index("M")].linear_attn.state_output.save()
        assert first.shape[1:] == (4, 16, 16)

    def test_groups_share_b_and_c_across_heads(self, model, mixers):
        mix = model.layers[mixers[0]].linear_attn
        assert mix.dims()["key_heads"] == 2 and mix.dims()["mixer_heads"] == 4
        with torch.no_grad(), model.trace(PROMPT):
            B = mix.attention_keys.save()
            x = mix.attention_values.save()
        assert B.shape[2] == 2 and x.shape[2] == 4

    def test_betas_on_a_prompt_follow_the_chunk_scans_lower_bound(self, checkpoint):
        """The bound is 0.001 on the released configs; here one that bites is set on the mixers of a fresh load."""
        model = nnterp.StandardizedTransformer(str(checkpoint(self.MODEL_TYPE)), dispatch=True, device="cpu")
        lower = 0.05
        for layer in model.layers:
            if layer.linear_attn is not None:
                layer.linear_attn._module.time_step_limit = (lower, float("inf"))
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            limit = mix.argument("dt_limit").save()
            raw = torch.nn.functional.softplus(mix.dt + mix.argument("dt_bias")).save()
            betas = mix.betas.save()
        assert tuple(limit) == (lower, float("inf")) and (raw < lower).any(), "the bound bites"
        assert torch.equal(betas, raw.clamp(min=lower))
