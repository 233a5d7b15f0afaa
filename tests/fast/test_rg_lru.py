"""`nnterp.fast.rg_lru`: the RG-LRU's scan and its effective attention, by the specs, against the paper's scan.

The oracle is ``tests/reference/rg_lru.scan`` (``h_t = ã_t h_{t-1} + u_t``, ``ã_t = 0`` at a reset),
with a reset inside a row (a packed second sequence) and an entering state.
"""

from __future__ import annotations

import pytest
import torch

from nnterp.fast.rg_lru import EFFECTIVE, FAST
from tests.fast.inputs import channels_sum, close
from tests.reference import rg_lru as ref


def served(start: bool, seq: int = 17, width: int = 6) -> dict:
    gen = torch.Generator().manual_seed(8)
    positions = torch.arange(seq).repeat(2, 1)
    positions[1, 5:] = torch.arange(seq - 5)  # row 1 resets at token 5 too
    state = torch.randn(2, width, generator=gen) if start else None
    return {"x": torch.randn(2, seq, width, generator=gen), "a": torch.rand(2, seq, width, generator=gen),
            "reset": (positions == 0)[..., None], "state": state}


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_computes_the_scan_bit_for_bit(start):
    a = served(start)
    want = ref.scan(a["x"], a["a"], a["reset"], a["state"])
    got = FAST.compute(a, None)
    assert torch.equal(got, want), "the scan's own operations"
    assert FAST.state_shape(a) == (2, 6)
    out = torch.full(want.shape, float("nan"))
    assert FAST.compute(a, out) is out and torch.equal(out, want)
    x = a["x"].clone().requires_grad_()
    states = FAST.compute({**a, "x": x}, None)  # under autograd: stacked, not written in place
    assert torch.equal(states.detach(), want)
    states.sum().backward()
    assert torch.isfinite(x.grad).all()
    x.grad = None
    out = torch.full(want.shape, float("nan"))  # under autograd into ``out`` too, as `FromArguments` passes one
    assert FAST.compute({**a, "x": x}, out) is out and torch.equal(out.detach(), want)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_effective_attention_reproduces_the_scan(start):
    a = served(start)
    want = ref.scan(a["x"], a["a"], a["reset"], a["state"])
    A, readout = EFFECTIVE.compute(a, None, None, True)
    close(channels_sum(A, readout, a["x"]), want, "outputs")
    part, part_readout = EFFECTIVE.compute(a, [16, 2], [5, 1], True)
    torch.testing.assert_close(part, A[:, [5, 1]][:, :, [16, 2]], rtol=0, atol=0)
    if start:
        torch.testing.assert_close(part_readout, readout[:, [16, 2]][:, :, [5, 1]], rtol=0, atol=0)
