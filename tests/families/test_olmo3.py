"""OLMo 3: attention-only post-norm blocks, three sliding-window layers then a full one. Its blocks have ``self_attn``
and ``mlp`` bound to the HF modules and no recurrent mixer, and its logits are plain transformers' (the contract suite runs the rest)."""


from tests.suites.plain import PlainTransformerSuite


class TestOlmo3(PlainTransformerSuite):
    MODEL_TYPE = "olmo3"

    def test_the_prompt_is_longer_than_the_sliding_window(self, model, ids):
        # Otherwise the sliding-window layers would attend like full ones and the tests above could not tell.
        assert ids.shape[1] > model._module.config.sliding_window

    def test_three_sliding_layers_then_a_full_one(self, model):
        assert list(model._module.config.layer_types) == ["sliding_attention"] * 3 + ["full_attention"]
        assert len(model.layers) == 4
