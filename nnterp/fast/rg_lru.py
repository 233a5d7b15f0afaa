"""The RG-LRU's effective attention (RecurrentGemma): its scan's output as an exact sum over the inputs it adds.

The scan adds ``u_t`` to a state it decays by ``ã_t`` (``a_t``, or 0 at a
reset), ``h_t = ã_t h_{t-1} + u_t``, and outputs ``y_t = h_t``; so ``y_t =
Σ_{s≤t} (∏_{s<j≤t} ã_j) u_s + (∏_{j≤t} ã_j) h_in``, per channel.
"""

from __future__ import annotations

from typing import Any

import torch

from .effective import EffectiveSpec, indices


def lru_attention(a: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """``(A [batch, channels, positions, seq], readout [batch, positions, channels] or None)`` of one scan call.

    ``A[c, t, s] = ∏_{s<j≤t} ã_j[c]`` (1 on the diagonal, 0 above it), with
    ``ã = a`` masked by the reset as the scan masks it; products, never a
    difference of log sums (ã is exactly 0 at a reset).
    """
    gate = (a["a"] * ~a["reset"]).float()
    seq, width = gate.shape[1], gate.shape[2]
    chosen = indices(channels, width, "channels").to(gate.device)
    gate = gate.index_select(2, chosen)
    rows = indices(positions, seq, "positions")
    readout = None
    if a.get("state") is not None and isinstance(a["state"], torch.Tensor):
        decayed = torch.cumprod(gate, dim=1).index_select(1, rows.to(gate.device))  # ∏_{j≤t}
        readout = decayed * a["state"].float().index_select(1, chosen)[:, None]
    if not coefficients:
        return None, readout
    out = gate.new_zeros(gate.shape[0], chosen.numel(), rows.numel(), seq)
    for k, t in enumerate(rows.tolist()):
        out[:, :, k, t] = 1.0
        if t:
            # ∏_{s<j≤t} for every s < t: a reversed cumulative product over j = t, t-1, ..., 1.
            out[:, :, k, :t] = torch.cumprod(gate[:, 1 : t + 1].flip(1), dim=1).flip(1).transpose(1, 2)
    return out, readout



LRU_ATTENTION = EffectiveSpec("rg-lru scan", lru_attention, "channels")
