"""Exact effective attention of a recurrent mixer, from its kernel call's arguments.

Mental model. Given everything but the values (the queries, keys, decays,
write strengths, gates), a recurrent mixer's kernel output is *linear* in the
values it is fed, so it is exactly an attention pattern over them plus the
readout of the state entering the call:

    out_t = Σ_{s ≤ t} A[t, s] v_s  +  readout_t(state entering)

``A`` is ``[batch, heads, seq, seq]`` (a value head of a gated DeltaNet,
a Mamba-2 head) or ``[batch, channels, seq, seq]`` (Mamba-1, whose decays
differ per channel). It is the kernel's own coefficient, not an estimate:
``Σ_s A[t, s] v_s + readout_t`` reproduces the kernel's output within float32
rounding.

* Gated delta rule (gated DeltaNet, a scalar decay per head) and Kimi delta
  attention (a decay per key channel). The state is affine in the values:
  ``S_t = Σ_s p_{t,s} v_sᵀ + R_t S_in`` with ``p_{t,s}`` the key channel
  "column" of token ``s`` in the state after ``t`` (the WY/UT form folds each
  later token's delta-rule correction into it), so ``A[t, s] = q_tᵀ p_{t,s}``
  with ``q`` normalized as the kernel does (l2 norm when
  ``use_qk_l2norm``, then ``key_dim^-½``). Inside a chunk of ``L`` tokens
  starting from ``S_0`` (``c`` the cumulated log decay from the chunk start,
  ``⊙`` per key row):

      δ = T v − W S_0,   T = (I + diag(β) M)⁻¹ diag(β),   W = T (e^{c} ⊙ K)
      M_ij = Σ_d k_i e^{c_i − c_j} k_j  (j < i),   Q_ij = Σ_d q_i e^{c_i − c_j} k_j  (j ≤ i)
      out = Q T v + (e^{c} ⊙ Q_rows − Q W) S_0
      S_L = e^{c_L} ⊙ S_0 + K_dᵀ δ,   K_d = K ⊙ e^{c_L − c}

  so a chunk's rows of ``A`` are ``Q T`` on its own tokens and
  ``(e^{c} ⊙ q − Q W) P`` on earlier ones, and ``P`` (``[key_dim, seq]``
  per head: the state's coefficient on every earlier value) is carried from
  chunk to chunk. Cost: about ``key_dim · seq²`` multiply-adds per head.
* Mamba-2 (SSD) and Mamba-1 (selective scan): the writes do not depend on the
  state, so ``A[t, s] = gate_t (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j A[n]) Δ_s
  + D δ_ts)``: one decay per head on Mamba-2 (``A`` per head), one per
  (channel, state entry) on Mamba-1. The skip ``D x_t`` is the diagonal. The
  gate is ``silu(z_t)`` where the kernel applies it (Mamba-1's kernels; none
  on Mamba-2's chunk scan, whose gate is a norm after it: that ``A`` is the
  scan's output before the gate, and so it is on the one Mamba-2 decode
  kernel that gates inside, Falcon-H1's without ``mamba_rms_norm``, whose
  gate is per channel).

Numerics: every exponent is a sum of log decays over ``s < j ≤ t`` (≤ 0),
accumulated from a nearby anchor, never a difference of two long prefix
sums; everything runs in float32, the time step ``Δ`` in ``dt``'s dtype
first as the kernels compute it.

Memory: the result is ``4 · batch · heads · seq²`` bytes (Mamba-1:
``channels`` for ``heads``, 1536 channels on Mamba-130m: 6 GB for 1000
tokens), plus ``4 · batch · heads · key_dim · seq`` bytes of carried ``P`` on
a DeltaNet and bounded blocks elsewhere. ``positions=`` (rows ``t``) and
``heads=`` / ``channels=`` keep it bounded: the result is then
``[batch, len(selection), len(positions), seq]``.

Pure torch: nothing here imports nnsight or the rest of nnterp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .delta import CHUNK_SIZE, rsqrt_l2norm, sqrt_l2norm
from .step import step_size

#: Elements a temporary block may hold (float32: 64 MiB) on the scans.
BLOCK_ELEMENTS = 1 << 24
#: Rows of ``A`` a scan computes at once.
ROWS = 64

Selection = Sequence[int] | torch.Tensor | range | slice | int | None


def indices(selection: Selection, size: int, what: str) -> torch.Tensor:
    """``selection`` (``None`` for all, an int, a slice, a range, a sequence, a tensor) as a long tensor in ``[0, size)``."""
    if selection is None:
        return torch.arange(size)
    if isinstance(selection, slice):
        return torch.arange(size)[selection]
    if isinstance(selection, int):
        selection = [selection]
    index = torch.as_tensor(list(selection) if isinstance(selection, range) else selection, dtype=torch.long).reshape(-1).cpu()
    index = torch.where(index < 0, index + size, index)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
        raise IndexError(f"{what} out of range for {size}: {selection}")
    return index


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, seq, groups, d]`` -> ``[b, seq, heads, d]``, each group serving ``heads // groups`` consecutive heads."""
    groups = x.shape[2]
    if groups == heads:
        return x
    if heads % groups:
        raise ValueError(f"{heads} heads is not a multiple of {groups} groups")
    return x.repeat_interleave(heads // groups, dim=2)


# -- the delta rule ----------------------------------------------------------------------


def gated_delta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    positions: Selection = None,
    heads: Selection = None,
    chunk_size: int = CHUNK_SIZE,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gated delta rule's effective attention (transformers' ``torch_chunk_gated_delta_rule``).

    Args:
        query, key: ``[batch, seq, key_heads, key_dim]`` as the kernel takes
            them (before its l2 norm); each key head serves ``value_heads //
            key_heads`` consecutive value heads.
        g: ``[batch, seq, value_heads]``, the log decay; beta: ``[batch, seq, value_heads]``.
        initial_state: ``[batch, value_heads, key_dim, value_dim]`` or ``None``.
        use_qk_l2norm: the kernel's ``use_qk_l2norm_in_kernel``.
        positions: the rows ``t`` to return (``None``: every token).
        heads: the value heads to return (``None``: all).
        coefficients: ``False`` computes the readout only (``A`` is ``None``):
            no ``seq²`` memory.

    Returns:
        ``(A [batch, heads, positions, seq], readout)``: the kernel's output at
        ``t`` is ``Σ_s A[:, h, t, s] v[:, s, h] + readout[:, t, h]``, with
        ``readout [batch, positions, heads, value_dim]`` the entering state's
        part, ``None`` without one. Float32.
    """
    return _delta_attention(query, key, g.float()[..., None], beta, initial_state, use_qk_l2norm, rsqrt_l2norm, positions, heads, chunk_size, coefficients)


def kimi_delta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    positions: Selection = None,
    heads: Selection = None,
    chunk_size: int = CHUNK_SIZE,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The same for Kimi delta attention: ``g`` is ``[batch, seq, heads, key_dim]``, Kimi's l2 norm."""
    if g.dim() != 4 or g.shape[-1] != key.shape[-1]:
        raise ValueError(f"kimi_delta_attention: g must be [batch, seq, heads, key_dim], got {tuple(g.shape)}")
    return _delta_attention(query, key, g.float(), beta, initial_state, use_qk_l2norm, sqrt_l2norm, positions, heads, chunk_size, coefficients)


def _delta_attention(query, key, g, beta, initial_state, use_qk_l2norm, l2norm, positions, heads, chunk_size, coefficients):
    """Shared body; ``g`` is ``[b, seq, h, 1 | key_dim]``."""
    batch, seq, value_heads = beta.shape
    k_dim = key.shape[-1]
    rows = indices(positions, seq, "positions")
    chosen = indices(heads, value_heads, "heads").to(beta.device)
    query, key = (_expand(x.float(), value_heads).index_select(2, chosen) for x in (query, key))
    if use_qk_l2norm:
        query, key = l2norm(query), l2norm(key)
    query = query * k_dim**-0.5
    # [b, h, seq, ...]
    q, k = query.transpose(1, 2), key.transpose(1, 2)
    g = g.index_select(2, chosen).transpose(1, 2)
    beta = beta.float().index_select(2, chosen).transpose(1, 2)[..., None]
    carried = None  # the entering state's part of the state, [b, h, key_dim, value_dim]
    if initial_state is not None:
        carried = initial_state.to(device=q.device, dtype=torch.float32).index_select(1, chosen)
    P = q.new_zeros(batch, chosen.numel(), k_dim, 0)  # the state's coefficient on every value so far
    out = q.new_zeros(batch, chosen.numel(), rows.numel(), seq) if coefficients else None
    readout = q.new_zeros(batch, chosen.numel(), rows.numel(), carried.shape[-1]) if carried is not None else None
    last = int(rows.max()) if rows.numel() else -1
    if not coefficients and carried is None:
        last = -1
    size = max(1, chunk_size)
    for lo in range(0, last + 1, size):
        hi = min(seq, lo + size)
        length = hi - lo
        qm, km, bm = q[:, :, lo:hi], k[:, :, lo:hi], beta[:, :, lo:hi]
        cm = g[:, :, lo:hi].cumsum(dim=2)  # [b, h, L, 1 | dk], ≤ 0
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        M = _scores(km, km, cm, causal)
        Q = _scores(qm, km, cm, causal)
        eye = torch.eye(length, dtype=torch.float32, device=q.device)
        system = (M * bm).tril(-1) + eye
        # T = system⁻¹ diag(β) and W = T (e^c ⊙ K), from one triangular solve.
        rhs = torch.cat([torch.diag_embed(bm[..., 0]), km * bm * cm.exp()], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        T, W = solved[..., :length], solved[..., length:]
        reads = qm * cm.exp() - Q @ W  # [b, h, L, dk]: how the chunk's rows read S_0
        here = ((rows >= lo) & (rows < hi)).nonzero().flatten()
        if here.numel():
            local, at = (rows[here] - lo).to(q.device), here.to(q.device)
            if coefficients:
                out[:, :, at, lo:hi] = (Q @ T).index_select(2, local)
                out[:, :, at, :lo] = reads.index_select(2, local) @ P
            if carried is not None:
                readout[:, :, at] = reads.index_select(2, local) @ carried
        if hi > last:
            break
        end = cm[:, :, -1:]  # c_L, [b, h, 1, 1 | dk]
        Kd = km * (end - cm).exp()  # [b, h, L, dk]
        decay = end.exp().transpose(-1, -2)  # [b, h, 1 | dk, 1]: per key row
        if coefficients:
            P = torch.cat([decay * P - Kd.transpose(-1, -2) @ (W @ P), Kd.transpose(-1, -2) @ T], dim=-1)
        if carried is not None:
            carried = decay * carried - Kd.transpose(-1, -2) @ (W @ carried)
    return out, (readout.transpose(1, 2) if readout is not None else None)


def _scores(x: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``Σ_d x_i[d] exp(c_i[d] − c_j[d]) k_j[d]`` for ``j ≤ i`` (else 0): ``[b, h, L, L]``."""
    if cum.shape[-1] == 1:
        decay = (cum[..., :, None, 0] - cum[..., None, :, 0]).masked_fill(~causal, float("-inf")).exp()
        return (x @ k.transpose(-1, -2)) * decay
    decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    return (x[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)


# -- the scans: Mamba-2 and Mamba-1 --------------------------------------------------------


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
    B, C = (_expand(x.float(), n_heads).index_select(2, chosen) for x in (B, C))
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


# -- by the signature table's names ------------------------------------------------------------


@dataclass(frozen=True)
class EffectiveSpec:
    """What a component's effective attention computes from its kernel call, by its signature table's names.

    ``compute(arguments, positions, selection, coefficients)`` takes the
    call's arguments tokens first (the layouts applied) and returns ``(A,
    readout)`` (``A`` is ``None`` when ``coefficients`` is false);
    ``axis`` names what ``selection`` picks on axis 1 (``"heads"`` or
    ``"channels"``).
    """

    name: str
    compute: Callable[[dict, Any, Any, bool], tuple]
    axis: str

    def __repr__(self) -> str:
        return f"EffectiveSpec({self.name})"


def _gated_delta(a: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    return gated_delta_attention(
        a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients,
    )


def _kimi_delta(a: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    return kimi_delta_attention(
        a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients,
    )


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


#: transformers' gated delta rule kernels (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_DELTA_ATTENTION = EffectiveSpec("gated delta rule", _gated_delta, "heads")
#: Kimi delta attention's kernels (Kimi-Linear).
KIMI_DELTA_ATTENTION = EffectiveSpec("Kimi delta attention", _kimi_delta, "heads")
#: Mamba-2's chunk scan and decode step.
SSD_ATTENTION = EffectiveSpec("state space duality", _ssd, "heads")
#: Mamba-1's selective scan and decode step.
SCAN_ATTENTION = EffectiveSpec("selective scan", _selective_scan, "channels")
