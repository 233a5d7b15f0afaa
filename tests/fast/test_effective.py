"""`nnterp.fast.effective` (`effective_delta`, `effective_scan`): the exact effective attention against the token loops and transformers' kernels.

Oracle: ``Σ_s A[t, s] v_s + readout_t`` equals the output of the papers'
token loops (``tests/reference/recurrences.py``) and of transformers' own
pure-torch kernels, within 1e-5 of the output's scale in float32: across
chunk boundaries, with grouped heads, an entering state, strong decays. And
a selection (``positions``, ``heads``, ``channels``) is the same numbers.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers.models.kimi_linear.modeling_kimi_linear as kimi_modeling
import transformers.models.mamba.modeling_mamba as mamba_modeling
import transformers.models.mamba2.modeling_mamba2 as mamba2_modeling
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen_modeling

import nnterp.fast.scan as effective_scan
from nnterp.fast import gated_delta_attention, kimi_delta_attention, selective_scan_attention, ssd_attention
from nnterp.recurrent.kernels import torch_function
from tests.fast.test_fast_states import delta_inputs
from tests.reference import recurrences as ref

LENGTHS = [1, 3, 13, 64, 65, 150]


def close(actual, expected, what):
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=1e-5, msg=what)


def heads_sum(A, readout, v):
    out = torch.einsum("bhts,bshd->bthd", A, v.float())
    return out + readout if readout is not None else out


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


# -- the delta rule ------------------------------------------------------------------------


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_gated_delta_attention_reproduces_the_token_loop(seq, with_initial):
    q, k, v, g, beta, initial = delta_inputs(seq)
    initial = initial if with_initial else None
    expected, _ = ref.gated_delta_rule(q, k, v, g, beta, initial)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    assert A.shape == (2, 4, seq, seq) and A.dtype == torch.float32
    assert (readout is None) == (initial is None)
    assert torch.equal(A, A.tril()), "causal"
    close(heads_sum(A, readout, v), expected, "output")


@pytest.mark.parametrize("seq", LENGTHS)
def test_kimi_delta_attention_reproduces_the_token_loop(seq):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4, per_channel=True)
    expected, _ = ref.kimi_delta_attention(q, k, v, g, beta, initial)
    A, readout = kimi_delta_attention(q, k, g, beta, initial)
    close(heads_sum(A, readout, v), expected, "output")


@pytest.mark.parametrize("seq", [3, 65, 150])
def test_gated_delta_attention_reproduces_transformers_chunk_kernel(seq):
    q, k, v, g, beta, initial = delta_inputs(seq)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    kernel = torch_function(qwen_modeling.torch_chunk_gated_delta_rule)
    if "repeat_interleave" not in inspect.getsource(kernel):  # up to 5.22 the mixer repeats q/k heads, not the kernel
        q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], 2) for x in (q, k))
    out, _ = kernel(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(heads_sum(A, readout, v), out, "output")


def test_kimi_delta_attention_reproduces_transformers_chunk_kernel():
    q, k, v, g, beta, initial = delta_inputs(77, key_heads=4, per_channel=True)
    A, readout = kimi_delta_attention(q, k, g, beta, initial)
    kernel = torch_function(kimi_modeling.chunk_kimi_delta_attention)
    out, _ = kernel(q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(heads_sum(A, readout, v), out, "output")


def test_without_the_kernels_l2_norm_queries_are_still_scaled():
    q, k, v, g, beta, initial = delta_inputs(20)
    q, k = 0.3 * q / q.norm(dim=-1, keepdim=True), 0.3 * k / k.norm(dim=-1, keepdim=True)  # a stable delta rule unnormalized
    expected, _ = ref.gated_delta_rule(q, k, v, g, beta, initial, use_qk_l2norm=False)
    A, readout = gated_delta_attention(q, k, g, beta, initial, use_qk_l2norm=False)
    close(heads_sum(A, readout, v), expected, "output")


def test_strong_decays_underflow_to_zero_without_nans():
    q, k, v, g, beta, initial = delta_inputs(130)
    g = torch.full_like(g, -200.0)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    assert torch.isfinite(A).all() and torch.isfinite(readout).all()
    close(heads_sum(A, readout, v), ref.gated_delta_rule(q, k, v, g, beta, initial)[0], "output")
    q, k, v, gk, beta, initial = delta_inputs(130, key_heads=4, per_channel=True)
    gk[..., ::2] = -300.0
    A, readout = kimi_delta_attention(q, k, gk, beta, initial)
    assert torch.isfinite(A).all()
    close(heads_sum(A, readout, v), ref.kimi_delta_attention(q, k, v, gk, beta, initial)[0], "kimi output")


def test_a_delta_selection_is_the_same_numbers():
    q, k, v, g, beta, initial = delta_inputs(150)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    part, part_readout = gated_delta_attention(q, k, g, beta, initial, positions=[140, 3, -1, 70], heads=[2, 0])
    rows = [140, 3, 149, 70]
    torch.testing.assert_close(part, A[:, [2, 0]][:, :, rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, rows][:, :, [2, 0]], rtol=0, atol=1e-6)
    none, only = gated_delta_attention(q, k, g, beta, initial, coefficients=False)
    assert none is None
    torch.testing.assert_close(only, readout, rtol=0, atol=1e-6)
    sliced, _ = gated_delta_attention(q, k, g, beta, initial, positions=slice(10, 20))
    torch.testing.assert_close(sliced, A[:, :, 10:20], rtol=0, atol=1e-6)
    with pytest.raises(IndexError, match="positions out of range"):
        gated_delta_attention(q, k, g, beta, positions=[150])


# -- the scans ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_ssd_attention_reproduces_the_token_loop(seq, with_initial):
    a = scan_inputs(seq)["ssd"]
    initial = a["state"] if with_initial else None
    limit = (0.01, 2.0)
    expected, _ = ref.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, limit, initial)
    A, readout = ssd_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, limit, initial)
    assert A.shape == (2, 4, seq, seq)
    close(heads_sum(A, readout, a["x"]), expected, "output")


@pytest.mark.parametrize("seq", [3, 45, 150])
def test_ssd_attention_reproduces_transformers_chunk_scan(seq):
    a = scan_inputs(seq)["ssd"]
    scan = torch_function(mamba2_modeling.mamba2_chunk_scan)
    out, _ = scan(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk_size=16, D=a["D"], dt_bias=a["dt_bias"],
                  initial_states=a["state"], dt_softplus=True, return_final_states=True)
    A, readout = ssd_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, (0.0, float("inf")), a["state"])
    close(heads_sum(A, readout, a["x"]), out, "output")


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_selective_scan_attention_reproduces_the_token_loop(seq, with_initial):
    a = scan_inputs(seq)["mamba"]
    initial = a["state"] if with_initial else None
    expected, _ = ref.selective_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, initial)
    A, readout = selective_scan_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, initial)
    assert A.shape == (2, 7, seq, seq)
    got = torch.einsum("bcts,bsc->btc", A, a["x"])
    close(got + readout if readout is not None else got, expected, "output")


def test_selective_scan_attention_reproduces_transformers_scan():
    a = scan_inputs(90)["mamba"]
    scan = torch_function(mamba_modeling.mamba_selective_scan)
    first = lambda x: x.transpose(1, 2)  # noqa: E731  the kernel is channel-first
    out = scan(first(a["x"]), first(a["dt"]), a["A"], first(a["B"]), first(a["C"]), D=a["D"], z=first(a["z"]),
               delta_bias=a["dt_bias"], delta_softplus=True)
    A, _ = selective_scan_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True)
    close(torch.einsum("bcts,bsc->btc", A, a["x"]), first(out), "output")


def test_a_scan_selection_is_the_same_numbers_in_bounded_blocks(monkeypatch):
    a = scan_inputs(150)["mamba"]
    args = (a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, a["state"])
    A, readout = selective_scan_attention(*args)
    monkeypatch.setattr(effective_scan, "BLOCK_ELEMENTS", 1)  # one channel at a time
    part, part_readout = selective_scan_attention(*args, positions=[149, 0, 64], channels=[6, 2])
    torch.testing.assert_close(part, A[:, [6, 2]][:, :, [149, 0, 64]], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, [149, 0, 64]][:, :, [6, 2]], rtol=0, atol=1e-6)
    s = scan_inputs(70)["ssd"]
    full, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"])
    some, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"], positions=range(60, 70), heads=[3])
    torch.testing.assert_close(some, full[:, [3], 60:70], rtol=0, atol=1e-6)
