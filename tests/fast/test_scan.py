"""`nnterp.fast.scan.scan_attention`, shared by the two scans: a selection is the same numbers, in bounded blocks too."""

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
    torch.testing.assert_close(part, A[:, [6, 2]][:, :, [149, 0, 64]], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, [149, 0, 64]][:, :, [6, 2]], rtol=0, atol=1e-6)
    s = scan_inputs(70)["ssd"]
    full, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"])
    some, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"], positions=range(60, 70), heads=[3])
    torch.testing.assert_close(some, full[:, [3], 60:70], rtol=0, atol=1e-6)
