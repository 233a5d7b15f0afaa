"""`nnterp.fast.short_convolution`: the window after every token and the effective attention, by the specs,
against LFM2's gated short convolution written as a loop over tokens (``tests/reference/short_convolution.py``)."""

from __future__ import annotations

import pytest
import torch

from nnterp.fast.short_convolution import EFFECTIVE, FAST
from tests.fast.inputs import channels_sum, close
from tests.reference.short_convolution import gated_short_convolution


def served(entering: bool, seq: int = 9, channels: int = 5, width: int = 3) -> tuple:
    gen = torch.Generator().manual_seed(9)
    B, C, x = (torch.randn(2, seq, channels, generator=gen) for _ in range(3))
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    window = torch.randn(2, channels, width, generator=gen) if entering else None
    return {"u": B * x, "B": B, "weight": weight, "bias": bias, "window": window}, C, x


@pytest.mark.parametrize("entering", [False, True])
def test_the_spec_computes_the_window_after_every_token(entering):
    a, C, x = served(entering)
    _, want = gated_short_convolution(a["B"], C, x, a["weight"], a["bias"], a["window"])
    torch.testing.assert_close(FAST.compute(a, None), want, rtol=0, atol=0)
    assert FAST.state_shape(a) == (2, 5, 3)
    out = torch.full(want.shape, float("nan"))
    assert FAST.compute(a, out) is out and torch.equal(out, want)


@pytest.mark.parametrize("entering", [False, True])
def test_the_spec_effective_attention_reproduces_the_convolution(entering):
    a, C, x = served(entering)
    want_y, _ = gated_short_convolution(a["B"], C, x, a["weight"], a["bias"], a["window"])
    A, readout = EFFECTIVE.compute(a, None, None, True)
    close(C * channels_sum(A, readout, x), want_y, "outputs")


@pytest.mark.parametrize("entering", [False, True])
def test_the_one_pass_is_the_convolution_and_its_windows(entering):
    a, C, x = served(entering)
    want_y, want = gated_short_convolution(a["B"], C, x, a["weight"], a["bias"], a["window"])
    out = torch.full(want.shape, float("nan"))
    result, windows = FAST.one_pass(a, out)
    assert windows is out and torch.equal(out, want)
    torch.testing.assert_close(C * result.transpose(1, 2), want_y, rtol=1e-6, atol=1e-6)
    assert FAST.one_pass({**a, "u": a["u"].bfloat16()}, out) is None, "float32 only: the body convolves in its own dtype"
