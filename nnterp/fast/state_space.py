"""Mamba-2's state space duality (SSD): the state after every token at a cost linear in length, and the effective attention.

Mental model. Per head ``h`` the state is ``[head_dim, state_size]``; each
token decays it by a scalar and writes one outer product:

    Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    h_t = exp(Δ_t A_h) h_{t-1} + (Δ_t x_t) ⊗ B_t        (B shared by a group of heads)

transformers' chunk scan (``mamba2_chunk_scan``) computes the state only at
chunk boundaries, with an inter-chunk einsum that is quadratic in the number
of chunks: with ``chunk_size = 1`` it gives every token's state at a cost
quadratic in length. Here the writes do not depend on the state, so every
state is ``exp(c_i) h_start + Σ_j exp(c_i − c_j) (Δ_j x_j) ⊗ B_j`` over a
run of tokens (`nnterp.fast.scan.fill_states`): a few multiply-adds per
state element, written once into the output, linear in length.

Precision. Everything is computed in float32, except the time step
``Δ = clamp(softplus(dt + dt_bias))``, which is computed in ``dt``'s own dtype
and then cast, as transformers' ``mamba2_chunk_scan`` does: in a bfloat16
model Δ is rounded to bfloat16 there, and computing it in float32 here would
move the states by about 3e-3 of their largest entry (6e-4 on the tiny
checkpoint). So in every dtype the states equal the torch chunk scan's
(``chunk_per_token``, and the ``state_output`` it caches) within float32
rounding. ``dt_dtype=torch.float32`` computes Δ in float32 instead, as
mamba_ssm's Triton kernel does. That is the failure mode worth knowing: a
Δ computed in float32 from a bfloat16 model's ``dt`` looks right and is off
by the rounding of Δ, far more than float32 rounding.

Shapes, tokens first: ``x`` ``[batch, seq, heads, head_dim]``, ``dt``
``[batch, seq, heads]``, ``A``, ``D``, ``dt_bias`` ``[heads]``, ``B``, ``C``
``[batch, seq, groups, state_size]`` (each group serves ``heads // groups``
consecutive heads), a state ``[batch, heads, head_dim, state_size]``.

Effective attention (`ssd_attention`): the writes do not depend on the state,
so ``A[t, s] = C_t·B_s exp(Σ_{s<j≤t} Δ_j A_h) Δ_s`` (plus ``D_h`` on the
diagonal), one pattern per head (`nnterp.fast.scan.scan_attention`). It is the
scan's output before the gate: transformers' chunk scan takes no ``z`` (the
gate is a norm after it), and so it is on the one Mamba-2 decode kernel that
gates inside, Falcon-H1's without ``mamba_rms_norm``, whose gate is per channel.

By the signature table's names (`nnterp.fast.spec`): `states`, `one_pass`,
`state_shape`, `effective_attention`; the specs ``FAST``, ``EFFECTIVE``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .buffers import empty_states
from .scan import differentiable, fill_states, scan_attention
from .spec import EffectiveSpec, FastSpec, Selection, expand_groups, indices, last_state
from .step import step_size, time_step


def ssd_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    chunk_size: int | None = None,
    D: torch.Tensor | None = None,
    output: bool = False,
    out: torch.Tensor | None = None,
    dt_dtype: torch.dtype | None = None,
    ring: bool = False,
):
    """The state after every token of a Mamba-2 mixer, from its chunk scan's arguments.

    Args:
        x: ``[batch, seq, heads, head_dim]``, the scan's input (after the convolution).
        dt: ``[batch, seq, heads]``, the time step before bias and softplus.
        A: ``[heads]`` (negative: ``-exp(A_log)``).
        B, C: ``[batch, seq, groups, state_size]``; each group serves
            ``heads // groups`` consecutive heads. ``C`` is only needed for ``output``.
        dt_bias: ``[heads]`` or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``Δ`` is clamped to this range (after the softplus), as the kernel does.
        initial_states: ``[batch, heads, head_dim, state_size]`` or ``None`` (zeros).
        chunk_size: where the closed-form blocks fill (`scan.fill_states`), tokens per block (`scan.FILL` under autograd, `scan.BLOCK` otherwise).
        D: ``[heads]`` skip weight, for ``output``.
        output: also return the scan's output ``y_t = C_t·h_t + D x_t``
            (without autograd read off each state as it is written, the fast
            path's one pass; under autograd one more pass over the states).
        out: a ``[batch, seq, heads, head_dim, state_size]`` buffer to write into: float32, or bfloat16 to
            store the states rounded once (computed in float32, `nnterp.fast.scan.BF16_RTOL`).
        ring: with ``output`` and no autograd, ``out`` may be ``[batch, slots, ...]``:
            token ``t``'s state goes to slot ``t % slots`` (the output without the states).
        dt_dtype: the dtype ``Δ`` is computed in before it is cast to float32:
            ``None`` is ``dt``'s own, as transformers' chunk scan computes it
            (see Precision in the module docstring).

    Returns:
        ``states [batch, seq, heads, head_dim, state_size]`` (float32; ``[:, -1]``
        is the scan's final state), or ``(y [batch, seq, heads, head_dim], states)``.
    """
    batch, seq, heads, head_dim = x.shape
    groups, size = B.shape[2], B.shape[3]
    if heads % groups:
        raise ValueError(f"ssd_states: {heads} heads is not a multiple of {groups} groups")
    shape = (batch, seq, heads, head_dim, size)
    if out is None:
        out = empty_states(shape, x.device)
    elif (tuple(out.shape) != shape and not (ring and out.shape[2:] == shape[2:])) or not out.dtype.is_floating_point:
        raise ValueError(f"out must be a floating-point {shape} (float32, or another dtype to store the states in), got {out.dtype} {tuple(out.shape)}")
    step = step_size(dt.to(dt_dtype or dt.dtype), dt_bias, dt_softplus, dt_limit).float()  # Δ, [b, seq, h]
    log_decay = (step * A.float()).transpose(1, 2)[..., None]  # [b, h, seq, 1], ≤ 0
    writes = (x.float() * step[..., None]).transpose(1, 2)  # Δx, [b, h, seq, p]
    keys = expand_groups(B.float(), heads).transpose(1, 2)  # [b, h, seq, n]
    if initial_states is None:
        start = x.new_zeros(batch, heads, head_dim, size, dtype=torch.float32)
    else:
        start = initial_states.to(device=x.device, dtype=torch.float32)
    if output and C is None:
        raise ValueError("ssd_states(output=True) needs C")
    if ring and (not output or differentiable(start, log_decay, writes, keys, C)):
        raise ValueError("ssd_states(ring=True) is for the output without autograd")
    if output and not differentiable(start, log_decay, writes, keys, C):
        # One pass: each state's readout is taken while the state is in cache.
        y = fill_states(out, 0, start, log_decay, writes, keys, read=expand_groups(C.float(), heads).transpose(1, 2))[1].transpose(1, 2)
    else:
        fill_states(out, 0, start, log_decay, writes, keys, fill=chunk_size)
        if not output:
            return out
        y = torch.einsum("bthpn,bthn->bthp", out, expand_groups(C.float(), heads))
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y, out


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
    return scan_attention(log_decay, B, C, step, skip, None, state, positions, coefficients)


# -- by the signature table's names (`nnterp.fast.spec`) ---------------------------------


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`ssd_states` of a served call's arguments."""
    a = arguments
    return ssd_states(
        a["x"], a["dt"], a["A"], a["B"], None, a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("state"), out=out,
    )


def one_pass(arguments: dict, out: torch.Tensor | None) -> tuple | None:
    """The chunk scan's return (``y``, and its final state when the call asks) with the states, in one pass."""
    a = arguments
    if a["x"].dtype != torch.float32:
        return None
    seq = a["x"].shape[1]
    y, out = ssd_states(
        a["x"], a["dt"], a["A"], a["B"], a["C"], a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("state"), D=a.get("D"), output=True, out=out,
        ring=out is not None and out.shape[1] != seq,
    )
    y = y.contiguous()  # callers view() the kernel's output
    return ((y, last_state(out, seq)) if a.get("final") else y), out


def state_shape(arguments: dict) -> tuple:
    """``(batch, heads, head_dim, state_size)``."""
    x, B = arguments["x"], arguments["B"]
    return (x.shape[0], x.shape[2], x.shape[3], B.shape[3])


def effective_attention(arguments: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    """`ssd_attention` of a served call's arguments (a decode step's too: no ``dt_limit`` there)."""
    a = arguments
    limit = a.get("dt_limit")
    return ssd_attention(
        a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(limit) if limit is not None else None, a.get("state"), positions, heads, coefficients,
    )


#: transformers' ``mamba2_chunk_scan`` (Mamba-2).
FAST = FastSpec("state space duality", states, ("x", "dt", "B", "C"), state_shape, one_pass=one_pass, ring=True, state_tokens=("x", "dt", "B"))
#: Mamba-2's chunk scan and decode step.
EFFECTIVE = EffectiveSpec("state space duality", effective_attention, "heads")
