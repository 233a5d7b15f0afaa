"""Effective attention of a short convolution over gated inputs (LFM2's ``Lfm2ShortConv``), in pure torch.

The convolution kernel's output at token ``t`` and channel ``c`` is
``Σ_i w[c, i] u_{t-L+1+i}[c] + b[c]`` over ``u = B ⊙ x``: linear in the
values ``x`` with a band of ``L`` coefficients per channel, plus what it reads
from the window entering the call (``readout``).
"""

from __future__ import annotations

from typing import Any

import torch

from .effective import EffectiveSpec, indices

__all__ = ["short_conv_attention", "SHORT_CONV_ATTENTION"]


def short_conv_attention(a: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """``(A [batch, channels, positions, seq], readout [batch, positions, channels])`` of a short convolution over ``B ⊙ x``.

    ``a``: ``B`` ``[batch, seq, conv_channels]``; ``weight`` ``[conv_channels,
    L]``; ``bias`` ``[conv_channels]`` or ``None``; ``window`` ``[batch,
    conv_channels, L]``, the window entering the call (``None``: zeros).
    ``A[c, t, s] = w[c, L-1-(t-s)] B_s[c]`` for ``0 <= t - s < L``, so the
    convolution's output is ``Σ_s A[c, t, s] x_s[c] + readout[t, c]`` with
    ``readout[t, c] = b[c] + Σ_i w[c, i] window[c, t+1+i]`` over the entering
    window's entries token ``t`` still reads. Float32.
    """
    B, weight = a["B"].float(), a["weight"].float()
    batch, seq, width = B.shape[0], B.shape[1], weight.shape[1]
    chosen = indices(channels, B.shape[2], "channels").to(B.device)
    rows = indices(positions, seq, "positions").to(B.device)
    B, weight = B.index_select(2, chosen), weight.index_select(0, chosen)
    out = None
    if coefficients:
        lag = rows[:, None] - torch.arange(seq, device=B.device)[None, :]  # [rows, seq]: t - s
        band = (lag >= 0) & (lag < width)
        taps = weight[:, (width - 1 - lag).clamp(0, width - 1)] * band  # [c, rows, seq]
        out = taps[None] * B.permute(0, 2, 1)[:, :, None, :]
    window = a.get("window")
    bias = a.get("bias")
    if window is None and bias is None:
        return out, None
    readout = torch.zeros(batch, seq, chosen.numel(), device=B.device)
    if window is not None:
        entering = window.float().index_select(1, chosen)  # [b, c, L]
        for t in range(min(seq, width - 1)):
            # Token t reads window entries t+1 .. L-1 at taps 0 .. L-2-t.
            readout[:, t] = (weight[:, : width - 1 - t] * entering[:, :, t + 1:]).sum(-1)
    if bias is not None:
        readout = readout + bias.float().index_select(0, chosen)
    return out, readout[:, rows]


SHORT_CONV_ATTENTION = EffectiveSpec("short convolution", short_conv_attention, "channels")
