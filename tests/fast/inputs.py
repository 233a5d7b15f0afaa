"""Inputs and comparisons shared by the fast path's tests: seeded random arguments, tokens first, as a call serves them."""

from __future__ import annotations

import torch

#: Lightning attention's and the mLSTM's test sizes: batch, tokens, heads, key_dim, value_dim.
B, T, H, K, V = 2, 23, 3, 8, 6


def close(actual, expected, what, atol=1e-5):
    # float32: ~1e-5 relative to the largest entry.
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=atol, msg=what)


def heads_sum(A, readout, v):
    """``Σ_s A[:, h, t, s] v[:, s, h] + readout``: what an effective attention per head reconstructs."""
    out = torch.einsum("bhts,bshd->bthd", A, v.float())
    return out + readout if readout is not None else out


def channels_sum(A, readout, v):
    """``Σ_s A[:, c, t, s] v[:, s, c] + readout``: what an effective attention per channel reconstructs."""
    out = torch.einsum("bcts,bsc->btc", A, v.float())
    return out + readout if readout is not None else out


def delta_inputs(seq, *, batch=2, key_heads=2, value_heads=4, key_dim=8, value_dim=6, per_channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed + seq)
    q = torch.randn(batch, seq, key_heads, key_dim, generator=gen)
    k = torch.randn(batch, seq, key_heads, key_dim, generator=gen)
    v = torch.randn(batch, seq, value_heads, value_dim, generator=gen)
    g_shape = (batch, seq, value_heads, key_dim) if per_channel else (batch, seq, value_heads)
    g = -2.0 * torch.rand(g_shape, generator=gen)
    beta = torch.rand(batch, seq, value_heads, generator=gen)
    initial = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, initial


def scan_inputs(seq, *, heads=4, groups=2, head_dim=3, size=5, channels=7, seed=0):
    gen = torch.Generator().manual_seed(seed + seq)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {
        "ssd": dict(x=r(2, seq, heads, head_dim), dt=r(2, seq, heads), A=-3.0 * torch.rand(heads, generator=gen),
                    B=r(2, seq, groups, size), C=r(2, seq, groups, size), D=r(heads), dt_bias=r(heads),
                    state=r(2, heads, head_dim, size)),
        "mamba": dict(x=r(2, seq, channels), dt=r(2, seq, channels), A=-3.0 * torch.rand(channels, size, generator=gen),
                      B=r(2, seq, size), C=r(2, seq, size), D=r(channels), z=r(2, seq, channels), dt_bias=r(channels),
                      state=r(2, channels, size)),
    }


def mixer_inputs(seed: int = 0) -> tuple:
    """``(q, k, v, igate, fgate)`` of `B`, `T`, `H`, `K`, `V` (lightning attention uses the first three)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    # Large gate pre-activations: the stabilizer m changes branch often.
    i, f = 4 * torch.randn(B, T, H, generator=g), 4 * torch.randn(B, T, H, generator=g)
    return q, k, v, i, f
