"""The scans' effective attention: Mamba-2 (SSD, a decay per head) and Mamba-1 (selective scan, per channel).

The writes do not depend on the state, so ``A[t, s] = gate_t (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j A[n]) Δ_s
+ D δ_ts)``: one decay per head on Mamba-2 (``A`` per head), one per
(channel, state entry) on Mamba-1. The skip ``D x_t`` is the diagonal. The
gate is ``silu(z_t)`` where the kernel applies it (Mamba-1's kernels; none
on Mamba-2's chunk scan, whose gate is a norm after it: that ``A`` is the
scan's output before the gate, and so it is on the one Mamba-2 decode
kernel that gates inside, Falcon-H1's without ``mamba_rms_norm``, whose
gate is per channel).

Shapes, selection and numerics as in `nnterp.fast.effective`. Pure torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .effective import EffectiveSpec, Selection, expand_groups, indices
from .step import step_size

#: Elements a temporary block may hold (float32: 64 MiB) on the scans.
BLOCK_ELEMENTS = 1 << 24
#: Rows of ``A`` a scan computes at once.
ROWS = 64


def time_step(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple | None) -> torch.Tensor:
    """Δ as the kernels compute it, in ``dt``'s dtype, then float32: ``clamp(softplus(dt + dt_bias), dt_limit)``."""
    return step_size(dt, dt_bias, dt_softplus, dt_limit).float()


def ssd_attention(
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple | None = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    positions: Selection = None,
    heads: Selection = None,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Mamba-2's effective attention (transformers' ``mamba2_chunk_scan``, and its decode step).

    ``A[t, s] = C_t·B_s exp(Σ_{s<j≤t} Δ_j A_h) Δ_s`` for ``s < t`` and, on
    the diagonal, ``C_t·B_t Δ_t + D_h``: per head, the scan's output before
    the gate (transformers' chunk scan takes no ``z``).

    Args:
        dt: ``[batch, seq, heads]``; A, D, dt_bias: ``[heads]``;
        B, C: ``[batch, seq, groups, state_size]``;
        dt_limit: Δ's clamp (``None``: none, as on a decode step);
        initial_states: ``[batch, heads, head_dim, state_size]`` or ``None``;
        positions, heads: the rows and heads to return.
        coefficients: ``False`` computes the readout only (``A`` is ``None``).

    Returns:
        ``(A [batch, heads, positions, seq], readout [batch, positions, heads,
        head_dim] or None)``: the scan's output at ``t`` is ``Σ_s A[:, h, t, s]
        x[:, s, h] + readout[:, t, h]``.
    """
    n_heads = dt.shape[2]
    chosen = indices(heads, n_heads, "heads").to(dt.device)
    step = time_step(dt, dt_bias, dt_softplus, dt_limit).index_select(2, chosen)  # [b, seq, h]
    log_decay = (step * A.float().index_select(0, chosen))[..., None]  # [b, seq, h, 1]
    B, C = (expand_groups(x.float(), n_heads).index_select(2, chosen) for x in (B, C))
    skip = D.float().index_select(0, chosen) if D is not None else None
    state = initial_states.float().index_select(1, chosen) if initial_states is not None else None
    return _scan_attention(log_decay, B, C, step, skip, None, state, positions, coefficients)


def selective_scan_attention(
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    initial_state: torch.Tensor | None = None,
    positions: Selection = None,
    channels: Selection = None,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Mamba-1's effective attention, one pattern per channel (transformers' ``mamba_selective_scan``).

    ``A[d, t, s] = silu(z_t[d]) (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j[d] A[d, n]) Δ_s[d]
    + D[d] δ_ts)``: the kernel's output, gate and skip included.

    Args (tokens first):
        dt, z: ``[batch, seq, channels]``; A: ``[channels, state_size]``;
        B, C: ``[batch, seq, state_size]``; D, dt_bias: ``[channels]``;
        initial_state: ``[batch, channels, state_size]`` or ``None`` (a decode step's);
        positions, channels: the rows and channels to return.
        coefficients: ``False`` computes the readout only (``A`` is ``None``).

    Returns:
        ``(A [batch, channels, positions, seq], readout [batch, positions,
        channels] or None)``. Big: ``4 · batch · channels · positions · seq`` bytes.
    """
    n_channels = dt.shape[2]
    chosen = indices(channels, n_channels, "channels").to(dt.device)
    step = time_step(dt, dt_bias, dt_softplus, None).index_select(2, chosen)  # [b, seq, c]
    log_decay = step[..., None] * A.float().index_select(0, chosen)  # [b, seq, c, n]
    B, C = (x.float()[:, :, None, :] for x in (B, C))  # [b, seq, 1, n], shared by the channels
    skip = D.float().index_select(0, chosen) if D is not None else None
    gate = F.silu(z.float().index_select(2, chosen)) if z is not None else None
    state = initial_state.float().index_select(1, chosen)[:, :, None, :] if initial_state is not None else None
    out, readout = _scan_attention(log_decay, B, C, step, skip, gate, state, positions, coefficients)
    return out, (readout[..., 0] if readout is not None else None)


def _scan_attention(log_decay, B, C, step, skip, gate, state, positions, coefficients=True):
    """``A [b, u, rows, seq]`` of a scan whose state is written without reading it.

    ``log_decay [b, seq, u, 1 | n]``, ``B, C [b, seq, u | 1, n]``, ``step
    [b, seq, u]`` (the write's Δ), ``skip [u]``, ``gate [b, seq, u]``, ``state
    [b, u, p, n]``. Blocks of ``ROWS`` rows and of units ``u`` keep every
    temporary under `BLOCK_ELEMENTS`.
    """
    batch, seq, units, width = log_decay.shape
    size = B.shape[-1]
    rows = indices(positions, seq, "positions")
    readout = None
    if state is not None:
        total = log_decay.cumsum(dim=1)  # Σ_{j≤t}: the entering state's decay
        Ct = C.expand(-1, -1, units, -1) * total.exp()  # [b, seq, u, n]
        picked = rows.to(step.device)
        readout = torch.einsum("btun,bupn->btup", Ct.index_select(1, picked), state)
        if gate is not None:
            readout = readout * gate.index_select(1, picked)[..., None]
    if not coefficients:
        return None, readout
    per_unit = batch * max(seq * size, ROWS * ROWS * max(width, size))
    unit_block = max(1, BLOCK_ELEMENTS // per_unit)
    out = step.new_zeros(batch, units, rows.numel(), seq)
    for first in range(0, seq, ROWS):
        lo, hi = first, min(seq, first + ROWS)
        here = ((rows >= lo) & (rows < hi)).nonzero().flatten()
        if not here.numel():
            continue
        local, at = (rows[here] - lo).to(step.device), here.to(step.device)
        for u0 in range(0, units, unit_block):
            u1 = min(units, u0 + unit_block)
            block = _scan_rows(log_decay[:, :, u0:u1], _units(B, u0, u1), _units(C, u0, u1), step[:, :, u0:u1], lo, hi)
            if skip is not None:
                diagonal = torch.arange(lo, hi, device=step.device)
                block[:, :, torch.arange(hi - lo, device=step.device), diagonal] += skip[u0:u1, None]
            if gate is not None:
                block = block * gate[:, lo:hi, u0:u1].permute(0, 2, 1)[..., None]
            out[:, u0:u1, at, :hi] = block.index_select(2, local)
    return out, readout


def _units(x: torch.Tensor, u0: int, u1: int) -> torch.Tensor:
    return x if x.shape[2] == 1 else x[:, :, u0:u1]


def _scan_rows(log_decay, B, C, step, lo, hi):
    """Rows ``lo .. hi − 1`` of ``A`` over columns ``0 .. hi − 1``: ``[b, u, hi − lo, hi]``."""
    units = log_decay.shape[2]
    inside = log_decay[:, lo:hi]
    local = inside.cumsum(dim=1)  # Σ_{lo≤j≤t}, [b, L, u, m]
    length = hi - lo
    block = step.new_zeros(B.shape[0], units, length, hi)
    if lo:
        # Columns s < lo: Σ_{s<j≤t} = Σ_{lo≤j≤t} + Σ_{s<j<lo}, both ≤ 0, so the exponential factorizes.
        before = log_decay[:, :lo]
        suffix = before.flip(1).cumsum(1).flip(1)  # Σ_{s≤j<lo}
        after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], dim=1)  # Σ_{s<j<lo}
        reads = C[:, lo:hi] * local.exp()  # [b, L, u, n]
        writes = B[:, :lo] * after.exp() * step[:, :lo, :, None]  # [b, lo, u, n]
        block[..., :lo] = torch.einsum("btun,bsun->buts", reads.expand(-1, -1, units, -1), writes.expand(-1, -1, units, -1))
    causal = torch.ones(length, length, dtype=torch.bool, device=step.device).tril()
    exponent = (local[:, :, None] - local[:, None, :]).masked_fill(~causal[None, :, :, None, None], float("-inf"))  # [b, t, s, u, m]
    weights = exponent.exp() * C[:, lo:hi, None] * B[:, None, lo:hi]  # [b, t, s, u, n]
    block[..., lo:hi] = weights.sum(-1).permute(0, 3, 1, 2) * step[:, lo:hi].permute(0, 2, 1)[:, :, None, :]
    return block


def _ssd(a: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    limit = a.get("dt_limit")
    return ssd_attention(
        a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(limit) if limit is not None else None, a.get("state"), positions, heads, coefficients,
    )


def _selective_scan(a: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    return selective_scan_attention(
        a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        a.get("state"), positions, channels, coefficients,
    )


#: Mamba-2's chunk scan and decode step.
SSD_ATTENTION = EffectiveSpec("state space duality", _ssd, "heads")
#: Mamba-1's selective scan and decode step.
SCAN_ATTENTION = EffectiveSpec("selective scan", _selective_scan, "channels")
