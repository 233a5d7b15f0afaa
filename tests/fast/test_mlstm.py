"""`nnterp.fast.mlstm`: the in-place state writer, the one pass, the stabilizers and the effective attention, and its specs.

The oracle is the paper's recurrence in its unstabilized form (``tests/reference/mlstm.py``);
the writers are checked against it and the token loop they replace, from a zero
and from a given state, into a window of a larger buffer, and that they refuse
a graph; the specs compute the same from the backend call's arguments.
"""

from __future__ import annotations

import pytest
import torch

from nnterp.fast.mlstm import EFFECTIVE, FAST, mlstm_one_pass, mlstm_states, mlstm_states_into, stabilizers, unpack
from tests.fast.inputs import B, H, K, T, V, heads_sum, mixer_inputs
from tests.reference.mlstm import mlstm


@pytest.mark.parametrize("start", [False, True])
def test_mlstm_states_into_is_the_papers_recurrence(start, fill):
    q, k, v, i, f = mixer_inputs(1)
    initial = mlstm_states(k, k, v, i, f)[:, 7].clone() if start else None
    got = mlstm_states_into(k, v, i, f, initial)
    _, c, n, m = mlstm(q, k, v, i, f, unpack(initial) if start else None)
    for name, part, want in zip("Cnm", unpack(got), (c, n, m[..., None])):
        torch.testing.assert_close(part.double(), want, rtol=1e-4, atol=1e-6, msg=name)
    loop = mlstm_states(k, k, v, i, f, initial)
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[..., -1], loop[..., -1], atol=1e-6, rtol=1e-6, msg="the stabilizers are the loop's")
    assert torch.equal(got[..., -1], got[..., :1, -1].expand_as(got[..., -1])), "m repeated along the key axis"


@pytest.mark.parametrize("start", [False, True])
def test_mlstm_one_pass_reads_the_papers_outputs_and_writes_the_same_states(start, fill):
    q, k, v, i, f = mixer_inputs(3)
    initial = mlstm_states(k, k, v, i, f)[:, 7].clone() if start else None
    out = torch.full((B, T, H, K, V + 2), float("nan"))
    h, final = mlstm_one_pass(q, k, v, i, f, initial, out, eps=1e-6)
    want_h, c, n, m = mlstm(q, k, v, i, f, unpack(initial) if start else None)
    assert h.shape == (B, H, T, V), "heads first, as the backend returns it"
    torch.testing.assert_close(h.transpose(1, 2).double(), want_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, mlstm_states_into(k, v, i, f, initial), rtol=0, atol=0)
    for name, part, want in zip("Cnm", final, (c[:, -1], n[:, -1], m[:, -1, :, None])):
        torch.testing.assert_close(part.double(), want, rtol=1e-4, atol=1e-6, msg=name)


def test_stabilizers_of_a_long_decaying_run_keep_their_precision():
    # Over 4096 tokens the cumulated log forget gate reaches about -3000: the unrolled form subtracts two such sums.
    g = torch.Generator().manual_seed(4)
    log_f = torch.nn.functional.logsigmoid(torch.randn(1, 2, 4096, 1, generator=g) - 0.5)
    i = 3 * torch.randn(1, 2, 4096, 1, generator=g)
    m0 = torch.tensor([[[5.0], [-1.0]]])
    want, m = [], m0.double()
    for t in range(4096):
        m = torch.maximum(log_f[:, :, t].double() + m, i[:, :, t].double())
        want.append(m)
    torch.testing.assert_close(stabilizers(log_f, i, m0), torch.stack(want, dim=2).float(), rtol=1e-6, atol=1e-6)
    assert log_f.sum() < -2000


def test_mlstm_states_into_writes_a_window(fill):
    _, k, v, i, f = mixer_inputs(2)
    whole = mlstm_states_into(k, v, i, f)
    window = torch.full((B, T + 4, H, K, V + 2), float("nan"))
    mlstm_states_into(k[:, 5:], v[:, 5:], i[:, 5:], f[:, 5:], whole[:, 4], window, first=3)
    torch.testing.assert_close(window[:, 3 : T - 2], whole[:, 5:], atol=1e-5, rtol=1e-5)
    assert window[:, :3].isnan().all() and window[:, T - 2 :].isnan().all()


def test_mlstm_states_into_refuses_a_graph():
    _, k, v, i, f = mixer_inputs()
    k = k.requires_grad_()
    with pytest.raises(ValueError, match="autograd"):
        mlstm_states_into(k, v, i, f)
    with torch.no_grad():
        mlstm_states_into(k, v, i, f)  # no graph is recorded here: fine


# -- the specs --------------------------------------------------------------------------------


def served(start: bool) -> dict:
    q, k, v, i, f = mixer_inputs(6)
    state = mlstm_states(k, k, v, i, f)[:, 7].clone() if start else None
    return {"q": q, "k": k, "v": v, "igate": i, "fgate": f, "state": state}


def papers(a: dict) -> tuple:
    return mlstm(a["q"], a["k"], a["v"], a["igate"], a["fgate"], unpack(a["state"]) if a["state"] is not None else None)


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_computes_the_papers_states(start, fill):
    a = served(start)
    _, c, n, m = papers(a)
    got = FAST.compute(a, None)
    for name, part, want in zip("Cnm", unpack(got), (c, n, m[..., None])):
        torch.testing.assert_close(part.double(), want, rtol=1e-4, atol=1e-6, msg=name)
    assert FAST.state_shape(a) == (B, H, K, V + 2)
    k = a["k"].clone().requires_grad_()
    loop = FAST.compute({**a, "k": k}, None)  # under autograd: the token loop
    assert loop.requires_grad
    torch.testing.assert_close(loop.detach(), got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [False, True])
def test_the_spec_one_pass_and_effective_attention_read_the_papers_outputs(start, fill):
    a = served(start)
    want_h, c, n, m = papers(a)
    out = torch.full((B, T, H, K, V + 2), float("nan"))
    (h, final), states = FAST.one_pass(a, out)
    assert states is out
    torch.testing.assert_close(h.transpose(1, 2).double(), want_h, rtol=1e-4, atol=1e-5)
    for name, part, want in zip("Cnm", final, (c[:, -1], n[:, -1], m[:, -1, :, None])):
        torch.testing.assert_close(part.double(), want, rtol=1e-4, atol=1e-6, msg=name)
    assert FAST.one_pass({**a, "q": a["q"].double()}, out) is None
    A, readout = EFFECTIVE.compute(a, None, None, True)
    torch.testing.assert_close(heads_sum(A, readout, a["v"]).double(), want_h, rtol=1e-4, atol=1e-5)
