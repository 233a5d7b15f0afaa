"""LFM2's gated short convolution (``Lfm2ShortConv``): the window after every token and the effective attention.

The forward gates its input, convolves it over the last ``L`` tokens per
channel, and gates the result:

    u_t = B_t ⊙ x_t,    W_t = [u_{t-L+1}, ..., u_t]  (the window, the newest last)
    y_t = C_t ⊙ (Σ_i w[:, i] ⊙ W_t[:, i] + b)

The state is the window: ``[batch, conv_channels, L]`` as transformers caches
it, channel-first; the window after token ``t`` is a slice of ``[window
entering; u]``, so every state is read with no recurrence (`window_states`).
The convolution's output is linear in the values ``x`` with a band of ``L``
coefficients per channel, plus what it reads from the window entering the call
(`effective_attention`).

Shapes, tokens first: ``x``, ``B``, ``C`` ``[batch, seq, conv_channels]``,
``weight`` ``[conv_channels, L]``, ``bias`` ``[conv_channels]`` or ``None``.
``arguments`` are as the component serves them: ``u`` the convolution's input
(its ``conv_input``, tokens first), ``B``, ``weight``, ``bias`` and ``window``
the window entering the call (``None``: zeros, a fresh prompt). The failure
mode worth knowing: the window holds the *gated* input ``B ⊙ x``, not ``x``:
a window patched from ``x`` would convolve ungated inputs without any error.

By those names (`nnterp.fast.spec`): `states`, `one_pass`, `state_shape`,
`effective_attention`, `tap`; the specs ``FAST``, ``EFFECTIVE``.
"""

from __future__ import annotations

from typing import Any

import torch

from .spec import EffectiveSpec, FastSpec, indices

__all__ = ["window_states", "window_reads", "states", "one_pass", "tap", "state_shape", "entering", "starting", "effective_attention", "FAST", "EFFECTIVE"]


def window_states(u: torch.Tensor, width: int, window: torch.Tensor | None = None) -> torch.Tensor:
    """The window after every token, ``[batch, seq, conv_channels, width]`` float32, from the convolution's input
    ``u`` ``[batch, seq, conv_channels]`` (tokens first) and the window entering (zeros when ``None``)."""
    u = u.float().transpose(1, 2)  # [batch, channels, seq]
    entering = u.new_zeros(u.shape[0], u.shape[1], width) if window is None else window.float()
    extended = torch.cat([entering, u], dim=-1)  # [window entering; u]
    return extended.unfold(-1, width, 1)[:, :, 1:].transpose(1, 2)


def window_reads(windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, conv_channels]``: what each token's convolution reads from the windows after the tokens before
    it, ``Σ_{0<k<L} Σ_{i≥k} w[:, i-k] W_{t-k}[:, i]``, from ``windows`` ``[batch, seq, conv_channels, L]`` and
    ``weight`` ``[conv_channels, L]``: token ``t+k`` reads entries ``k .. L-1`` of the window after ``t`` at taps
    ``0 .. L-1-k``. In ``windows``' dtype (`tap` reads the windows through it)."""
    seq, width = windows.shape[1], weight.shape[1]
    reads = torch.zeros(windows.shape[:3], dtype=windows.dtype, device=windows.device)
    for k in range(1, min(width, seq)):
        read = (windows[:, : seq - k, :, k:] * weight[:, : width - k]).sum(-1)
        reads = reads + torch.nn.functional.pad(read, (0, 0, k, 0))
    return reads


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`window_states` of a served call's arguments, copied into ``out`` when given."""
    a = arguments
    found = window_states(a["u"], a["weight"].shape[-1], a.get("window"))
    return found if out is None else out.copy_(found)


def one_pass(arguments: dict, out: torch.Tensor) -> tuple | None:
    """``(the kernel's output [batch, conv_channels, seq], the windows)``: ``causal_conv1d_fn``'s readout
    ``Σ_i w[:, i] W_t[:, i] + b`` of the windows written into ``out``. Float32 only (``None`` otherwise): the
    kernel's body convolves in the weight's dtype, which this sum would not equal in another. The output holds
    the call's own tokens, which is what the forward keeps of the kernel's."""
    a = arguments
    if a["u"].dtype != torch.float32 or a["weight"].dtype != torch.float32:
        return None
    windows = states(a, out)
    y = (windows * a["weight"]).sum(-1)  # [batch, seq, channels]
    if a.get("bias") is not None:
        y = y + a["bias"]
    return y.transpose(1, 2), windows


def tap(arguments: dict, taps: torch.Tensor) -> torch.Tensor:
    """An exact zero ``[batch, conv_channels, seq]`` (channel-first, as the kernel's output on the call's own tokens;
    the record adds it to the output's last ``seq`` entries, the others the window's) that depends on ``taps``
    ``[batch, seq, conv_channels, L]`` as each later token reads the window after an earlier one (`window_reads`):
    added to the output, the gradient of ``taps`` at ``t`` is the loss's by the window after ``t``. The weight is
    detached: the kernel's own output carries its gradient."""
    weight = arguments["weight"].detach()
    return (window_reads(taps, weight) - window_reads(taps.detach(), weight)).transpose(1, 2)


def state_shape(arguments: dict) -> tuple:
    """``(batch, conv_channels, L)``."""
    u, weight = arguments["u"], arguments["weight"]
    return (u.shape[0], u.shape[2], weight.shape[-1])


def effective_attention(arguments: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """``(A [batch, channels, positions, seq], readout [batch, positions, channels])`` of a short convolution over ``B ⊙ x``.

    ``a``: ``B`` ``[batch, seq, conv_channels]``; ``weight`` ``[conv_channels,
    L]``; ``bias`` ``[conv_channels]`` or ``None``; ``window`` ``[batch,
    conv_channels, L]``, the window entering the call (``None``: zeros).
    ``A[c, t, s] = w[c, L-1-(t-s)] B_s[c]`` for ``0 <= t - s < L``, so the
    convolution's output is ``Σ_s A[c, t, s] x_s[c] + readout[t, c]`` with
    ``readout[t, c] = b[c] + Σ_i w[c, i] window[c, t+1+i]`` over the entering
    window's entries token ``t`` still reads. Float32.
    """
    a = arguments
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


def entering(arguments: dict) -> torch.Tensor | None:
    """The window entering the call (``None``: zeros), the format of a state `states` writes."""
    return arguments.get("window")


def starting(window: torch.Tensor | None) -> dict:
    """The arguments that start the windows from ``window`` ``[batch, conv_channels, L]``."""
    return {"window": window}


#: LFM2's ``causal_conv1d_fn`` / ``causal_conv1d_update`` over the gated input (their output channel-first).
FAST = FastSpec(
    "short convolution", states, ("u",), state_shape, one_pass=one_pass, output_axis=2, entering=entering, starting=starting,
    tap=tap,
)
#: LFM2's short convolution over ``B ⊙ x``, prompt and decode step alike.
EFFECTIVE = EffectiveSpec("short convolution", effective_attention, "channels")
