"""The state after every token of Mamba-2's state space duality (SSD), at a cost linear in length.

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
mamba_ssm's Triton kernel does.
"""

from __future__ import annotations

import math

import torch

from .buffers import empty_states
from .scan import differentiable, fill_states, step_states
from .step import step_size


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
        chunk_size: under autograd, tokens whose states one batched matmul computes (a run; `scan.FILL` by default).
        D: ``[heads]`` skip weight, for ``output``.
        output: also return the scan's output ``y_t = C_t·h_t + D x_t``
            (without autograd read off each state as it is written, the fast
            path's one pass; under autograd one more pass over the states).
        out: a float32 ``[batch, seq, heads, head_dim, state_size]`` buffer to write into.
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
    elif (tuple(out.shape) != shape and not (ring and out.shape[2:] == shape[2:])) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {shape}, got {out.dtype} {tuple(out.shape)}")
    step = step_size(dt.to(dt_dtype or dt.dtype), dt_bias, dt_softplus, dt_limit).float()  # Δ, [b, seq, h]
    log_decay = (step * A.float()).transpose(1, 2)[..., None]  # [b, h, seq, 1], ≤ 0
    writes = (x.float() * step[..., None]).transpose(1, 2)  # Δx, [b, h, seq, p]
    keys = _per_head(B.float(), heads).transpose(1, 2)  # [b, h, seq, n]
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
        y = step_states(out, 0, start, log_decay, writes, keys, read=_per_head(C.float(), heads).transpose(1, 2)).transpose(1, 2)
    else:
        fill_states(out, 0, start, log_decay, writes, keys, fill=chunk_size)
        if not output:
            return out
        y = torch.einsum("bthpn,bthn->bthp", out, _per_head(C.float(), heads))
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y, out


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, seq, groups, n]`` -> ``[b, seq, heads, n]``, each group repeated for its heads."""
    groups = x.shape[2]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=2)
