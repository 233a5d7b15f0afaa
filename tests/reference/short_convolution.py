"""LFM2's gated short convolution, written from its equation as one plain loop over tokens.

    u_t = B_t ⊙ x_t
    W_t = [u_{t-L+1}, ..., u_t]              (the window: the last L inputs, the newest last)
    y_t = C_t ⊙ (Σ_i w[:, i] ⊙ W_t[:, i] + b)

A test oracle, in float32, independent of transformers and of nnterp;
``tests/reference/test_short_convolution.py`` checks it against transformers'
``Lfm2ShortConv``. Shapes: ``B``, ``C``, ``x`` ``[batch, T, D]`` (tokens first),
``w`` ``[D, L]``, the window ``[batch, D, L]`` as transformers caches it.
"""

from __future__ import annotations

import torch

__all__ = ["gated_short_convolution"]


def gated_short_convolution(
    B: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [batch, T, D], windows [batch, T, D, L])``: the gated output and the window after every token.

    ``window``: the window entering the first token (zeros when ``None``, as on a fresh prompt).
    """
    batch, length, channels = x.shape
    width = weight.shape[1]
    W = torch.zeros(batch, channels, width) if window is None else window.float().clone()
    w = weight.float()
    ys, windows = [], []
    for t in range(length):
        u = B[:, t].float() * x[:, t].float()
        W = torch.cat([W[:, :, 1:], u[:, :, None]], dim=2)
        conv = (W * w).sum(-1)
        if bias is not None:
            conv = conv + bias.float()
        ys.append(C[:, t].float() * conv)
        windows.append(W)
    return torch.stack(ys, dim=1), torch.stack(windows, dim=1)
