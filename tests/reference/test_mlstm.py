"""`tests.reference.mlstm.mlstm` (the paper's recurrence) against transformers' own mLSTM backend.

The backend runs the chunkwise kernel on whole chunks and the token loop on
the rest (11 tokens, chunk size 4: both run), from zeros and from a non-zero
state; one token runs the one-step kernel.
"""

from __future__ import annotations

import pytest
import torch
from transformers import xLSTMConfig
from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

from tests.reference.mlstm import mlstm

B, H, DK, DV = 2, 3, 8, 6


def backend():
    config = xLSTMConfig(hidden_size=64, num_heads=H, chunk_size=4, mode="inference", autocast_kernel_dtype="float32")
    return xLSTMBackend(config)


def arguments(T, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, DK, generator=g), torch.randn(B, T, H, DK, generator=g)
    v = torch.randn(B, T, H, DV, generator=g)
    # Input gates around and above the forget gates' log, so the stabilizer moves both ways.
    i, f = 3 * torch.randn(B, T, H, generator=g), 2 + 2 * torch.randn(B, T, H, generator=g)
    return q, k, v, i, f


def initial(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, DK, DV, generator=g), torch.randn(B, H, DK, generator=g), torch.rand(B, H, 1, generator=g)


@pytest.mark.parametrize("T", [11, 1])
@pytest.mark.parametrize("start", [None, 7])
def test_the_paper_recurrence_reproduces_the_backend(T, start):
    q, k, v, i, f = arguments(T, 0)
    state = initial(start) if start is not None else None
    first = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  (the backend is heads first)
    c0, n0, m0 = state if state is not None else (None, None, None)
    with torch.no_grad():
        h, (c, n, m) = backend()(first(q), first(k), first(v), first(i), first(f), c_initial=c0, n_initial=n0, m_initial=m0)
    hr, cr, nr, mr = mlstm(q, k, v, i, f, state)
    torch.testing.assert_close(h.transpose(1, 2).double(), hr, rtol=1e-4, atol=1e-5, msg="outputs")
    torch.testing.assert_close(c.double(), cr[:, -1], rtol=1e-4, atol=1e-5, msg="C")
    torch.testing.assert_close(n.double(), nr[:, -1], rtol=1e-4, atol=1e-5, msg="n")
    torch.testing.assert_close(m[..., 0].double(), mr[:, -1], rtol=1e-5, atol=1e-6, msg="m")


def test_every_prefix_state_is_the_backends_final_state():
    q, k, v, i, f = arguments(9, 1)
    first = lambda x: x[:, :t].transpose(1, 2).contiguous()  # noqa: E731
    _, cr, nr, mr = mlstm(q, k, v, i, f)
    for t in range(1, 10):
        with torch.no_grad():
            _, (c, n, m) = backend()(first(q), first(k), first(v), first(i), first(f))
        torch.testing.assert_close(c.double(), cr[:, t - 1], rtol=1e-4, atol=1e-5, msg=f"C after {t}")
        torch.testing.assert_close(m[..., 0].double(), mr[:, t - 1], rtol=1e-5, atol=1e-6, msg=f"m after {t}")
