"""The delta rule of the gated DeltaNet and of Kimi delta attention: the state after every token, the kernel's output, the effective attention.

Mental model. Per value head the state ``S`` is ``[key_dim, value_dim]``
(rows are key channels). Token ``t`` decays it and writes a correction:

    S_t = D_t S_{t-1} + k_t δ_tᵀ,   δ_t = β_t (v_t − (D_t S_{t-1})ᵀ k_t)

with ``D_t = exp(g_t)`` a scalar per head (the gated DeltaNet: Qwen3.5,
Qwen3-Next, OLMo-Hybrid; ``g`` ``[batch, seq, heads]``) or ``diag(exp(g_t))``
per key channel (Kimi delta attention; ``g`` ``[batch, seq, heads, key_dim]``).
Shapes, tokens first: ``q``, ``k`` ``[batch, seq, key_heads, key_dim]`` (each
key head serves ``heads // key_heads`` consecutive value heads), ``v``
``[batch, seq, heads, value_dim]``, ``beta`` ``[batch, seq, heads]``, a state
``[batch, heads, key_dim, value_dim]``. Conventions: ``q`` and ``k`` are
l2-normalized when ``use_qk_l2norm`` (the gated DeltaNet's ``x rsqrt(Σx² +
eps)``, Kimi's ``x / sqrt(Σx² + eps)``: `rsqrt_l2norm`, `sqrt_l2norm`), then
``q`` is scaled by ``key_dim^-½``; ``g`` is the log decay (≤ 0).

States (`gated_delta_states`, `kimi_delta_states`). Inside a chunk of ``L``
tokens starting from ``S_0``, with ``c_i = g_1 + … + g_i`` (the cumulated log
decay, ≤ 0), unrolling gives

    S_i = exp(c_i) S_0 + Σ_{j≤i} exp(c_i − c_j) k_j δ_jᵀ          (1)

and the deltas of a chunk solve one unit-lower-triangular system (the UT
transform of the DeltaNet papers, as in transformers'
``torch_chunk_gated_delta_rule``):

    (I + A) δ = β v − β exp(c) ⊙ (K S_0),   A_ij = β_i k_iᵀ exp(c_i − c_j) k_j  (j < i)

so ``δ = U − W S_0`` with ``U``, ``W`` solved for every chunk at once. The
only sequential part is a loop over chunks: ``δ`` of chunk ``m`` from its
``S_0``, then (1) for all its tokens as one batched matmul written in place
into the output, whose last token is the next chunk's ``S_0``. Cost: ``L``
multiply-adds per element of the output, plus writing it once
(``docs/performance.md``).

Effective attention (`gated_delta_attention`, `kimi_delta_attention`). The
state is affine in the values, ``S_t = Σ_s p_{t,s} v_sᵀ + R_t S_in``, so
``A[t, s] = q_tᵀ p_{t,s}``. Per chunk (``⊙`` per key row):

    δ = T v − W S_0,   T = (I + diag(β) M)⁻¹ diag(β),   W = T (e^{c} ⊙ K)
    M_ij = Σ_d k_i e^{c_i − c_j} k_j  (j < i),   Q_ij = Σ_d q_i e^{c_i − c_j} k_j  (j ≤ i)
    out = Q T v + (e^{c} ⊙ Q_rows − Q W) S_0,   S_L = e^{c_L} ⊙ S_0 + K_dᵀ δ,   K_d = K ⊙ e^{c_L − c}

so a chunk's rows of ``A`` are ``Q T`` on its own tokens and ``(e^{c} ⊙ q −
Q W) P`` on earlier ones, with ``P`` (``[key_dim, seq]`` per head: the
state's coefficient on every earlier value) carried from chunk to chunk:
about ``key_dim · seq²`` multiply-adds per head. Selection and memory as in
`nnterp.fast.spec`.

Numerics: every exponent is ``c_i − c_j`` with ``j ≤ i`` or ``c_i`` (both
≤ 0, the rest masked to −∞ before ``exp``), never a positive cumulated log
decay; everything runs in float32. The failure mode worth knowing: grouped
key heads are expanded as the models expand them, each serving consecutive
value heads (``repeat_interleave``); a model grouping them the other way
(tiled) would get states of the wrong pairing without any error.

Two kinds, so the functions of `nnterp.fast.spec` are named per kind here
(``gated_states``, ``kimi_one_pass``, ...; `state_shape` serves both), and so
are the specs (``GATED_FAST``, ``KIMI_FAST``, ``GATED_EFFECTIVE``, ``KIMI_EFFECTIVE``).
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import empty_states
from .scan import fill_states
from .spec import EffectiveSpec, FastSpec, Selection, expand_groups, indices, last_state

#: Tokens per chunk of the UT transform, as transformers' chunk kernel.
CHUNK_SIZE = 64
#: Tokens per block of a per-key-channel decay's scores (`_channel_scores`).
SUB_BLOCK = 16


def rsqrt_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' gated-DeltaNet ``l2norm``: ``x * rsqrt(Σx² + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sqrt_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' Kimi ``l2norm``: ``x / sqrt(Σx² + eps)`` (FLA's Triton order)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_states(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True, chunk_size: int = CHUNK_SIZE,
    output: bool = False, out: torch.Tensor | None = None,
):
    """The state after every token of the gated delta rule (transformers' ``torch_recurrent_gated_delta_rule``).

    Args (shapes as in the module docstring):
        initial_state: the state entering the first token, or ``None`` (zeros).
        use_qk_l2norm: l2-normalize q and k (eps 1e-6) first; q is then scaled
            by ``key_dim ** -0.5`` either way.
        chunk_size: tokens per chunk (any length works; the last chunk may be short).
        output: also return the kernel's output.
        out: a ``[batch, seq, value_heads, key_dim, value_dim]`` buffer to write into (reused across calls, it
            saves the allocation): float32, or bfloat16 to store the states rounded once (`scan.BF16_RTOL`).

    Returns:
        ``states [batch, seq, value_heads, key_dim, value_dim]`` (float32;
        ``states[:, t]`` is the state after token ``t``, ``states[:, -1]`` the
        kernel's final state), or ``(output [batch, seq, value_heads,
        value_dim], states)`` with ``output=True``.
    """
    return _delta_states(query, key, value, g.float()[..., None], beta, initial_state, use_qk_l2norm, rsqrt_l2norm, chunk_size, output, out)


def kimi_delta_states(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True, chunk_size: int = CHUNK_SIZE,
    output: bool = False, out: torch.Tensor | None = None,
):
    """The same for Kimi delta attention (transformers' ``recurrent_kimi_delta_attention``).

    ``g`` is ``[batch, seq, heads, key_dim]``: a log decay per key channel,
    so the state's row ``k`` is multiplied by ``exp(g[..., k])``. The l2 norm
    is Kimi's (``x / sqrt(Σx² + eps)``). Other arguments and the return are
    as in `gated_delta_states`.
    """
    if g.dim() != 4 or g.shape[-1] != key.shape[-1]:
        raise ValueError(f"kimi_delta_states: g must be [batch, seq, heads, key_dim], got {tuple(g.shape)}")
    return _delta_states(query, key, value, g.float(), beta, initial_state, use_qk_l2norm, sqrt_l2norm, chunk_size, output, out)


def _chunked(x: torch.Tensor, chunks: int, size: int) -> torch.Tensor:
    """``[b, seq, h, d]`` -> ``[b, h, chunks, size, d]``, zero-padded at the end."""
    b, seq, h, d = x.shape
    x = x.transpose(1, 2)
    pad = chunks * size - seq
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, chunks, size, d)


def _delta_states(query, key, value, g, beta, initial_state, use_qk_l2norm, l2norm, chunk_size, want_output, out):
    """Shared body. ``g`` is ``[b, seq, h, 1]`` (a scalar per head) or ``[b, seq, h, key_dim]``."""
    batch, seq, heads, v_dim = value.shape
    k_dim = key.shape[-1]
    shape = (batch, seq, heads, k_dim, v_dim)
    if out is None:
        out = empty_states(shape, value.device)
    elif tuple(out.shape) != shape or not out.dtype.is_floating_point:
        raise ValueError(f"out must be a floating-point {shape} (float32, or another dtype to store the states in), got {out.dtype} {tuple(out.shape)}")
    query, key = (expand_groups(x, heads) for x in (query, key))
    size = max(1, min(chunk_size, seq))
    chunks = -(-seq // size)
    # [b, h, chunks, L, d], one copy each (the forward hands q, k, v over channel-first, the convolution's layout);
    # padded tokens have k = v = β = g = 0, so they write nothing.
    q, k, v, gc = (_chunked(x.float(), chunks, size) for x in (query, key, value, g))
    betas = _chunked(beta.float()[..., None], chunks, size)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * k_dim**-0.5
    cum = gc.cumsum(dim=3)  # c_i from each chunk's start, ≤ 0
    causal = torch.ones(size, size, dtype=torch.bool, device=value.device).tril()
    eye = torch.eye(size, dtype=torch.float32, device=value.device)
    # The UT transform of every chunk at once (it does not depend on the state).
    decay, scores = _decay_and_scores(k, cum, causal)  # W ⊙ (k_i · k_j), [b, h, chunks, L, L]
    system = (scores * betas).tril(-1) + eye
    grown = cum.exp()
    # (I + A)⁻¹ once, then two matmuls: a triangular solve with L right-hand sides and a matmul measured twice as
    # fast as one solve with key_dim + value_dim of them.
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    news, weights = inverse @ (v * betas), inverse @ (k * betas * grown)  # U and W of δ = U − W S_0
    if want_output:
        outputs = value.new_empty(batch, heads, chunks, size, v_dim, dtype=torch.float32)
        attention = _decay_and_scores(k, cum, causal, q, decay)[1]
        reads = q * grown
    if initial_state is None:
        start = value.new_zeros(batch, heads, k_dim, v_dim, dtype=torch.float32)
    else:
        start = initial_state.to(device=value.device, dtype=torch.float32)
    for m in range(chunks):
        first, length = m * size, min(size, seq - m * size)
        delta = news[:, :, m] - weights[:, :, m] @ start  # [b, h, L, dv]
        if want_output:
            outputs[:, :, m] = reads[:, :, m] @ start + attention[:, :, m] @ delta
        # The next chunk's S_0: float32 whatever the states are stored in (a view of out from the token loop).
        start = fill_states(out, first, start, gc[:, :, m, :length], k[:, :, m, :length], delta[:, :, :length])[0]
    if want_output:
        return outputs.reshape(batch, heads, chunks * size, v_dim)[:, :, :seq].transpose(1, 2), out
    return out


def _decay_and_scores(k, cum, causal, q=None, decay=None):
    """``W_ij = exp(c_i − c_j)`` (j ≤ i, else 0) and ``Σ_d x_i[d] W_ij[d] k_j[d]`` with ``x = q`` or ``k``.

    ``cum`` is ``[b, h, L, 1]`` (one decay per head: W is ``[b, h, L, L]``) or
    ``[b, h, L, dk]`` (per key channel: the sum runs over a ``[b, h, L, L, dk]`` product).
    ``decay``: ``W`` computed already (a scalar per head only).
    """
    x = k if q is None else q
    if cum.shape[-1] == 1:
        if decay is None:
            decay = (cum[..., :, None, 0] - cum[..., None, :, 0]).masked_fill(~causal, float("-inf")).exp()
        return decay, (x @ k.transpose(-1, -2)) * decay
    size = k.shape[-2]
    if size % SUB_BLOCK or size == SUB_BLOCK:
        decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        return decay, (x[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)
    return None, _channel_scores(x, k, cum, causal[:SUB_BLOCK, :SUB_BLOCK])


def _channel_scores(x, k, cum, causal):
    """``Σ_d x_i[d] exp(c_i[d] − c_j[d]) k_j[d]`` (j ≤ i) by blocks of `SUB_BLOCK` tokens, as FLA's kernels do.

    Within a diagonal block the exact ``[s, s, dk]`` product; for a block ``I``
    after a block ``J`` with ``b`` the last token of ``J``, ``exp(c_i − c_j) =
    exp(c_i − c_b) exp(c_b − c_j)`` with both exponents ≤ 0 (the cumulated log
    decay only falls), so the block is one matmul of bounded factors. The
    memory is ``[L, L]`` per head and chunk, not ``[L, L, dk]``.
    """
    s = causal.shape[0]
    n = k.shape[-2] // s
    xb, kb, cb = (t.unflatten(-2, (n, s)) for t in (x, k, cum))  # [..., n, s, dk]
    diag_decay = (cb[..., :, None, :] - cb[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    diag = (xb[..., :, None, :] * kb[..., None, :, :] * diag_decay).sum(-1)  # [..., n, s, s]
    bound = cb[..., -1:, :]  # c_b of each block J, [..., n, 1, dk]
    right = kb * (bound - cb).exp()  # k_j exp(c_b − c_j), [..., nJ, s, dk]
    later = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)  # I > J
    # x_i exp(c_i − c_b(J)) for I > J (−inf elsewhere: zero, never a positive exponent), [..., nI, nJ, s, dk]
    exponent = (cb[..., :, None, :, :] - bound.unsqueeze(-4)).masked_fill(~later[:, :, None, None], float("-inf"))
    left = xb[..., :, None, :, :] * exponent.exp()
    blocks = left @ right[..., None, :, :, :].transpose(-1, -2)  # [..., nI, nJ, s, s]
    index = torch.arange(n, device=k.device)
    blocks[..., index, index, :, :] = diag
    return blocks.transpose(-3, -2).reshape(*k.shape[:-2], n * s, n * s)


def gated_delta_attention(
    query: torch.Tensor, key: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True, positions: Selection = None, heads: Selection = None, chunk_size: int = CHUNK_SIZE,
    coefficients: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gated delta rule's effective attention (transformers' ``torch_chunk_gated_delta_rule``).

    Args (shapes as in the module docstring; ``query``, ``key`` before the l2 norm):
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
    query: torch.Tensor, key: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True, positions: Selection = None, heads: Selection = None, chunk_size: int = CHUNK_SIZE,
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


# -- by the signature table's names (`nnterp.fast.spec`) ---------------------------------


def _states(kind: Any, a: dict, out: torch.Tensor | None, **options: Any) -> Any:
    return kind(a.get("q", a["k"]), a["k"], a["v"], a["g"], a["beta"], a.get("state"), use_qk_l2norm=bool(a.get("l2norm") or False), out=out, **options)  # the states never read q (a replay keeps none)


def gated_states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_delta_states` of a served call's arguments."""
    return _states(gated_delta_states, arguments, out)


def kimi_states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`kimi_delta_states` of a served call's arguments."""
    return _states(kimi_delta_states, arguments, out)


def _one_pass(kind: Any, a: dict, out: torch.Tensor | None) -> tuple | None:
    # transformers' torch kernels cast every input to float32, compute in float32 and return the output in the
    # queries' dtype (the final state in float32): so does this, in a bfloat16 model too.
    y, out = _states(kind, a, out, output=True)
    return (y.to(a["q"].dtype).contiguous(), last_state(out, out.shape[1]).float() if a.get("final") else None), out


def gated_one_pass(arguments: dict, out: torch.Tensor | None) -> tuple | None:
    """The chunk kernel's ``(output, final state or None)`` with the states, in one pass."""
    return _one_pass(gated_delta_states, arguments, out)


def kimi_one_pass(arguments: dict, out: torch.Tensor | None) -> tuple | None:
    """Kimi's chunk kernel's ``(output, final state or None)`` with the states, in one pass."""
    return _one_pass(kimi_delta_states, arguments, out)


def state_shape(arguments: dict) -> tuple:
    """``(batch, heads, key_dim, value_dim)``, either kind."""
    v, k = arguments["v"], arguments["k"]
    return (v.shape[0], v.shape[2], k.shape[3], v.shape[3])


def gated_effective_attention(arguments: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    """`gated_delta_attention` of a served call's arguments."""
    a = arguments
    return gated_delta_attention(a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients)


def kimi_effective_attention(arguments: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    """`kimi_delta_attention` of a served call's arguments."""
    a = arguments
    return kimi_delta_attention(a["q"], a["k"], a["g"], a["beta"], a.get("state"), bool(a.get("l2norm") or False), positions, heads, coefficients=coefficients)


TOKENS = ("q", "k", "v", "g", "beta")
#: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_FAST = FastSpec("gated delta rule", gated_states, TOKENS, state_shape, one_pass=gated_one_pass, state_tokens=TOKENS[1:])
#: transformers' ``chunk_kimi_delta_attention`` (Kimi-Linear).
KIMI_FAST = FastSpec("Kimi delta attention", kimi_states, TOKENS, state_shape, one_pass=kimi_one_pass, state_tokens=TOKENS[1:])
#: transformers' gated delta rule kernels (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_EFFECTIVE = EffectiveSpec("gated delta rule", gated_effective_attention, "heads")
#: Kimi delta attention's kernels (Kimi-Linear).
KIMI_EFFECTIVE = EffectiveSpec("Kimi delta attention", kimi_effective_attention, "heads")
