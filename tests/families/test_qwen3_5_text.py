"""Qwen3.5: the gated-DeltaNet oracle suite (tests/suites/gated_deltanet.py); the DeltaNet's own tests are in tests/components/."""

from tests.suites.gated_deltanet import GatedDeltaNetSuite


class TestQwen3_5Text(GatedDeltaNetSuite):
    MODEL_TYPE = "qwen3_5_text"
