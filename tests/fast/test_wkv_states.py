"""`nnterp.fast.wkv_states.wkv_one_pass` against transformers' own loop (``rwkv_linear_attention_cpu``), bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu as kernel

from nnterp.fast.wkv import wkv_one_pass


@pytest.mark.parametrize("entering", [False, True])
@pytest.mark.parametrize("return_state", [False, True])
def test_output_final_and_every_state_are_the_kernels(entering, return_state):
    torch.manual_seed(0)
    batch, seq, channels = 2, 23, 12
    decay, first = torch.randn(channels), torch.randn(channels)
    k, v = torch.randn(batch, seq, channels) * 4, torch.randn(batch, seq, channels)
    state = [torch.randn(batch, channels), torch.rand(batch, channels) + 0.1, torch.randn(batch, channels)] if entering else None
    kept = [part.clone() for part in state] if entering else None
    out = torch.full((batch, seq, 3, channels), float("nan"))
    y, final = wkv_one_pass(decay, first, k, v, state, out, return_state)
    y_ref, final_ref = kernel(decay, first, k, v, state=state, return_state=return_state)
    assert torch.equal(y, y_ref)
    if final_ref is None:
        assert final is None
    else:
        assert all(torch.equal(a, b) for a, b in zip(final, final_ref))
        assert final[0].data_ptr() != out[:, -1, 0].data_ptr(), "the final state is a copy, not a view of the buffer"
    for t in range(seq):
        _, after = kernel(decay, first, k[:, : t + 1], v[:, : t + 1], state=state, return_state=True)
        assert torch.equal(out[:, t], torch.stack(after, 1)), t
    if entering:
        assert all(torch.equal(a, b) for a, b in zip(state, kept)), "the entering state is not written"
