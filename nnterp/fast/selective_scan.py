"""Mamba-1's selective scan: the state after every token (vectorized over chunks of tokens), its output, the effective attention.

Mental model. Every inner channel ``d`` keeps a state vector of ``n``
numbers; each token decays it entry by entry and writes one outer product:

    Δ_t = softplus(dt_t + dt_bias)                       [channels]
    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t          h: [channels, state_size]

Without autograd the states are written token by token, as the kernel's own
loop computes them (`_step`): per token one multiply into the output and one
update in place, vectorized over batch rows and channels, Δ a block of tokens
at a time, so no temporary is as long as the prompt; the kernel's output can be
read off each state while it is in cache (`selective_scan_output`, the fast
path's one pass). Under autograd (in-place writes into a buffer the graph keeps
would break it) they are computed in chunks:

A is constant over time, so over a run of tokens the decays multiply to
``exp(A ⊙ Σ Δ_j)``: with ``S_i = Δ_1 + … + Δ_i`` counted from a run's
start, the state after its token ``i`` is ``local_i + exp(A ⊙ S_i) ⊙ h_start``,
where ``local_i`` is the run's own recurrence from zeros. So, for chunks of
``L`` tokens (`selective_scan_states`):

1. ``local`` for every chunk at once: a loop over the ``L`` positions of a
   chunk, each step vectorized over all chunks (the kernel's own update,
   ``exp(Δ A) ⊙ h + (Δ B) x``);
2. the state entering each chunk: a loop over chunks on one state each;
3. ``exp(A ⊙ S_i) ⊙ h_start`` added to every token of every chunk: a loop
   over the ``L`` positions again.

About ``2L + seq / L`` vectorized steps (``L`` ≈ √seq), each on ``seq / L``
states, then copied into the output.

Numerics: every exponent is ``Δ·A`` or ``A ⊙ S_i`` with ``A < 0`` and ``Δ,
S ≥ 0``, never positive; float32 throughout, Δ computed in ``dt``'s own
dtype as the kernel computes it (`nnterp.fast.step`). The states equal the
kernel's token loop within float32 rounding.

transformers' prompt kernel (``mamba_selective_scan``) has no initial state:
it always starts from zeros. `selective_scan_readout` is what a start state
``h_0`` adds to its result, ``silu(z_t) ⊙ Σ_n C_t[n] exp(A ⊙ S_t) h_0`` on the
output and ``exp(A ⊙ S_last) h_0`` on the final state (the recurrence is
linear in ``h_0``), which is how a kernel call is continued from a written
state (`resume`). The failure mode worth knowing: the prompt kernel has no
argument to carry a written state into the call, so anything continuing a
Mamba-1 prompt from a state must add this readout itself, or it silently
starts from zeros.

Shapes, tokens first: ``x``, ``dt``, ``z`` ``[batch, seq, channels]``, ``A``
``[channels, state_size]``, ``B``, ``C`` ``[batch, seq, state_size]``, ``D``,
``dt_bias`` ``[channels]``, a state ``[batch, channels, state_size]``. The
prompt kernel's own layout is channel-first (``FAST.output_axis`` is 2).

Effective attention (`selective_scan_attention`): ``A[d, t, s] = silu(z_t[d])
(Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j[d] A[d, n]) Δ_s[d] + D[d] δ_ts)``, one
pattern per channel, the kernel's gate and skip included
(`nnterp.fast.scan.scan_attention`).

By the signature table's names (`nnterp.fast.spec`): `states`, `one_pass`,
`resume`, `state_shape`, `effective_attention`; the specs ``FAST``, ``EFFECTIVE``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .buffers import empty_states
from .scan import block_states, differentiable, loop_free, scan_attention
from .spec import EffectiveSpec, FastSpec, Selection, indices, last_state
from .step import step_size, time_step

#: The most tokens per chunk (`selective_scan_states` uses about √seq).
MAX_CHUNK = 64
#: Tokens whose readout `selective_scan_readout` computes at once (bounds its temporaries).
READOUT_BLOCK = 64


def selective_scan_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    initial_state: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The state after every token of a Mamba-1 mixer, from its scan's arguments (tokens first).

    Args:
        x: ``[batch, seq, channels]``, the scan's input (after the convolution).
        dt: ``[batch, seq, channels]``, the time step before bias and softplus.
        A: ``[channels, state_size]`` (negative: ``-exp(A_log)``).
        B: ``[batch, seq, state_size]``.
        dt_bias: ``[channels]`` or ``None``; dt_softplus: apply softplus to ``dt + dt_bias``.
        initial_state: ``[batch, channels, state_size]`` or ``None`` (zeros, as the kernel).
        out: a ``[batch, seq, channels, state_size]`` buffer to write into: float32, or bfloat16 to store
            the states rounded once (computed in float32, `nnterp.fast.scan.BF16_RTOL`).
        chunk_size: tokens per chunk (``L``; about √seq by default).

    Returns:
        ``states [batch, seq, channels, state_size]``, float32; ``[:, -1]`` is the kernel's final state.
    """
    return _states(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, chunk_size)[1]


def selective_scan_output(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    initial_state: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    ring: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan's output and the state after every token, in one pass (no autograd; tokens first).

    ``y_t = (Σ_n C_t[n] h_t[:, n] + D ⊙ x_t) ⊙ silu(z_t)``, the kernel's
    output, read from each state while it is in cache. Arguments as in
    `selective_scan_states`, plus ``C`` ``[batch, seq, state_size]``, ``D``
    ``[channels]`` and the gate ``z`` ``[batch, seq, channels]``. With
    ``ring=True``, ``out`` is ``[batch, slots, channels, state_size]`` and
    token ``t``'s state goes to slot ``t % slots`` (the output without the states).

    Returns:
        ``(y [batch, seq, channels], states [batch, seq, channels, state_size])``, float32.
    """
    if differentiable(x, dt, A, B, C, D, z, dt_bias, initial_state):
        raise ValueError("selective_scan_output runs without autograd (it writes its states in place)")
    y, states = _states(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, None, C, ring)
    if D is not None:
        y += D.float() * x.float()
    if z is not None:
        y *= F.silu(z.float())
    return y, states


def _states(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, chunk_size, C=None, ring=False):
    """``(readout or None, states)``: token by token without autograd (`_step`), in chunks under it."""
    batch, seq, channels = x.shape
    size = A.shape[-1]
    shape = (batch, seq, channels, size)
    if out is None:
        out = empty_states(shape, x.device)
    elif (tuple(out.shape) != shape and not (ring and out.shape[2:] == shape[2:])) or not out.dtype.is_floating_point:
        raise ValueError(f"out must be a floating-point {shape} (float32, or another dtype to store the states in), got {out.dtype} {tuple(out.shape)}")
    if seq == 0:
        return (None if C is None else x.new_zeros(batch, 0, channels, dtype=torch.float32)), out
    graph = differentiable(x, dt, A, B, dt_bias, initial_state)
    if loop_free(out) and not graph:
        return _blocks(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, C)
    if not graph:
        return _step(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, C)
    length = chunk_size or min(MAX_CHUNK, math.isqrt(seq - 1) + 1)
    chunks = -(-seq // length)
    A = A.float()
    step = step_size(dt, dt_bias, dt_softplus).float()  # Δ, [b, seq, d]
    # 1. Every chunk from zeros. local[i]: the states at positions i, i + L, ... ([b, chunks having i, d, n]),
    # new tensors (out= and in-place reuse would break the graph).
    local: list = []
    for i in range(min(length, seq)):
        at = slice(i, seq, length)
        s = step[:, at, :, None]
        state = (s * B[:, at, None, :].float()) * x[:, at, :, None].float()  # (Δ B) x, the kernel's order
        if i:
            state = torch.exp(A * s) * local[i - 1][:, : s.shape[1]] + state
        local.append(state)
    # 2. The state entering each chunk. S: Δ summed from each chunk's start, [b, seq, d].
    pad = chunks * length - seq
    total = F.pad(step, (0, 0, 0, pad)).view(batch, chunks, length, channels).cumsum(2).view(batch, -1, channels)[:, :seq]
    start = None if initial_state is None else initial_state.to(device=x.device, dtype=torch.float32)
    entering = []
    for c in range(chunks):
        entering.append(start)
        end = min(seq, (c + 1) * length) - 1
        last = local[end - c * length][:, c]
        start = last.clone() if start is None else last + torch.exp(A * total[:, end, :, None]) * start
    # 3. What each chunk's entering state adds to its tokens.
    first = 0 if initial_state is not None else 1
    if chunks > first:
        entering = torch.stack(entering[first:], 1)  # [b, chunks - first, d, n]
        for i in range(min(length, seq)):
            at = slice(i + first * length, seq, length)
            carried = torch.exp(A * total[:, at, :, None]) * entering[:, : total[:, at].shape[1]]
            local[i] = torch.cat([local[i][:, :first], local[i][:, first:] + carried], 1)
    for i, state in enumerate(local):
        out[:, i::length] = state
    return None, out


def _step(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, C):
    """The kernel's own token loop, written in place into ``out`` (and each state's readout by ``C``, if given).

    Per token: the decay ``exp(Δ A)`` into a reused ``[batch, channels, n]``
    buffer, then ``h_t = decay ⊙ h_{t-1} + (Δ x) ⊗ B`` as one multiply into
    the output and one update in place. Δ is computed a block of tokens at a
    time, so nothing but the states and the readout is as long as the prompt.
    """
    batch, seq, channels = x.shape
    A = A.float()
    previous = x.new_zeros(batch, channels, A.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    decay = torch.empty_like(previous)
    readout = None if C is None else x.new_empty(batch, seq, channels, dtype=torch.float32)
    slots = out.shape[1]  # fewer than seq: a ring (`selective_scan_output(ring=True)`)
    for lo in range(0, seq, READOUT_BLOCK):
        hi = min(seq, lo + READOUT_BLOCK)
        step = step_size(dt[:, lo:hi], dt_bias, dt_softplus).float()  # Δ, [b, block, d]
        writes = step * x[:, lo:hi].float()
        keys = B[:, lo:hi].float()
        reads = None if C is None else C[:, lo:hi].float()
        for t in range(hi - lo):
            state = out[:, (lo + t) % slots]
            torch.mul(A, step[:, t, :, None], out=decay)
            torch.mul(previous, decay.exp_(), out=state)
            state.addcmul_(writes[:, t, :, None], keys[:, t, None, :])
            if reads is not None:
                torch.matmul(state, reads[:, t, :, None], out=readout[:, lo + t, :, None])
            previous = state
    return readout, out


def _blocks(x, dt, A, B, dt_bias, dt_softplus, initial_state, out, C):
    """`_step`'s values by closed-form blocks (`nnterp.fast.scan.block_states`): a channel's state ``[n]`` is an ``[n, 1]`` matrix
    decayed per row, written ``B_t ⊗ Δ_t x_t``; Δ a block of tokens at a time, as in `_step`."""
    batch, seq, channels = x.shape
    A = A.float()
    state = x.new_zeros(batch, channels, A.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    state, states, readout = state[..., None], out[..., None], []  # [b, d, n, 1], [b, slots, d, n, 1]
    for lo in range(0, seq, READOUT_BLOCK):
        hi = min(seq, lo + READOUT_BLOCK)
        step = step_size(dt[:, lo:hi], dt_bias, dt_softplus).float().transpose(1, 2)  # Δ, [b, d, block]
        keys = B[:, None, lo:hi].float().expand(-1, channels, -1, -1)  # [b, d, block, n]
        writes = (step * x[:, lo:hi].float().transpose(1, 2))[..., None]  # Δx, [b, d, block, 1]
        reads = None if C is None else C[:, None, lo:hi].float().expand(-1, channels, -1, -1)
        state, got = block_states(states, lo, state, step[..., None] * A[:, None], keys, writes, read=reads, read_rows=True)
        if got is not None:
            readout.append(got[..., 0].transpose(1, 2))  # [b, block, d]
    return (torch.cat(readout, 1) if C is not None else None), out


def selective_scan_readout(
    dt: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    start: torch.Tensor,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a start state ``h_0`` adds to a Mamba-1 scan that started from zeros instead (tokens first).

    The recurrence is linear in ``h_0``: the state after token ``t`` gains
    ``exp(A ⊙ S_t) ⊙ h_0`` (``S_t = Δ_1 + … + Δ_t``), so the output gains
    ``silu(z_t) ⊙ Σ_n C_t[n] exp(A ⊙ S_t)[:, n] h_0[:, n]``.

    Args:
        dt: ``[batch, seq, channels]``; A: ``[channels, state_size]``;
        C: ``[batch, seq, state_size]``; start: ``[batch, channels, state_size]``;
        z: ``[batch, seq, channels]`` (the gate) or ``None``; dt_bias, dt_softplus: as the kernel's.

    Returns:
        ``(readout [batch, seq, channels], decayed [batch, channels, state_size])``,
        float32: what the output and the final state gain.
    """
    A = A.float()
    start = start.float()
    total = step_size(dt, dt_bias, dt_softplus).float().cumsum(1)  # S_t, [b, seq, d]
    pieces = []
    for lo in range(0, total.shape[1], READOUT_BLOCK):
        hi = min(total.shape[1], lo + READOUT_BLOCK)
        carried = torch.exp(A * total[:, lo:hi, :, None]) * start[:, None]  # [b, k, d, n]
        pieces.append((carried @ C[:, lo:hi, :, None].float()).squeeze(-1))
    readout = torch.cat(pieces, 1) if pieces else total.new_zeros(total.shape)
    if z is not None:
        readout = readout * F.silu(z.float())
    return readout, torch.exp(A * total[:, -1, :, None]) * start


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
    out, readout = scan_attention(log_decay, B, C, step, skip, gate, state, positions, coefficients)
    return out, (readout[..., 0] if readout is not None else None)


# -- by the signature table's names (`nnterp.fast.spec`) ---------------------------------


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`selective_scan_states` of a served call's arguments."""
    a = arguments
    return selective_scan_states(a["x"], a["dt"], a["A"], a["B"], a.get("dt_bias"), bool(a.get("dt_softplus") or False), a.get("state"), out=out)


def state_shape(arguments: dict) -> tuple:
    """``(batch, channels, state_size)``."""
    x, A = arguments["x"], arguments["A"]
    return (x.shape[0], x.shape[2], A.shape[1])


def one_pass(arguments: dict, out: torch.Tensor | None) -> tuple | None:
    """The scan's return (``y`` channel-first, and its final state when the call asks) with the states, in one pass."""
    a = arguments
    if a["x"].dtype != torch.float32:
        return None
    seq = a["x"].shape[1]
    y, out = selective_scan_output(
        a["x"], a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        a.get("state"), out=out, ring=out is not None and out.shape[1] != seq,
    )
    y = y.transpose(1, 2).contiguous()  # the kernel's layout, channel-first
    return ((y, last_state(out, seq)) if a.get("final") else y), out


def resume(arguments: dict, initial: torch.Tensor, result: object) -> object:
    """The kernel's ``result`` from zeros, as it would be from ``initial`` (`selective_scan_readout` added)."""
    a = arguments
    # The kernel returns y channel-first, [batch, channels, seq], and (with return_last_state) its final state.
    readout, decayed = selective_scan_readout(
        a["dt"], a["A"], a["C"], initial, a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False)
    )
    y = result[0] if isinstance(result, tuple) else result
    y = (y.float() + readout.transpose(1, 2)).to(y.dtype)
    if not isinstance(result, tuple):
        return y
    return (y, (result[1].float() + decayed).to(result[1].dtype), *result[2:])


def effective_attention(arguments: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """`selective_scan_attention` of a served call's arguments."""
    a = arguments
    return selective_scan_attention(
        a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        a.get("state"), positions, channels, coefficients,
    )


#: transformers' ``mamba_selective_scan`` (Mamba-1, Falcon-Mamba, Jamba), which starts from zeros: ``resume``.
FAST = FastSpec(
    "selective scan", states, ("x", "dt", "B", "C", "z"), state_shape, resume, output_axis=2, one_pass=one_pass, ring=True,
    state_tokens=("x", "dt", "B"),
)
#: Mamba-1's selective scan and decode step.
EFFECTIVE = EffectiveSpec("selective scan", effective_attention, "channels")
