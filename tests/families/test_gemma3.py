"""Gemma 3 (composite): the hub's vision-language checkpoint, served as AutoModelForCausalLM loads it. Its text
blocks have ``self_attn`` and ``mlp`` bound to the HF modules under ``model.language_model``, its logits are plain
transformers' and the text model's (the contract suite runs the rest)."""

import torch
import transformers.models.gemma3.modeling_gemma3 as modeling

from tests.suites.plain import PlainTransformerSuite


class TestGemma3(PlainTransformerSuite):
    MODEL_TYPE = "gemma3"

    def test_the_composite_is_served_as_transformers_loads_it(self, model, plain):
        from nnterp.families import REGISTRY

        assert type(model._module) is modeling.Gemma3ForConditionalGeneration is type(plain)
        assert model.family is REGISTRY["gemma3"] and model.family.__base__ is REGISTRY["gemma3_text"]
        text = model._module.model.language_model
        assert [layer._module for layer in model.layers] == list(text.layers)
        assert model.embed_tokens._module is text.embed_tokens and model.ln_final._module is text.norm
        assert model.lm_head._module is model._module.lm_head

    def test_logits_equal_the_text_models(self, model, ids):
        # The composite's text stack under Gemma3ForCausalLM: the same logits on text-only input.
        config = model._module.config.get_text_config()
        text = modeling.Gemma3ForCausalLM(config).eval()
        text.model.load_state_dict(model._module.model.language_model.state_dict())
        text.lm_head.load_state_dict(model._module.lm_head.state_dict())
        with torch.no_grad():
            expected = text(ids).logits
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6, msg="logits")
