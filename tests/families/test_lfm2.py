"""LFM2: the gated short convolution suite (tests/suites/short_convolution.py)."""

from tests.suites.short_convolution import ShortConvolutionSuite


class TestLfm2(ShortConvolutionSuite):
    MODEL_TYPE = "lfm2"
