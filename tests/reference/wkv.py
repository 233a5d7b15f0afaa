"""RWKV-4's WKV written from the paper's equation (Peng et al., 2023, arXiv:2305.13048, eq. 14-16), as explicit sums.

With ``w = exp(time_decay) > 0`` (the paper's channel-wise decay: each step
multiplies a past token's weight by ``e^{-w}``) and ``u = time_first`` (the
bonus of the current token), per channel:

    wkv_t = (Σ_{i<t} e^{-(t-1-i) w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{-(t-1-i) w + k_i} + e^{u + k_t})

and the state after token ``t`` is the pair of sums ``a_t = Σ_{i≤t} e^{-(t-i) w + k_i} v_i``,
``b_t = Σ_{i≤t} e^{-(t-i) w + k_i}`` (plus a state entering the call, decayed
by ``e^{-t w}``). This file computes them directly, as sums over every earlier
token in float64, not as transformers' recurrence. To compare with the state
a model keeps, each pair is scaled by ``e^{-p_t}``, with ``p_t`` the largest
exponent so far, ``p_t = max(p_0 - t w, max_{i≤t} (k_i - (t-i) w))``: the triple
``(a_t e^{-p_t}, b_t e^{-p_t}, p_t)`` stacked on axis 2, ``[B, T, 3, C]``.
Independent of transformers and of nnterp.
"""

from __future__ import annotations

import torch

#: The maximum of a fresh state (transformers' model starts from -1e30; its kernel alone from -1e38).
FRESH_MAX = -1e30


def wkv(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WKV outputs ``[B, T, C]`` and the state after every token ``[B, T, 3, C]`` (float32).

    Args:
        time_decay, time_first: ``[C]``, the parameters (``w = exp(time_decay)``, ``u = time_first``).
        k, v: ``[B, T, C]``.
        state: ``[B, 3, C]`` entering, the scaled triple ``(a e^{-p}, b e^{-p}, p)``; ``None`` is fresh.
    """
    k, v = k.double(), v.double()
    batch, length, channels = k.shape
    w = torch.exp(time_decay.double())
    u = time_first.double()
    if state is None:
        state = torch.zeros(batch, 3, channels, dtype=torch.float64)
        state[:, 2] = FRESH_MAX
    state = state.double()
    a0, b0, p0 = state.unbind(1)
    steps = torch.arange(length, dtype=torch.float64)
    outputs, states = [], []
    for t in range(length):
        # Exponents of every earlier token's weight after token t, and of the entering state's.
        ages = (t - steps[: t + 1])[None, :, None]
        exponents = k[:, : t + 1] - ages * w
        entering = p0 - (t + 1) * w  # the state entering the call is decayed once per token, t + 1 times
        p = torch.maximum(exponents.amax(1), entering)
        scale = torch.exp(exponents - p[:, None])
        a = (scale * v[:, : t + 1]).sum(1) + torch.exp(entering - p) * a0
        b = scale.sum(1) + torch.exp(entering - p) * b0
        states.append(torch.stack([a, b, p], 1))
        # The output at t: the earlier tokens (decayed t-1-i times), the current one with its bonus.
        past = k[:, :t] - (t - 1 - steps[:t])[None, :, None] * w
        before = p0 - t * w
        bonus = u + k[:, t]
        q = torch.maximum(torch.maximum(past.amax(1) if t else before, before), bonus)
        weights = torch.exp(past - q[:, None])
        top = (weights * v[:, :t]).sum(1) + torch.exp(before - q) * a0 + torch.exp(bonus - q) * v[:, t]
        bottom = weights.sum(1) + torch.exp(before - q) * b0 + torch.exp(bonus - q)
        outputs.append(top / bottom)
    return torch.stack(outputs, 1).float(), torch.stack(states, 1).float()


def true_sums(states: torch.Tensor) -> torch.Tensor:
    """``(a, b)`` of scaled triples ``[..., 3, C]``: the unscaled numerator and denominator, ``[..., 2, C]`` (float64)."""
    scale = torch.exp(states[..., 2, :].double())
    return torch.stack([states[..., 0, :].double() * scale, states[..., 1, :].double() * scale], -2)
