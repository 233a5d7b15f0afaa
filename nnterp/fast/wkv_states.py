"""RWKV-4's WKV kernel, its output and the state after every token in one loop.

transformers' ``rwkv_linear_attention_cpu`` loops over tokens and keeps only
the last state; `wkv_one_pass` runs the same equations, per channel, and
writes every token's state in place into one buffer, so a read of the states
costs no second loop (`nnterp.components.wkv_one_pass` skips the kernel call
with what this returns). With ``k_t`` the key, ``v_t`` the value, ``u =
time_first``, ``w = -exp(time_decay)`` and the state ``(a, b, p)`` (the
numerator and denominator scaled by ``e^{-p}``, ``p`` the running maximum of
the exponents):

    q = max(p, u + k_t)
    y_t = (e^{p-q} a + e^{u+k_t-q} v_t) / (e^{p-q} b + e^{u+k_t-q})      the output
    p' = max(p + w, k_t)
    a' = e^{p+w-p'} a + e^{k_t-p'} v_t,   b' = e^{p+w-p'} b + e^{k_t-p'}  the state after t

The pair ``(a, b)`` is updated as one tensor against the pair ``(v_t, 1)``
(the kernel's products and sums in its order, so its results bit for bit,
in half the calls). A call without an entering state starts
from the kernel's own ``(0, 0, -1e38)``.

Shapes: ``k``, ``v`` ``[batch, seq, channels]``; ``time_decay``,
``time_first`` ``[channels]``; ``state`` a ``(num, den, max)`` triple of
``[batch, channels]`` or ``None``; ``out`` ``[batch, seq, 3, channels]``
(index 0 the scaled numerator, 1 the denominator, 2 the maximum), float32.
Pure torch: imports nothing from nnterp.
"""

from __future__ import annotations

import torch

#: The kernel's maximum before any token (``rwkv_linear_attention_cpu``'s ``- 1e38``).
EMPTY_MAX = -1e38


def wkv_one_pass(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple | list | None,
    out: torch.Tensor,
    return_state: bool = False,
) -> tuple[torch.Tensor, list | None]:
    """The kernel's return ``(output [batch, seq, channels], [num, den, max] or None)``, every state written into ``out``.

    The final state is returned (as copies, as the kernel returns fresh
    tensors) when ``return_state`` or an entering ``state`` is given, as
    transformers' kernel does; ``out[:, t]`` is the state after token ``t``.
    Float32 inputs; no autograd (``out`` is written in place).
    """
    batch, seq, channels = k.shape
    # Per token, [batch, 1, channels] (the maximum, the keys) against [batch, 2, channels] (the pairs): views made
    # once, so the loop makes only the kernel's arithmetic calls.
    keys = k.float()[:, :, None]
    bonus_keys = keys + time_first  # u + k_t, every token at once
    decay = -torch.exp(time_decay)
    pairs = torch.empty((batch, seq, 2, channels), dtype=v.dtype, device=v.device)
    pairs[:, :, 0] = v
    pairs[:, :, 1] = 1
    reads = torch.empty_like(pairs)  # (numerator, denominator) of each token's output, divided once at the end
    if state is None:
        pair = torch.zeros((batch, 2, channels), dtype=torch.float32, device=k.device)
        top = torch.full((batch, 1, channels), EMPTY_MAX, dtype=torch.float32, device=k.device)
    else:
        pair = torch.stack((state[0], state[1]), 1)
        top = state[2][:, None]
    steps = zip(keys.unbind(1), bonus_keys.unbind(1), pairs.unbind(1), reads.unbind(1), out[:, :, :2].unbind(1), out[:, :, 2:].unbind(1))
    for key, bonus_key, current, read, new_pair, new_top in steps:
        # The readout: the state before t plus the current token with its bonus.
        peak = torch.maximum(top, bonus_key)
        torch.mul(pair, torch.exp(top - peak), out=read)
        read += current * torch.exp(bonus_key - peak)
        # The update, written where the state after t is kept.
        decayed = top + decay
        torch.maximum(decayed, key, out=new_top)
        torch.mul(pair, torch.exp(decayed - new_top), out=new_pair)
        new_pair += current * torch.exp(key - new_top)
        pair, top = new_pair, new_top
    output = torch.div(reads[:, :, 0], reads[:, :, 1]).to(k.dtype)
    final = None
    if return_state or state is not None:
        final = [out[:, -1, 0].clone(), out[:, -1, 1].clone(), out[:, -1, 2].clone()] if seq else [*pair.unbind(1), top[:, 0]]
    return output, final


__all__ = ["wkv_one_pass", "EMPTY_MAX"]
