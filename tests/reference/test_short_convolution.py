"""The reference gated short convolution (``short_convolution.py``) against transformers' ``Lfm2ShortConv``.

A random module, a fresh prompt and a continuation of its cache: the reference's
output (through the module's ``out_proj``) is the module's, and its last window
is the one transformers caches.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from tests.reference import hf_oracles as hf
from tests.reference.short_convolution import gated_short_convolution


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def module(request):
    torch.manual_seed(0)
    config = Lfm2Config(hidden_size=16, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3, conv_bias=request.param)
    conv = Lfm2ShortConv(config, 0).eval()
    return config, conv


def reference(conv, hidden, window=None):
    B, C, x = conv.in_proj(hidden).chunk(3, dim=-1)
    bias = conv.conv.bias
    y, windows = gated_short_convolution(B, C, x, conv.conv.weight.squeeze(1), bias, window)
    return conv.out_proj(y), windows


@torch.no_grad()
def test_reproduces_the_module_and_its_cache(module):
    config, conv = module
    hidden = torch.randn(2, 7, 16)
    cache = DynamicCache(config=config)
    expected = conv(hidden, **{hf.cache_kwarg(conv): cache})
    got, windows = reference(conv, hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(windows[:, -1], cache.layers[0].conv_states[0], rtol=0, atol=1e-6)
    # A continuation: a prompt of two tokens, then one decode step, from the cached window.
    entering = cache.layers[0].conv_states[0].clone()
    more = torch.randn(2, 2, 16)
    got, windows = reference(conv, more, entering)
    torch.testing.assert_close(got, conv(more, **{hf.cache_kwarg(conv): cache}), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(windows[:, -1], cache.layers[0].conv_states[0], rtol=0, atol=1e-6)
    entering = cache.layers[0].conv_states[0].clone()
    step = torch.randn(2, 1, 16)
    got, windows = reference(conv, step, entering)
    torch.testing.assert_close(got, conv(step, **{hf.cache_kwarg(conv): cache}), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(windows[:, -1], cache.layers[0].conv_states[0], rtol=0, atol=1e-6)


@torch.no_grad()
def test_a_short_fresh_prompt_pads_the_window_with_zeros(module):
    config, conv = module
    hidden = torch.randn(1, 2, 16)
    cache = DynamicCache(config=config)
    expected = conv(hidden, **{hf.cache_kwarg(conv): cache})
    got, windows = reference(conv, hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(windows[:, -1], cache.layers[0].conv_states[0], rtol=0, atol=1e-6)
    assert torch.equal(windows[:, -1, :, 0], torch.zeros(1, 16))
