"""`nnterp.fast.lightning_attention`: the in-place state writer, the one pass and the effective attention, and its specs.

Without autograd, ``linear_attn.states`` is written token by token into one
preallocated buffer; these check the writer against the paper's recurrence
(``tests/reference/lightning.py``) and the token loop it replaces, from a zero
and from a given state, into a window of a larger buffer, and that it refuses a
graph; the specs compute the same from the call's q, k, v, decays and state.
"""

from __future__ import annotations

import pytest
import torch

from nnterp.fast.lightning_attention import EFFECTIVE, FAST, lightning_scan, lightning_states
from tests.fast.inputs import B, H, K, T, V, close, heads_sum, mixer_inputs
from tests.reference.lightning import lightning_recurrence


@pytest.mark.parametrize("start", [False, True])
def test_lightning_states_are_the_papers_recurrence(start, fill):
    q, k, v, _, _ = mixer_inputs()
    slope = torch.rand(H) * 0.5
    g = (-slope).expand(B, T, H)
    initial = torch.randn(B, H, K, V) if start else None
    _, want = lightning_recurrence(q, k, v, slope, initial)
    got = lightning_states(k, v, g, initial)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, lightning_scan(q, k, v, g, initial, keep=True)[2], atol=1e-5, rtol=1e-5)
    window = torch.full((B, T + 5, H, K, V), float("nan"))
    lightning_states(k[:, 3:], v[:, 3:], g[:, 3:], got[:, 2], window, first=2)
    torch.testing.assert_close(window[:, 2 : T - 1], got[:, 3:], atol=1e-5, rtol=1e-5)
    assert window[:, :2].isnan().all() and window[:, T - 1 :].isnan().all()


def test_lightning_states_refuse_a_graph():
    _, k, v, _, _ = mixer_inputs()
    k = k.requires_grad_()
    with pytest.raises(ValueError, match="autograd"):
        lightning_states(k, v, -torch.ones(B, T, H))


# -- the specs --------------------------------------------------------------------------------


def served(start: bool) -> tuple:
    q, k, v, _, _ = mixer_inputs(5)
    slope = torch.rand(H, generator=torch.Generator().manual_seed(5)) * 0.5
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(6)) if start else None
    return {"q": q, "k": k, "v": v, "g": (-slope).expand(B, T, H), "state": state}, slope


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_computes_the_papers_states(start, fill):
    a, slope = served(start)
    _, want = lightning_recurrence(a["q"], a["k"], a["v"], slope, a["state"])
    close(FAST.compute(a, None), want, "states, in place")
    assert FAST.state_shape(a) == (B, H, K, V)
    out = torch.full((B, T, H, K, V), float("nan"))
    assert FAST.compute(a, out) is out
    k = a["k"].clone().requires_grad_()
    states = FAST.compute({**a, "k": k}, None)  # under autograd: the token loop, differentiable
    close(states.detach(), want, "states, token loop")
    states.sum().backward()
    assert torch.isfinite(k.grad).all() and k.grad.abs().sum() > 0


def test_the_spec_one_pass_reads_the_papers_outputs(fill):
    a, slope = served(False)
    want_out, want = lightning_recurrence(a["q"], a["k"], a["v"], slope)
    out = torch.full((B, T, H, K, V), float("nan"))
    (outputs, final), states = FAST.one_pass(a, out)
    assert states is out and outputs.shape == (B, H, T, V), "heads first, as the forward holds them"
    assert torch.equal(final, out[:, -1]), "the forward's own return: its final state is the last one"
    close(outputs.transpose(1, 2), want_out, "outputs")
    close(out, want, "states")
    assert FAST.one_pass(served(True)[0], out) is None, "the one pass starts from zeros"


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_effective_attention_reproduces_the_papers_outputs(start):
    a, slope = served(start)
    want_out, _ = lightning_recurrence(a["q"], a["k"], a["v"], slope, a["state"])
    A, readout = EFFECTIVE.compute(a, None, None, True)
    close(heads_sum(A, readout, a["v"]), want_out, "outputs")
    part, part_readout = EFFECTIVE.compute(a, [T - 1, 0], [2, 0], True)
    torch.testing.assert_close(part, A[:, [2, 0]][:, :, [T - 1, 0]], rtol=0, atol=0)
    if start:
        torch.testing.assert_close(part_readout, readout[:, [T - 1, 0]][:, :, [2, 0]], rtol=0, atol=0)
    assert EFFECTIVE.compute(a, None, None, False)[0] is None
