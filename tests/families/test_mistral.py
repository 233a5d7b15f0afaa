"""Mistral: attention-only, as `llama`, with a sliding window shorter than the prompt. Its blocks have ``self_attn`` and
``mlp`` bound to the HF modules and no recurrent mixer, and its logits are plain transformers' (the contract suite runs the rest)."""


from tests.suites.plain import PlainTransformerSuite


class TestMistral(PlainTransformerSuite):
    MODEL_TYPE = "mistral"

    def test_the_prompt_is_longer_than_the_sliding_window(self, model, ids):
        # Otherwise the sliding-window layers would attend like full ones and the tests above could not tell.
        assert ids.shape[1] > model._module.config.sliding_window
