"""The delta rules' effective attention: gated DeltaNet (a scalar decay per head) and Kimi (a decay per key channel).

The state is affine in the values:
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

Shapes, selection and numerics as in `nnterp.fast.effective`. Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch

from .delta import CHUNK_SIZE, rsqrt_l2norm, sqrt_l2norm
from .effective import EffectiveSpec, Selection, expand_groups, indices


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
    query, key = (expand_groups(x.float(), value_heads).index_select(2, chosen) for x in (query, key))
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


def _gated_delta(a: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    return gated_delta_attention(
        a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients,
    )


def _kimi_delta(a: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    return kimi_delta_attention(
        a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients,
    )


#: transformers' gated delta rule kernels (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_DELTA_ATTENTION = EffectiveSpec("gated delta rule", _gated_delta, "heads")
#: Kimi delta attention's kernels (Kimi-Linear).
KIMI_DELTA_ATTENTION = EffectiveSpec("Kimi delta attention", _kimi_delta, "heads")
