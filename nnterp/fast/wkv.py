"""RWKV-4's WKV: its output and the state after every token in one loop, and its exact effective attention.

Per channel (Peng et al., 2023, arXiv:2305.13048), with ``k_t`` the key,
``v_t`` the value, ``u = time_first``, ``w = -exp(time_decay)`` the log decay
per token (``< 0``) and the state ``(a, b, p)`` (the numerator and
denominator scaled by ``e^{-p}``, ``p`` the running maximum of the exponents):

    q = max(p, u + k_t)
    y_t = (e^{p-q} a + e^{u+k_t-q} v_t) / (e^{p-q} b + e^{u+k_t-q})      the output
    p' = max(p + w, k_t)
    a' = e^{p+w-p'} a + e^{k_t-p'} v_t,   b' = e^{p+w-p'} b + e^{k_t-p'}  the state after t

Shapes, tokens first: ``k``, ``v`` ``[batch, seq, channels]``;
``time_decay``, ``time_first`` ``[channels]``; a state is the kernel's
``(num, den, max)`` triple of ``[batch, channels]`` tensors (``None``: the
kernel's own start ``(0, 0, -1e38)``, `EMPTY_MAX`); the states nnterp serves
stack it on axis 2, ``[batch, seq, 3, channels]`` float32 (index 0 the scaled
numerator, 1 the denominator, 2 the maximum).

States and output (`wkv_one_pass`): transformers' ``rwkv_linear_attention_cpu``
loops over tokens and keeps only the last state; this runs the same equations
and writes every token's state in place into one buffer, so a read of the
states costs no second loop. The pair ``(a, b)`` is updated as one tensor
against the pair ``(v_t, 1)`` (the kernel's products and sums in its order, so
its results bit for bit on float32 inputs, in half the calls).

Effective attention (`wkv_attention`). The output is a weighted average of
the values, so with everything but the values fixed it is exactly an
attention pattern, one per channel, plus the part read from the state
entering the call:

    wkv_t = Σ_{s ≤ t} A[t, s] v_s + readout_t
    A[t, s] = e^{k_s + (t-1-s) w} / den_t  (s < t),   A[t, t] = e^{u + k_t} / den_t
    den_t = Σ_{s<t} e^{k_s + (t-1-s) w} + e^{u + k_t} + b_0 e^{p_0 + t w}
    readout_t = a_0 e^{p_0 + t w} / den_t

with ``(a_0, b_0, p_0)`` the entering state. Every row is scaled by its
largest exponent before the exponential, as the kernel scales its sums. Each
row of ``A`` sums to one less the entering state's share: it is an average.
Memory: ``4 · batch · channels · positions · seq`` bytes (``positions=`` and
``channels=`` keep it bounded).

The failure mode worth knowing: the scaled state means nothing without its
maximum ``p``. A fresh state's ``p`` is ``-1e38`` in the kernel alone but
``-1e30`` in transformers' model, and a state whose denominator is all zero
has absorbed nothing (its effective readout is none, whatever ``p`` says).

By the signature table's names (`nnterp.fast.spec`): `states`, `one_pass`,
`state_shape`, `effective_attention`; the specs ``FAST``, ``EFFECTIVE``.
Pure torch: imports nothing from nnterp but ``nnterp.fast``.
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import empty_states
from .scan import differentiable
from .spec import EffectiveSpec, FastSpec, Selection, indices

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


# -- by the signature table's names (`nnterp.fast.spec`) ---------------------------------


def wkv_states(time_decay: torch.Tensor, time_first: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
    """The state after every token, ``[batch, seq, 3, channels]`` float32, stacked (autograd keeps every step).

    The kernel's state update, token by token, with its operations in its
    order (``rwkv_linear_attention_cpu``), so equal to `wkv_one_pass`'s states.
    """
    decay = -torch.exp(time_decay)
    if state is None:
        num = den = torch.zeros((k.shape[0], k.shape[2]), dtype=torch.float32, device=k.device)
        top = torch.full_like(num, EMPTY_MAX)
    else:
        num, den, top = state
    found = []
    for t in range(k.shape[1]):
        key, current = k[:, t].float(), v[:, t]
        peak = torch.maximum(top + decay, key)
        e1, e2 = torch.exp(top + decay - peak), torch.exp(key - peak)
        num, den, top = e1 * num + e2 * current, e1 * den + e2, peak
        found.append(torch.stack((num, den, top), 1))
    return torch.stack(found, 1)


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """The state after every token, ``[batch, seq, 3, channels]`` float32, by the kernel's loop (`wkv_one_pass`),
    into ``out`` when given; under autograd, or into an ``out`` of another dtype, `wkv_states` (copied in)."""
    a = arguments
    k = a["k"]
    if differentiable(a["time_decay"], a["time_first"], k, a["v"], *(a.get("state") or ())) or (
        out is not None and out.dtype != torch.float32
    ):
        found = wkv_states(a["time_decay"], a["time_first"], k, a["v"], a.get("state"))
        return found if out is None else out.copy_(found)
    if out is None:
        out = empty_states((k.shape[0], k.shape[1], 3, k.shape[2]), k.device)
    wkv_one_pass(a["time_decay"], a["time_first"], k, a["v"], a.get("state"), out)
    return out


def one_pass(arguments: dict, out: torch.Tensor) -> tuple | None:
    """The kernel's return ``(output, [num, den, max] or None)`` with the states; ``None`` off float32 (``out``
    too) and on one token (a decode step: the token loop serves its ``state``)."""
    a = arguments
    inputs = (a["time_decay"], a["time_first"], a["k"], a["v"], *(a.get("state") or ()))
    if a["k"].shape[1] < 2 or any(x.dtype != torch.float32 for x in (*inputs, out)):
        return None
    return wkv_one_pass(a["time_decay"], a["time_first"], a["k"], a["v"], a.get("state"), out, bool(a.get("final"))), out


def state_shape(arguments: dict) -> tuple:
    """``(batch, 3, channels)``."""
    k = arguments["k"]
    return (k.shape[0], 3, k.shape[2])


def effective_attention(arguments: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """`wkv_attention` of a served call's arguments."""
    a = arguments
    state = a.get("state")
    if state is not None and bool((state[1] == 0).all()):
        state = None  # a fresh state (nothing absorbed) reads nothing
    return wkv_attention(a["time_decay"], a["time_first"], a["k"], state, positions, channels, coefficients)


def entering(arguments: dict) -> torch.Tensor | None:
    """The kernel's entering ``(num, den, max)`` stacked as `states` writes a state, ``[batch, 3, channels]`` float32."""
    state = arguments.get("state")
    return None if state is None else torch.stack([part.float() for part in state], 1)


def starting(state: torch.Tensor | None) -> dict:
    """A state as `states` writes it, ``[batch, 3, channels]``, as the kernel's ``state`` triple."""
    return {"state": None if state is None else list(state.unbind(1))}


def leaving(final: list) -> torch.Tensor:
    """The kernel's returned ``[num, den, max]`` stacked as `states` writes a state, ``[batch, 3, channels]`` float32."""
    return torch.stack([part.float() for part in final], 1)


#: transformers' ``rwkv_linear_attention`` (RWKV-4): its CPU loop, prompt and decode step alike.
FAST = FastSpec("WKV", states, ("k", "v"), state_shape, one_pass=one_pass, entering=entering, starting=starting, leaving=leaving)
#: transformers' ``rwkv_linear_attention`` (RWKV-4), prompt and decode step alike.
EFFECTIVE = EffectiveSpec("WKV", effective_attention, "channels")
