"""Mamba: the Mamba-1 oracle suite (tests/components/test_selective_scan.py); the scan's own tests are in tests/components/."""

from tests.components.test_selective_scan import SelectiveScanSuite


class TestMamba(SelectiveScanSuite):
    MODEL_TYPE = "mamba"
