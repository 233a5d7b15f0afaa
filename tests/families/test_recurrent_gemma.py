"""RecurrentGemma: the RG-LRU suite (tests/components/test_rg_lru.py) on its two recurrent blocks, and its attention block."""

import torch

from tests.components.test_rg_lru import RGLRUSuite


class TestRecurrentGemma(RGLRUSuite):
    MODEL_TYPE = "recurrent_gemma"
    LAYERS = (0, 1)

    def test_blocks_follow_the_configs_order(self, model):
        kinds = ["linear_attn" if layer.linear_attn is not None else "self_attn" for layer in model.layers]
        assert kinds == ["linear_attn", "linear_attn", "self_attn"]
        assert all(layer.mlp is not None for layer in model.layers)

    def test_logits_are_soft_capped_after_the_unembedding(self, model, ids):
        cap = model._module.config.logits_soft_cap
        with torch.no_grad(), model.trace(ids):
            raw = model.lm_head.output.save()
            logits = model.logits.save()
        torch.testing.assert_close(logits, torch.tanh(raw / cap) * cap)
