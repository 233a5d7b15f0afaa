"""Lightning attention's and the mLSTM's in-place state writers (`lightning_states`, `mlstm_states_into`, `mlstm_one_pass`).

Without autograd, ``linear_attn.states`` of both kinds is written token by token into one
preallocated buffer; these check the writers against the papers' recurrences
(``tests/reference``) and the token loops they replace, from a zero and from a given
state, into a window of a larger buffer, and that they refuse a graph.
"""

from __future__ import annotations

import pytest
import torch

from nnterp.fast.lightning_attention import lightning_scan, lightning_states
from nnterp.fast.mlstm import mlstm_one_pass, mlstm_states, mlstm_states_into, stabilizers, unpack
from tests.reference.lightning import lightning_recurrence
from tests.reference.mlstm import mlstm

B, T, H, K, V = 2, 23, 3, 8, 6


def inputs(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    # Large gate pre-activations: the stabilizer m changes branch often.
    i, f = 4 * torch.randn(B, T, H, generator=g), 4 * torch.randn(B, T, H, generator=g)
    return q, k, v, i, f


@pytest.mark.parametrize("start", [False, True])
def test_lightning_states_are_the_papers_recurrence(start):
    q, k, v, _, _ = inputs()
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


@pytest.mark.parametrize("start", [False, True])
def test_mlstm_states_into_is_the_papers_recurrence(start):
    q, k, v, i, f = inputs(1)
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
def test_mlstm_one_pass_reads_the_papers_outputs_and_writes_the_same_states(start):
    q, k, v, i, f = inputs(3)
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


def test_mlstm_states_into_writes_a_window():
    _, k, v, i, f = inputs(2)
    whole = mlstm_states_into(k, v, i, f)
    window = torch.full((B, T + 4, H, K, V + 2), float("nan"))
    mlstm_states_into(k[:, 5:], v[:, 5:], i[:, 5:], f[:, 5:], whole[:, 4], window, first=3)
    torch.testing.assert_close(window[:, 3 : T - 2], whole[:, 5:], atol=1e-5, rtol=1e-5)
    assert window[:, :3].isnan().all() and window[:, T - 2 :].isnan().all()


def test_both_refuse_a_graph():
    _, k, v, i, f = inputs()
    k = k.requires_grad_()
    with pytest.raises(ValueError, match="autograd"):
        lightning_states(k, v, -torch.ones(B, T, H))
    with pytest.raises(ValueError, match="autograd"):
        mlstm_states_into(k, v, i, f)
    with torch.no_grad():
        mlstm_states_into(k, v, i, f)  # no graph is recorded here: fine
