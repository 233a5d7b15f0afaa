"""RWKV-4's WKV as an exact attention over its values, from the kernel call's arguments.

Per channel, the kernel's output at ``t`` is a weighted average of the values
(Peng et al., 2023, arXiv:2305.13048), so with everything but the values fixed
it is exactly an attention pattern, one per channel, plus the part read from
the state entering the call:

    wkv_t = Σ_{s ≤ t} A[t, s] v_s + readout_t
    A[t, s] = e^{k_s + (t-1-s) d} / den_t  (s < t),   A[t, t] = e^{u + k_t} / den_t
    den_t = Σ_{s<t} e^{k_s + (t-1-s) d} + e^{u + k_t} + b_0 e^{p_0 + t d}
    readout_t = a_0 e^{p_0 + t d} / den_t

with ``d = -exp(time_decay)`` the log decay per token (``< 0``), ``u =
time_first`` and ``(a_0, b_0, p_0)`` the entering state's scaled numerator,
denominator and maximum. Every row is scaled by its largest exponent before
the exponential, as the kernel scales its sums. Each row of ``A`` sums to one
less the entering state's share: it is an average.

Memory: ``4 · batch · channels · positions · seq`` bytes (``positions=`` and
``channels=`` keep it bounded). Pure torch: imports nothing from nnterp but
``nnterp.fast``.
"""

from __future__ import annotations

from typing import Any

import torch

from .effective import EffectiveSpec, Selection, indices


def wkv_attention(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    k: torch.Tensor,
    state: tuple | None = None,
    positions: Selection = None,
    channels: Selection = None,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The WKV's effective attention, one pattern per channel (transformers' ``rwkv_linear_attention``).

    Args (tokens first):
        time_decay, time_first: ``[channels]``, the kernel's arguments.
        k: ``[batch, seq, channels]``, the keys.
        state: the entering ``(num, den, max)``, each ``[batch, channels]``, or ``None``.
        positions, channels: the rows and channels to return.
        coefficients: ``False`` computes the readout only (``A`` is ``None``).

    Returns:
        ``(A [batch, channels, positions, seq], readout [batch, positions,
        channels] or None)``, float32: the kernel's output at ``t`` is
        ``Σ_s A[:, c, t, s] v[:, s, c] + readout[:, t, c]``.
    """
    batch, seq, n_channels = k.shape
    rows = indices(positions, seq, "positions").to(k.device)
    chosen = indices(channels, n_channels, "channels").to(k.device)
    decay = -torch.exp(time_decay.float().index_select(0, chosen))  # [c]
    bonus = time_first.float().index_select(0, chosen)
    keys = k.float().index_select(2, chosen).permute(0, 2, 1)  # [b, c, seq]
    columns = torch.arange(seq, device=k.device)
    ages = (rows[:, None] - 1 - columns[None, :]).float()  # [r, s]: decays between s and the row's readout
    exponent = keys[:, :, None, :] + ages[None, None] * decay[None, :, None, None]  # [b, c, r, s]
    diagonal = rows[:, None] == columns[None, :]
    exponent = torch.where(diagonal, (bonus[:, None] + keys)[:, :, None, :], exponent)
    exponent = exponent.masked_fill(columns[None, :] > rows[:, None], float("-inf"))
    top = exponent.amax(-1)  # [b, c, r]
    carried = None
    if state is not None:
        num, den, peak = (part.float().index_select(1, chosen)[:, :, None] for part in state)
        carried = peak + rows.float()[None, None, :] * decay[None, :, None]  # the entering state, decayed t times
        top = torch.maximum(top, carried)
    weights = torch.exp(exponent - top[..., None])
    total = weights.sum(-1)
    if carried is not None:
        entering = torch.exp(carried - top)
        total = total + entering * den
    readout = (entering * num / total).permute(0, 2, 1) if carried is not None else None
    return (weights / total[..., None] if coefficients else None), readout


def _wkv(a: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    state = a.get("state")
    if state is not None and bool((state[1] == 0).all()):
        state = None  # a fresh state (nothing absorbed) reads nothing
    return wkv_attention(a["time_decay"], a["time_first"], a["k"], state, positions, channels, coefficients)


#: transformers' ``rwkv_linear_attention`` (RWKV-4), prompt and decode step alike.
WKV_ATTENTION = EffectiveSpec("WKV", _wkv, "channels")

__all__ = ["wkv_attention", "WKV_ATTENTION"]
