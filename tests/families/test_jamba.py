"""Jamba: the Mamba-1 oracle suite (tests/components/test_selective_scan.py), and its layout: blocks and experts where the config says."""

import pytest
import torch
import transformers.models.jamba.modeling_jamba as modeling
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer
from nnterp.components.attention import Attention
from nnterp.components.selective_scan import SelectiveScan
from nnterp.testing import tiny_config, tiny_tokenizer
from tests.components.test_selective_scan import PROMPT, SelectiveScanSuite


def built(**overrides):
    config = tiny_config("jamba")
    for name, value in overrides.items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = AutoModelForCausalLM.from_config(config).eval()
    return StandardizedTransformer(module, tokenizer=tiny_tokenizer()), config


class TestJamba(SelectiveScanSuite):
    MODEL_TYPE = "jamba"

    def test_blocks_are_mamba_or_attention_as_the_config_places_them(self, model):
        config = model._module.config
        assert config.layers_block_type == ["mamba", "mamba", "mamba", "attention"]
        hf_layers = model._at(model.family.LAYERS)
        for index, (layer, kind) in enumerate(zip(model.layers, config.layers_block_type)):
            if kind == "mamba":
                assert isinstance(hf_layers[index]._module, modeling.JambaMambaDecoderLayer)
                assert type(layer.linear_attn) is SelectiveScan and layer.self_attn is None
                assert layer.linear_attn._module is hf_layers[index]._module.mamba
            else:
                assert isinstance(hf_layers[index]._module, modeling.JambaAttentionDecoderLayer)
                assert isinstance(layer.self_attn, Attention) and layer.linear_attn is None
                assert layer.self_attn._module is hf_layers[index]._module.self_attn
        assert [set(parts) for parts in model.family.layer_parts(config)] == [set(layer.parts()) for layer in model.layers]

    def test_mlp_is_the_whole_sparse_block_or_the_dense_one_the_config_says(self, model):
        config = model._module.config
        hf_layers = model._at(model.family.LAYERS)
        assert config.layers_num_experts == [1, 4, 1, 4]
        for index, (layer, experts) in enumerate(zip(model.layers, config.layers_num_experts)):
            expected = modeling.JambaSparseMoeBlock if experts > 1 else modeling.JambaMLP
            assert isinstance(layer.mlp._module, expected) and layer.mlp._module is hf_layers[index]._module.feed_forward

    def test_the_sparse_block_written_whole_changes_the_output(self, model):
        with torch.no_grad(), model.trace(PROMPT):
            out = model.layers[1].mlp.output.save()
            baseline = model.next_token_probs.save()
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].mlp.output = torch.zeros_like(model.layers[1].mlp.output)
            probs = model.next_token_probs.save()
        assert out.shape[-1] == model._module.config.hidden_size
        assert not torch.allclose(probs, baseline, atol=1e-4)

    @pytest.mark.parametrize(("period", "offset"), [(2, 0), (4, 1)])
    def test_the_block_layout_follows_the_period_and_offset(self, period, offset):
        model, config = built(attn_layer_period=period, attn_layer_offset=offset)
        for index, layer in enumerate(model.layers):
            attention = index % period == offset
            assert (layer.self_attn is not None) == attention and (layer.linear_attn is not None) == (not attention), index
        assert [set(parts) for parts in model.family.layer_parts(config)] == [set(layer.parts()) for layer in model.layers]

    def test_keys_and_queries_are_the_kernels_after_the_norms(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            normed_B, normed_C = mix.b_layernorm.output.save(), mix.c_layernorm.output.save()
        with torch.no_grad(), model.trace(PROMPT):
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
        assert torch.equal(B, normed_B) and torch.equal(C, normed_C)
