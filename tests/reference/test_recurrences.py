"""The naive recurrences in ``recurrences.py`` against transformers' pure-torch kernels.

Lengths are chosen not to fill whole chunks (chunk kernels run with small chunk sizes),
and every check that the kernel allows starts from a non-zero initial state.
Per-token states are checked by running the kernel on every prefix (its final state).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.mamba import modeling_mamba
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.qwen3_5 import modeling_qwen3_5

from tests.reference.recurrences import gated_delta_rule, kimi_delta_attention, selective_scan, ssd

ATOL, RTOL = 2e-5, 1e-4


def torch_kernel(fn):
    """The pure-torch function behind transformers' hub-kernel dispatcher (5.15+), or ``fn`` itself."""
    return inspect.unwrap(fn)


def close(actual, expected, name):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- delta rules


def delta_inputs(T, Hk, Hv, Dk, Dv, per_channel, seed=0):
    g_ = gen(seed)
    B = 2
    q = torch.randn(B, T, Hk, Dk, generator=g_)
    k = torch.randn(B, T, Hk, Dk, generator=g_)
    v = torch.randn(B, T, Hv, Dv, generator=g_)
    g_shape = (B, T, Hv, Dk) if per_channel else (B, T, Hv)
    g = F.logsigmoid(torch.randn(g_shape, generator=g_) + 2.0)  # log decay in (-inf, 0)
    beta = torch.randn(B, T, Hv, generator=g_).sigmoid()
    h0 = 0.3 * torch.randn(B, Hv, Dk, Dv, generator=g_)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 3, 13])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("with_h0", [True, False])
def test_gated_delta_rule_matches_qwen3_5_kernels(T, l2, with_h0):
    q, k, v, g, beta, h0 = delta_inputs(T, Hk=2, Hv=4, Dk=8, Dv=6, per_channel=False)
    h0 = h0 if with_h0 else None
    out, states = gated_delta_rule(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=l2)
    assert out.shape == (2, T, 4, 6) and states.shape == (2, T, 4, 8, 6)
    assert out.dtype == states.dtype == torch.float32

    recurrent = torch_kernel(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    chunk = torch_kernel(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    if "repeat_interleave" not in inspect.getsource(chunk):  # up to 5.22 the mixer repeats q/k heads, not the kernel
        q, k = q.repeat_interleave(v.shape[2] // q.shape[2], 2), k.repeat_interleave(v.shape[2] // k.shape[2], 2)
    ref_out, ref_state = recurrent(q, k, v, g, beta, **kw)
    close(out, ref_out, "gated_delta_rule output vs torch_recurrent_gated_delta_rule")
    close(states[:, -1], ref_state, "gated_delta_rule final state vs torch_recurrent_gated_delta_rule")
    for chunk_size in (4, 64):
        c_out, c_state = chunk(q, k, v, g, beta, chunk_size=chunk_size, **kw)
        close(out, c_out, f"gated_delta_rule output vs torch_chunk_gated_delta_rule(chunk={chunk_size})")
        close(states[:, -1], c_state, f"gated_delta_rule final state vs torch_chunk(chunk={chunk_size})")
    for t in range(T):
        _, s = recurrent(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], **kw)
        close(states[:, t], s, f"gated_delta_rule state after token {t} vs recurrent kernel on prefix")


def test_gated_delta_rule_pre_expanded_heads_agree():
    """Expanding q/k to Hv heads first (what the 5.16-5.22 mixers do) changes nothing."""
    q, k, v, g, beta, h0 = delta_inputs(5, Hk=2, Hv=4, Dk=8, Dv=6, per_channel=False, seed=1)
    a = gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    b = gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta, initial_state=h0)
    close(a[0], b[0], "grouped vs pre-expanded output")
    close(a[1], b[1], "grouped vs pre-expanded states")


def test_gated_delta_rule_is_kimi_with_channel_constant_decay():
    q, k, v, g, beta, h0 = delta_inputs(6, Hk=4, Hv=4, Dk=8, Dv=6, per_channel=False, seed=2)
    a = gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    b = kimi_delta_attention(q, k, v, g[..., None].expand(-1, -1, -1, 8), beta, initial_state=h0)
    close(a[0], b[0], "gdn vs kda(constant g) output")
    close(a[1], b[1], "gdn vs kda(constant g) states")


@pytest.mark.parametrize("T", [1, 3, 13])
@pytest.mark.parametrize("l2", [True, False])
def test_kimi_delta_attention_matches_kimi_kernels(T, l2):
    q, k, v, g, beta, h0 = delta_inputs(T, Hk=3, Hv=3, Dk=8, Dv=8, per_channel=True, seed=3)
    out, states = kimi_delta_attention(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=l2)
    assert out.shape == (2, T, 3, 8) and states.shape == (2, T, 3, 8, 8)

    recurrent = torch_kernel(modeling_kimi_linear.recurrent_kimi_delta_attention)
    chunk = torch_kernel(modeling_kimi_linear.chunk_kimi_delta_attention)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    ref_out, ref_state = recurrent(q, k, v, g, beta, **kw)
    close(out, ref_out, "kimi_delta_attention output vs recurrent_kimi_delta_attention")
    close(states[:, -1], ref_state, "kimi_delta_attention final state vs recurrent_kimi_delta_attention")
    for chunk_size in (4, 64):
        c_out, c_state = chunk(q, k, v, g, beta, chunk_size=chunk_size, **kw)
        close(out, c_out, f"kimi_delta_attention output vs chunk_kimi_delta_attention(chunk={chunk_size})")
        close(states[:, -1], c_state, f"kimi_delta_attention final state vs chunk kernel(chunk={chunk_size})")
    for t in range(T):
        _, s = recurrent(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], **kw)
        close(states[:, t], s, f"kimi_delta_attention state after token {t} vs recurrent kernel on prefix")


# --------------------------------------------------------------------------- Mamba-1


def mamba1_inputs(T, D=6, N=4, seed=0):
    g_ = gen(seed)
    Bsz = 2
    x = torch.randn(Bsz, T, D, generator=g_)
    dt = torch.randn(Bsz, T, D, generator=g_)
    A = -torch.rand(D, N, generator=g_) * 2 - 0.1
    B = torch.randn(Bsz, T, N, generator=g_)
    C = torch.randn(Bsz, T, N, generator=g_)
    Dskip = torch.randn(D, generator=g_)
    z = torch.randn(Bsz, T, D, generator=g_)
    dt_bias = torch.randn(D, generator=g_) * 0.5
    h0 = torch.randn(Bsz, D, N, generator=g_) * 0.3
    return x, dt, A, B, C, Dskip, z, dt_bias, h0


@pytest.mark.parametrize("T", [1, 3, 13])
def test_selective_scan_matches_mamba_prompt_kernel(T):
    x, dt, A, B, C, Dskip, z, dt_bias, _ = mamba1_inputs(T)
    y, states = selective_scan(x, dt, A, B, C, D=Dskip, z=z, dt_bias=dt_bias)
    assert y.shape == (2, T, 6) and states.shape == (2, T, 6, 4)

    scan = torch_kernel(modeling_mamba.mamba_selective_scan)
    cf = lambda t: t.transpose(1, 2)  # noqa: E731  tokens-first -> channel-first
    ref_y, ref_state = scan(
        cf(x), cf(dt), A, cf(B), cf(C), D=Dskip, z=cf(z), delta_bias=dt_bias, delta_softplus=True,
        return_last_state=True,
    )
    close(y, cf(ref_y), "selective_scan y vs mamba_selective_scan (channel-first)")
    close(states[:, -1], ref_state, "selective_scan final state vs mamba_selective_scan")
    for t in range(T):
        s = t + 1
        _, st = scan(cf(x[:, :s]), cf(dt[:, :s]), A, cf(B[:, :s]), cf(C[:, :s]), D=Dskip, z=cf(z[:, :s]),
                     delta_bias=dt_bias, delta_softplus=True, return_last_state=True)
        close(states[:, t], st, f"selective_scan state after token {t} vs mamba_selective_scan on prefix")

    # Without D, z and bias, and without softplus.
    y2, s2 = selective_scan(x, dt.abs(), A, B, C, dt_softplus=False)
    r2, rs2 = scan(cf(x), cf(dt.abs()), A, cf(B), cf(C), return_last_state=True)
    close(y2, cf(r2), "selective_scan (no D/z/bias/softplus) y")
    close(s2[:, -1], rs2, "selective_scan (no D/z/bias/softplus) state")


@pytest.mark.parametrize("T", [1, 5])
def test_selective_scan_initial_state_matches_mamba_decode_kernel(T):
    """The prompt kernel cannot start from a state; the decode kernel, stepped, can."""
    x, dt, A, B, C, Dskip, z, dt_bias, h0 = mamba1_inputs(T, seed=4)
    y, states = selective_scan(x, dt, A, B, C, D=Dskip, z=z, dt_bias=dt_bias, initial_state=h0)
    step = torch_kernel(modeling_mamba.mamba_selective_state_update)
    cache = h0.clone()
    for t in range(T):
        y_t = step(cache, x[:, t], dt[:, t], A, B[:, t], C[:, t], Dskip, z=z[:, t], dt_bias=dt_bias, dt_softplus=True)
        close(y[:, t], y_t, f"selective_scan y[{t}] vs mamba_selective_state_update")
        close(states[:, t], cache, f"selective_scan state[{t}] vs in-place state of mamba_selective_state_update")


# --------------------------------------------------------------------------- Mamba-2


def mamba2_inputs(T, H=4, P=3, G=2, N=5, seed=0):
    g_ = gen(seed)
    Bsz = 2
    x = torch.randn(Bsz, T, H, P, generator=g_)
    dt = torch.randn(Bsz, T, H, generator=g_)
    A = -torch.rand(H, generator=g_) * 2 - 0.1
    B = torch.randn(Bsz, T, G, N, generator=g_)
    C = torch.randn(Bsz, T, G, N, generator=g_)
    Dskip = torch.randn(H, generator=g_)
    dt_bias = torch.randn(H, generator=g_) * 0.5
    h0 = torch.randn(Bsz, H, P, N, generator=g_) * 0.3
    return x, dt, A, B, C, Dskip, dt_bias, h0


@pytest.mark.parametrize("T", [1, 3, 13])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.2, 0.9)])
@pytest.mark.parametrize("with_h0", [True, False])
def test_ssd_matches_mamba2_chunk_scan(T, dt_limit, with_h0):
    x, dt, A, B, C, Dskip, dt_bias, h0 = mamba2_inputs(T, seed=5)
    h0 = h0 if with_h0 else None
    y, states = ssd(x, dt, A, B, C, D=Dskip, dt_bias=dt_bias, dt_limit=dt_limit, initial_state=h0)
    assert y.shape == (2, T, 4, 3) and states.shape == (2, T, 4, 3, 5)

    scan = torch_kernel(modeling_mamba2.mamba2_chunk_scan)
    kw = dict(D=Dskip, dt_bias=dt_bias, initial_states=h0, dt_softplus=True, dt_limit=dt_limit,
              return_final_states=True)
    for chunk_size in (4, 256):
        ref_y, ref_state = scan(x, dt, A, B, C, chunk_size, **kw)
        close(y, ref_y, f"ssd y vs mamba2_chunk_scan(chunk={chunk_size}, dt_limit={dt_limit})")
        close(states[:, -1], ref_state, f"ssd final state vs mamba2_chunk_scan(chunk={chunk_size})")
    for t in range(T):
        s = t + 1
        _, st = scan(x[:, :s], dt[:, :s], A, B[:, :s], C[:, :s], 4, **kw)
        close(states[:, t], st, f"ssd state after token {t} vs mamba2_chunk_scan on prefix")


@pytest.mark.parametrize("T", [1, 5])
def test_ssd_matches_mamba2_decode_kernel(T):
    x, dt, A, B, C, Dskip, dt_bias, h0 = mamba2_inputs(T, seed=6)
    y, states = ssd(x, dt, A, B, C, D=Dskip, dt_bias=dt_bias, initial_state=h0)
    step = torch_kernel(modeling_mamba2.mamba2_selective_state_update)
    H, P, N = 4, 3, 5
    cache = h0.clone()
    for t in range(T):
        # The mixer expands the per-head values before the decode call.
        y_t = step(
            cache, x[:, t], dt[:, t, :, None].expand(-1, -1, P), A[:, None, None].expand(H, P, N), B[:, t], C[:, t],
            D=Dskip[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True,
        )
        close(y[:, t], y_t, f"ssd y[{t}] vs mamba2_selective_state_update")
        close(states[:, t], cache, f"ssd state[{t}] vs in-place state of mamba2_selective_state_update")
