"""Gemma 3 (text): attention-only sandwich-norm blocks, a sliding-window layer then a full one. Its blocks have
``self_attn`` and ``mlp`` bound to the HF modules and no recurrent mixer, its logits are plain transformers', and where
the embedding scale and the final logit softcapping apply relative to the standard values (the contract suite runs the rest)."""

import torch

from tests.suites.plain import PlainTransformerSuite


class TestGemma3Text(PlainTransformerSuite):
    MODEL_TYPE = "gemma3_text"

    def test_the_prompt_is_longer_than_the_sliding_window(self, model, ids):
        # Otherwise the sliding-window layers would attend like full ones and the tests above could not tell.
        assert ids.shape[1] > model._module.config.sliding_window

    def test_embed_tokens_output_is_already_scaled_and_enters_the_first_block(self, model, ids):
        hidden = model._module.config.hidden_size
        with torch.no_grad(), model.trace(ids):
            embedded = model.embed_tokens.output.save()
            entering = model.layers[0].layer_input.save()
        table = model.embed_tokens._module.weight
        torch.testing.assert_close(embedded, table[ids] * torch.tensor(hidden**0.5, dtype=table.dtype), rtol=0, atol=1e-6)
        torch.testing.assert_close(entering, embedded, rtol=0, atol=0)

    def test_logits_are_after_the_final_softcap_where_a_config_sets_one(self, checkpoint):
        # No released Gemma 3 sets final_logit_softcapping; where a config does, Gemma3ForCausalLM caps
        # after lm_head: model.logits (the model's output logits, as in nnterp 1.x) are after the cap,
        # lm_head's output before it, and project_on_vocab applies the cap.
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from nnterp import StandardizedTransformer
        from tests.suites.checkpoint import PROMPT

        path = checkpoint(self.MODEL_TYPE)
        config = AutoConfig.from_pretrained(path, final_logit_softcapping=2.0)
        hf = AutoModelForCausalLM.from_pretrained(path, config=config).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        capped = StandardizedTransformer(hf, tokenizer=tokenizer)
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf(ids).logits
        with torch.no_grad(), capped.trace(ids):
            last = capped.layers_output[capped.num_layers - 1].save()
            head = capped.lm_head.output.save()
            logits = capped.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
        assert not torch.allclose(head, expected, atol=1e-3)
        torch.testing.assert_close(2.0 * torch.tanh(head / 2.0), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(capped.project_on_vocab(last).detach(), expected, rtol=0, atol=1e-5)
