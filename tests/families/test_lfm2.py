"""LFM2: the gated short convolution suite (tests/components/test_short_convolution.py), and its tiny layout."""

from nnterp.testing import tiny_config
from tests.components.test_short_convolution import ShortConvolutionSuite


class TestLfm2(ShortConvolutionSuite):
    MODEL_TYPE = "lfm2"

    def test_the_tiny_blocks_are_the_released_models_first_blocks(self, model):
        (real,) = model.family.REAL_CHECKPOINTS.values()
        layout = list(tiny_config(self.MODEL_TYPE).layer_types)
        assert layout == real.sizes["layer_types"][: len(layout)] == ["conv", "conv", "full_attention", "conv"]
