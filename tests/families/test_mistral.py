"""Mistral: attention-only, as `llama`, with a sliding window shorter than the prompt. Its blocks have ``self_attn`` and
``mlp`` bound to the HF modules and no recurrent mixer, and its logits are plain transformers' (the contract suite runs the rest)."""

import torch
import transformers.models.mistral.modeling_mistral as modeling

from tests.suites.checkpoint import CheckpointFixtures


class TestMistral(CheckpointFixtures):
    MODEL_TYPE = "mistral"

    def test_blocks_have_self_attn_and_mlp_and_no_linear_attn(self, model):
        hf_layers = model._at(model.family.LAYERS)
        assert model.family.MIXER is None
        for index, layer in enumerate(model.layers):
            hf_layer = hf_layers[index]._module
            assert isinstance(hf_layer, modeling.MistralDecoderLayer), f"layer {index}"
            assert set(layer.parts()) == {"self_attn", "mlp"}, f"layer {index}"
            assert layer.self_attn._module is hf_layer.self_attn and layer.mlp._module is hf_layer.mlp, f"layer {index}"
            assert isinstance(hf_layer.self_attn, modeling.MistralAttention) and isinstance(hf_layer.mlp, modeling.MistralMLP)
            assert layer.linear_attn is None, f"layer {index}"

    def test_logits_equal_plain_transformers(self, model, plain, ids):
        with torch.no_grad():
            expected = plain(ids).logits
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6, msg="logits")

    def test_the_prompt_is_longer_than_the_sliding_window(self, model, ids):
        # Otherwise the sliding-window layers would attend like full ones and the tests above could not tell.
        assert ids.shape[1] > model._module.config.sliding_window
