"""`nnterp.fast.wkv`: the one pass against transformers' own loop (``rwkv_linear_attention_cpu``), bit for bit, and
its specs against the paper's explicit sums (``tests/reference/wkv.py``)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu as kernel

from nnterp.fast.wkv import EFFECTIVE, FAST, wkv_one_pass
from tests.fast.inputs import channels_sum, close
from tests.reference.wkv import wkv


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


# -- the specs --------------------------------------------------------------------------------


def served(entering: bool) -> dict:
    gen = torch.Generator().manual_seed(7)
    batch, seq, channels = 2, 19, 10
    decay, first = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    k, v = torch.randn(batch, seq, channels, generator=gen) * 4, torch.randn(batch, seq, channels, generator=gen)
    state = None
    if entering:
        state = [torch.randn(batch, channels, generator=gen), torch.rand(batch, channels, generator=gen) + 0.1,
                 torch.randn(batch, channels, generator=gen)]
    return {"time_decay": decay, "time_first": first, "k": k, "v": v, "state": state, "final": True}


def papers(a: dict) -> tuple:
    state = torch.stack(a["state"], 1) if a["state"] is not None else None
    return wkv(a["time_decay"], a["time_first"], a["k"], a["v"], state)


@pytest.mark.parametrize("entering", [False, True])
def test_the_spec_computes_the_papers_states_and_outputs(entering):
    a = served(entering)
    want_y, want = papers(a)
    close(FAST.compute(a, None), want, "states")
    assert FAST.state_shape(a) == (2, 3, 10)
    out = torch.full((2, 19, 3, 10), float("nan"))
    (y, final), states = FAST.one_pass(a, out)
    assert states is out
    close(y, want_y, "one pass output")
    close(torch.stack(final, 1), want[:, -1], "one pass final state")
    close(FAST.leaving(final), want[:, -1], "the returned final state as one of the states")
    assert FAST.one_pass({**a, "k": a["k"].double()}, out) is None
    assert FAST.one_pass({**a, "k": a["k"][:, :1], "v": a["v"][:, :1]}, out) is None, "a decode step: the loop serves it"
    assert FAST.one_pass(a, out.bfloat16()) is None, "the output needs the float32 states"
    # Under autograd (and into a bfloat16 out) the states are the same loop's, stacked; a loss on them reaches k.
    k = a["k"].clone().requires_grad_()
    differentiable = FAST.compute({**a, "k": k}, None)
    close(differentiable.detach(), want, "states under autograd")
    differentiable[:, -1, 0].sum().backward()
    assert torch.isfinite(k.grad).all() and k.grad.abs().sum() > 0
    rounded = FAST.compute(a, torch.empty((2, 19, 3, 10), dtype=torch.bfloat16))
    close(rounded.float(), want.to(torch.bfloat16).float(), "states stored rounded once")


@pytest.mark.parametrize("entering", [False, True])
def test_the_spec_effective_attention_reproduces_the_papers_outputs(entering):
    a = served(entering)
    want_y, _ = papers(a)
    A, readout = EFFECTIVE.compute(a, None, None, True)
    close(channels_sum(A, readout, a["v"]), want_y, "outputs")
