"""Qwen3.5: the gated-DeltaNet oracle suite (tests/components/test_gated_deltanet.py); the DeltaNet's own tests are in tests/components/."""

from tests.components.test_gated_deltanet import GatedDeltaNetSuite


class TestQwen3_5Text(GatedDeltaNetSuite):
    MODEL_TYPE = "qwen3_5_text"
