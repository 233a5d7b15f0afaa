"""Qwen3: attention-only, as `llama`. Its blocks have ``self_attn`` (with Qwen3's query/key norms) and ``mlp``
bound to the HF modules and no recurrent mixer, and its logits are plain transformers' (the contract suite runs the rest)."""

from tests.suites.plain import PlainTransformerSuite


class TestQwen3(PlainTransformerSuite):
    MODEL_TYPE = "qwen3"
