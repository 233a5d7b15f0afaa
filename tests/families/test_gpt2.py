"""GPT-2: attention-only, in its own layout (``transformer.h``, ``transformer.wte``, ``transformer.ln_f``; attention at the
block's ``attn``). Its blocks have ``self_attn`` and ``mlp`` bound to the HF modules and no recurrent mixer, and its logits
are plain transformers' (the contract suite runs the rest)."""

import torch

from tests.suites.plain import PlainTransformerSuite


class TestGPT2(PlainTransformerSuite):
    MODEL_TYPE = "gpt2"

    def test_standard_names_reach_gpt2s_layout(self, model):
        hf = model._module
        assert [layer._module for layer in model.layers] == list(hf.transformer.h)
        assert model.embed_tokens._module is hf.transformer.wte
        assert model.ln_final._module is hf.transformer.ln_f and model.lm_head._module is hf.lm_head
        attn = hf.transformer.h[0].attn
        hidden = hf.config.hidden_size
        assert model.layers[0].self_attn._module is attn
        assert attn.c_attn.weight.shape == (hidden, 3 * hidden), "queries, keys and values in one fused projection"

    def test_the_first_block_reads_token_plus_position_embeddings(self, model, ids):
        hf = model._module
        with torch.no_grad(), model.trace(ids):
            embedded = model.embed_tokens.output.save()
            entering = model.layers[0].layer_input.save()
        positions = hf.transformer.wpe.weight[: ids.shape[1]]
        torch.testing.assert_close(entering, embedded + positions, rtol=0, atol=1e-6)
