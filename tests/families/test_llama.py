"""Llama: the attention-only root family. Its blocks have ``self_attn`` and ``mlp`` and no recurrent mixer,
and its logits are plain transformers' (the contract suite, tests/test_contract.py, runs the rest on it)."""

from tests.suites.plain import PlainTransformerSuite


class TestLlama(PlainTransformerSuite):
    MODEL_TYPE = "llama"
