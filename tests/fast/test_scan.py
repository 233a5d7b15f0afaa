"""`nnterp.fast.scan.scan_attention`, shared by the two scans: a selection is the same numbers (within float32
rounding: rows asked sparsely are computed one at a time, summed in another order), in bounded blocks too, and a
row asked alone is Mamba-1's equation in float64."""

from __future__ import annotations

import torch

import nnterp.fast.scan as scan
from nnterp.fast import selective_scan_attention, ssd_attention
from tests.fast.inputs import scan_inputs


def test_a_scan_selection_is_the_same_numbers_in_bounded_blocks(monkeypatch):
    a = scan_inputs(150)["mamba"]
    args = (a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, a["state"])
    A, readout = selective_scan_attention(*args)
    monkeypatch.setattr(scan, "BLOCK_ELEMENTS", 1)  # one channel at a time
    part, part_readout = selective_scan_attention(*args, positions=[149, 0, 64], channels=[6, 2])
    torch.testing.assert_close(part, A[:, [6, 2]][:, :, [149, 0, 64]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, [149, 0, 64]][:, :, [6, 2]], rtol=0, atol=1e-6)
    s = scan_inputs(70)["ssd"]
    full, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"])
    some, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"], positions=range(60, 70), heads=[3])
    torch.testing.assert_close(some, full[:, [3], 60:70], rtol=1e-5, atol=1e-6)


def test_a_row_asked_alone_is_the_selective_scan_equation_in_float64():
    # A[d, t, s] = silu(z_t[d]) (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j[d] A[d, n]) Δ_s[d] + D[d] δ_ts), Δ = softplus(dt + bias)
    seq, t = 300, 299
    a = {k: v.double() for k, v in scan_inputs(seq)["mamba"].items()}
    delta = torch.nn.functional.softplus(a["dt"] + a["dt_bias"])  # [b, seq, d]
    log_decay = delta[..., None] * a["A"]  # [b, seq, d, n]
    after = torch.stack([log_decay[:, s + 1 : t + 1].sum(1) for s in range(t + 1)], dim=1)  # [b, t + 1, d, n]
    expected = torch.einsum("bn,bsn,bsdn->bds", a["C"][:, t], a["B"][:, : t + 1], after.exp()) * delta[:, : t + 1].permute(0, 2, 1)
    expected[:, :, t] += a["D"]
    expected = expected * torch.nn.functional.silu(a["z"][:, t])[..., None]
    f = scan_inputs(seq)["mamba"]
    got, _ = selective_scan_attention(f["dt"], f["A"], f["B"], f["C"], f["D"], f["z"], f["dt_bias"], True, None, positions=[t])
    torch.testing.assert_close(got[:, :, 0].double(), expected, rtol=1e-5, atol=1e-6)
