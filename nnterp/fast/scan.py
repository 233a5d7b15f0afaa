"""Writing the state after every token of a decayed sum of rank-one writes, in place.

Mental model: gated DeltaNet, Kimi and Mamba-2 all carry, per head, a
matrix state that each token decays and adds one outer product to:

    S_t = D_t S_{t-1} + a_t b_tᵀ          S: [rows, cols]

with ``D_t = exp(g_t)``, a scalar per head or one factor per row. What
``a`` and ``b`` are differs (a DeltaNet writes ``k ⊗ δ`` once its deltas
are known, Mamba-2 writes ``Δx ⊗ B``); once they are known, every state is
a linear function of the start state and the writes. For a run of ``f``
tokens starting after state ``S``, with ``c_i = g_1 + … + g_i`` (≤ 0):

    S_i = exp(c_i) ⊙ S + Σ_{j≤i} exp(c_i − c_j) ⊙ a_j b_jᵀ

`fill_states` writes the states straight into the output, by one of two
fills of the same values:

* token by token (`step_states`): ``S_t = D_t S_{t-1} + a_t b_tᵀ`` as one
  multiply into the output and one rank-one update added in place, each
  vectorized over batch rows and heads, reading ``S_{t-1}`` while it is still
  in cache: two passes over a state per token, the fewest a decay-then-add can
  make (measured 1.8x the time of merely filling the output), and the fastest
  on a CPU; but two kernel launches per token, launch-bound on a GPU;
* by closed-form blocks (`block_states`), no loop over tokens: the formula
  above for every token of a block of ``C`` from the block's entering state,
  one batched matmul (``[rows, C] @ [C, cols]`` per token and head, the left
  factor ``exp(c_i − c_j) a_j`` with the exponent taken under the causal mask:
  every exponent ≤ 0, a masked one −∞, nothing overflows however strong the
  decays) plus one broadcast multiply-add of the entering state; the blocks in
  sequence, each entering with the last state of the one before. A handful of
  launches per block, at ``C`` multiply-adds per element of the output
  instead of two. Its factors are ``batch · heads · rows · C²`` elements: ``C``
  is cut to keep them under `FACTOR_ELEMENTS`.

The blocks serve the devices in `LOOP_FREE`, autograd (in-place steps on a
buffer the graph keeps would break it; there in blocks of `FILL` tokens, which
bounds what the graph keeps), and states stored in another dtype than float32.

Precision. A block is computed in float32 (float64 when its inputs are) and
its last state carried to the next block in that dtype, never read back from
the output: states stored in bfloat16 are each rounded once, within
`BF16_RTOL` (``2⁻⁸``) of their magnitude plus float32's own error, at any
length and block size. In float32 the two fills agree within float32
rounding (the sums run in another order).

The same recurrence read as attention (`scan_attention`): where the writes do
not depend on the state (Mamba-2's SSD, a decay per head; Mamba-1's selective
scan, a decay per channel and state entry), the output
``Σ_n C_t[n] S_t[:, n]`` is ``Σ_s A[t, s] x_s`` with ``A[t, s] = Σ_n C_t[n]
B_s[n] exp(Σ_{s<j≤t} g_j[n]) Δ_s`` (plus the skip on the diagonal and the
gate), computed in blocks of rows and of heads or channels.
"""

from __future__ import annotations

import math

import torch

from .spec import indices

#: Tokens per block of `block_states` (``C``), at most: fewer where its factors would pass `FACTOR_ELEMENTS`.
BLOCK = 64
#: Elements the left factors of one block of `block_states` may hold (float32: 64 MiB).
FACTOR_ELEMENTS = 1 << 24
#: The relative error of a state stored in bfloat16: one rounding to 8 significant bits.
BF16_RTOL = 2.0**-8
#: Tokens per block under autograd (the graph keeps each block's factors, ``rows · FILL²`` per head).
FILL = 4
#: The device types whose fill runs by closed-form blocks without autograd too (on a CPU the token loop is faster:
#: docs/performance.md).
LOOP_FREE = frozenset({"cuda"})
#: Bytes of states read out by one matmul (`step_states` with ``read``): a block of tokens still in cache.
READ_BYTES = 4 * 2**20
#: Elements a temporary block of `scan_attention` may hold (float32: 64 MiB).
BLOCK_ELEMENTS = 1 << 24
#: Rows of ``A`` `scan_attention` computes at once.
ROWS = 64
#: A block of `ROWS` rows with fewer than 1 / SPARSE of them asked is computed a row at a time (`_scan_row`).
SPARSE = 4


def fill_states(
    out: torch.Tensor, first: int, start: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    fill: int | None = None, read: torch.Tensor | None = None, read_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write the states after tokens ``first .. first + n - 1`` into ``out``, by the fill that suits (module docstring).

    Args:
        out: ``[batch, seq, heads, rows, cols]``, written at ``[:, first:first + n]``
            (a ring with fewer tokens: `step_states`); float32, or another
            dtype to store the states in (then by blocks).
        start: ``[batch, heads, rows, cols]``, the state before token ``first``
            (may be a view of ``out``).
        g: ``[batch, heads, n, 1 | rows]``, each token's log decay (≤ 0).
        a: ``[batch, heads, n, rows]``; b: ``[batch, heads, n, cols]`` (a
            stride-0 expansion over heads is fine): token ``j`` adds
            ``a_j ⊗ b_j`` after the decay.
        fill: tokens per block where the blocks run (`FILL` under autograd,
            `BLOCK` otherwise).
        read, read_rows: also each state's readout (`step_states`).

    Returns:
        ``(last, readout)``: the state after the last token, float32 (a view of
        ``out`` from the token loop, a new tensor from the blocks: the state
        the next tokens start from), and the readout or ``None``.
    """
    graph = differentiable(start, g, a, b, read)
    if graph or loop_free(out):
        return block_states(out, first, start, g, a, b, (FILL if graph else None) if fill is None else fill, read, read_rows)
    readout = step_states(out, first, start, g, a, b, read, read_rows)
    n = g.shape[2]
    return (out[:, (first + n - 1) % out.shape[1]] if n else start), readout


def loop_free(out: torch.Tensor) -> bool:
    """Whether a fill into ``out`` runs by closed-form blocks without autograd too: on a device in `LOOP_FREE`, or
    into states stored in another dtype than float32 (the token loop reads each state back from the output)."""
    return out.device.type in LOOP_FREE or out.dtype != torch.float32


def step_states(
    out: torch.Tensor, first: int, start: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    read: torch.Tensor | None = None, read_rows: bool = False,
) -> torch.Tensor | None:
    """`fill_states` token by token, in place (no autograd); with ``read``, also each state's readout.

    ``read``: ``[batch, heads, n, cols]``; returns ``[batch, heads, n, rows]``,
    ``S_t read_t`` for every token, computed while ``S_t`` is in cache (the
    output of a linear-attention or SSD kernel, before its skip term). With
    ``read_rows``, ``read`` is ``[batch, heads, n, rows]`` and the readout
    ``read_tᵀ S_t`` ``[batch, heads, n, cols]`` (an mLSTM reads its memory by
    the key axis, the rows).
    ``out`` may hold fewer tokens than are written (a ring: token ``first + t``
    goes to slot ``(first + t) % out.shape[1]``; two slots keep the last state
    only), for a readout without the states.
    """
    n = g.shape[2]
    decay = g.float().exp()[..., None]  # [b, h, n, 1 | rows, 1]
    # A strided operand (a triangular solve returns its result column-major) makes the update several times slower.
    a, b = a.contiguous(), b.contiguous()
    readout = None if read is None else a.new_empty(a.shape[0], a.shape[1], n, (b if read_rows else a).shape[-1], dtype=torch.float32)
    previous = start
    ring = out.shape[1] < first + n
    # Every per-token view made at once (unbind): indexing in the loop costs as much as the arithmetic on small states.
    slots = out.unbind(1) if ring else out[:, first:first + n].unbind(1)
    decays, rows, cols = decay.unbind(2), a[..., None].unbind(2), b[..., None, :].unbind(2)
    # A ring keeps too few states to read a block of them: there each state is read as it is written.
    block = 1 if ring or read is None else read_block(slots[0].numel())
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        for t in range(lo, hi):
            state = slots[(first + t) % len(slots)] if ring else slots[t]
            torch.mul(previous, decays[t], out=state)
            state.addcmul_(rows[t], cols[t])
            previous = state
        if read is not None:
            _read(out, first, lo, hi, previous if ring else None, read, readout, read_rows)
    return readout


def block_size(batch: int, heads: int, rows: int, size: int | None = None) -> int:
    """Tokens per block: ``size`` (`BLOCK` by default), fewer where a block's factors would pass `FACTOR_ELEMENTS`."""
    size = BLOCK if size is None else size
    return max(1, min(size, math.isqrt(max(1, FACTOR_ELEMENTS // max(1, batch * heads * rows)))))


def block_states(
    out: torch.Tensor, first: int, start: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    size: int | None = None, read: torch.Tensor | None = None, read_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write the states after tokens ``first .. first + n - 1`` into ``out``, a block of tokens at a time.

    Args:
        out: ``[batch, seq, heads, rows, cols]`` of any floating dtype (the
            states are stored in it), written at ``[:, first:first + n]``; with
            fewer than ``first + n`` tokens, a ring: only each block's last state
            is stored, in slot ``t % out.shape[1]`` (a readout without the states).
        start: ``[batch, heads, rows, cols]``, the state before token ``first``.
        g: ``[batch, heads, n, 1 | rows]``, each token's log decay (≤ 0).
        a: ``[batch, heads, n, rows]``; b: ``[batch, heads, n, cols]``:
            token ``j`` adds ``a_j ⊗ b_j`` after the decay (a stride-0
            expansion over heads is fine).
        size: tokens per block (`block_size`).
        read: ``[batch, heads, n, cols]`` (``read_rows``: ``[..., rows]``):
            also each state's readout ``S_t read_t`` (``read_tᵀ S_t``).

    Returns:
        ``(last, readout)``: the state after the last token ``[batch, heads,
        rows, cols]`` in the computing dtype (float32, or float64), a new
        tensor, not a view of ``out``; the readout ``[batch, heads, n, rows |
        cols]`` or ``None``. Under autograd both are functions of the inputs.
    """
    batch, heads, n, rows = a.shape
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    size = block_size(batch, heads, rows, size)
    state = start.to(dtype)
    ring = out.shape[1] < first + n
    readout = []
    causal = torch.ones(size, size, dtype=torch.bool, device=a.device).tril()
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        cum = g[:, :, lo:hi].to(dtype).cumsum(2)  # [b, h, L, 1 | rows]
        mask = causal[: hi - lo, : hi - lo, None]
        exponent = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(~mask, float("-inf"))  # [b, h, i, j, 1 | rows]
        left = (exponent.exp() * a[:, :, None, lo:hi].to(dtype)).permute(0, 2, 1, 4, 3)  # [b, i, h, rows, j]
        right = b[:, None, :, lo:hi].to(dtype)  # [b, 1, h, j, cols], the same for every i
        states = torch.matmul(left, right)  # [b, i, h, rows, cols]: the layout of out
        states = states + cum.exp().transpose(1, 2)[..., None] * state[:, None]
        if ring:
            out[:, (first + hi - 1) % out.shape[1]] = states[:, -1]
        else:
            out[:, first + lo : first + hi] = states
        if read is not None:
            vectors = read[:, :, lo:hi].to(dtype).transpose(1, 2)[..., None, :]  # [b, i, h, 1, rows | cols]
            got = torch.matmul(vectors, states if read_rows else states.transpose(-1, -2))
            readout.append(got.squeeze(-2).transpose(1, 2))
        state = states[:, -1].clone()  # not a view: it would keep the block alive
    if read is None:
        return state, None
    if not readout:
        return state, a.new_zeros(batch, heads, 0, (b if read_rows else a).shape[-1], dtype=dtype)
    return state, torch.cat(readout, 2)


def read_block(numel: int) -> int:
    """Tokens read out at once (`READ_BYTES` of float32 states), for states of ``numel`` elements per token."""
    return max(1, READ_BYTES // (numel * 4))


def _read(out, first, lo, hi, state, read, readout, read_rows) -> None:
    """The readout of tokens ``lo .. hi - 1``, whose states were just written (still in cache): one batched matmul.

    The states are ``[batch, tokens, heads, rows, cols]``: the read vectors are laid
    out the same way (they are small), so the states are read in place. Both
    directions multiply a row vector by a matrix: ``S @ r`` as a matrix times a
    column measured several times slower on CPU than ``rᵀ @ Sᵀ``.
    """
    states = state[:, None] if state is not None else out[:, first + lo : first + hi]
    vectors = read[:, :, lo:hi, None, :].transpose(1, 2)  # [b, tokens, h, 1, rows | cols]
    got = torch.matmul(vectors, states if read_rows else states.transpose(-1, -2))  # [b, tokens, h, 1, cols | rows]
    readout[:, :, lo:hi] = got.squeeze(-2).transpose(1, 2)


def differentiable(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a computation on ``tensors`` (then ``out=`` and in-place reuse are avoided)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def scan_attention(log_decay, B, C, step, skip, gate, state, positions, coefficients=True):
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
    row_block = max(1, BLOCK_ELEMENTS // (batch * seq * size))
    out = step.new_zeros(batch, units, rows.numel(), seq)
    for first in range(0, seq, ROWS):
        lo, hi = first, min(seq, first + ROWS)
        here = ((rows >= lo) & (rows < hi)).nonzero().flatten()
        if not here.numel():
            continue
        if here.numel() * SPARSE < hi - lo:
            # A few rows of the block (a knockout's targets): each alone, not the block's every row.
            for index in here.tolist():
                t = int(rows[index])
                for u0 in range(0, units, row_block):
                    u1 = min(units, u0 + row_block)
                    row = _scan_row(log_decay[:, :, u0:u1], _units(B, u0, u1), _units(C, u0, u1), step[:, :, u0:u1], t)
                    if skip is not None:
                        row[:, :, t] += skip[u0:u1]
                    if gate is not None:
                        row = row * gate[:, t, u0:u1, None]
                    out[:, u0:u1, index, : t + 1] = row
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


def _scan_row(log_decay, B, C, step, t):
    """Row ``t`` of ``A`` over columns ``0 .. t``: ``[b, u, t + 1]``, the decays summed from ``t`` back (no
    difference of two running sums, so no cancellation however long the prompt)."""
    after = log_decay[:, 1 : t + 1].flip(1).cumsum(1).flip(1)  # Σ_{s<j≤t} for s < t
    after = torch.cat([after, torch.zeros_like(log_decay[:, :1])], dim=1)  # [b, t + 1, u, m]; s = t: nothing decays
    weights = (after.exp() * B[:, : t + 1] * C[:, t : t + 1]).sum(-1)  # [b, t + 1, u]
    return (weights * step[:, : t + 1]).permute(0, 2, 1)


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
