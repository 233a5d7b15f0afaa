"""The mLSTM written from the paper's equations (Beck et al., 2024, arXiv:2405.04517), and oracles on a plain xLSTM.

`mlstm` is the recurrence in its *unstabilized* form, in float64: the true
memory ``C̄_t = σ(f̃_t) C̄_{t-1} + exp(ĩ_t) k_t v_tᵀ`` and normalizer
``n̄_t = σ(f̃_t) n̄_{t-1} + exp(ĩ_t) k_t``, read out as
``h_t = C̄_tᵀ q̂_t / max(|n̄_tᵀ q̂_t|, 1)`` (``q̂ = q / √key_dim``). The
stabilizer ``m_t = max(log σ(f̃_t) + m_{t-1}, ĩ_t)`` is computed on its own,
and the stored state transformers keeps is the true one scaled by
``exp(-m_t)``: the paper's stabilized form, which is exact, so the two agree
to float rounding. (transformers adds ``eps`` to the stabilized denominator,
which is ``eps · exp(m_t)`` here.) Independent of nnterp and of transformers.

The oracles drive a plain ``xLSTMForCausalLM`` through its own ``xLSTMCache``
(``cache.rnn_state[layer] = (C, n, m)``), one forward per prefix or token; the cache goes in and comes
out under the installed release's name (``cache_params`` before 5.24, ``cache`` from it: `hf_oracles`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tests.reference.hf_oracles import cache_kwarg, output_cache

__all__ = ["mlstm", "prefix_states", "continue_from_state", "greedy", "set_layer_state"]


def mlstm(q, k, v, igate, fgate, initial=None, eps: float = 1e-6):
    """The mLSTM over ``T`` tokens: ``(h [B, T, H, Dv], C [B, T, H, Dk, Dv], n [B, T, H, Dk], m [B, T, H])``.

    ``q``, ``k`` ``[B, T, H, Dk]``, ``v`` ``[B, T, H, Dv]``, ``igate`` / ``fgate``
    ``[B, T, H]`` (pre-activations); ``initial``: a stored ``(C, n, m)`` (``m``
    ``[B, H, 1]``) or ``None`` (zeros). Returns float64; the states as transformers stores them.
    """
    q, k, v, i, f = (x.double() for x in (q, k, v, igate, fgate))
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    if initial is None:
        c_true = torch.zeros(B, H, Dk, Dv, dtype=torch.float64)
        n_true = torch.zeros(B, H, Dk, dtype=torch.float64)
        m = torch.zeros(B, H, dtype=torch.float64)
    else:
        c0, n0, m0 = (x.double() for x in initial)
        m = m0[..., 0]
        c_true, n_true = c0 * m.exp()[..., None, None], n0 * m.exp()[..., None]
    hs, cs, ns, ms = [], [], [], []
    for t in range(T):
        forget = torch.sigmoid(f[:, t])  # [B, H]
        c_true = forget[..., None, None] * c_true + i[:, t].exp()[..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        n_true = forget[..., None] * n_true + i[:, t].exp()[..., None] * k[:, t]
        m = torch.maximum(F.logsigmoid(f[:, t]) + m, i[:, t])
        qs = q[:, t] / Dk**0.5
        num = torch.einsum("bhkv,bhk->bhv", c_true, qs)
        den = torch.maximum(torch.einsum("bhk,bhk->bh", n_true, qs).abs(), torch.ones_like(m)) + eps * m.exp()
        hs.append(num / den[..., None])
        scale = (-m).exp()
        cs.append(c_true * scale[..., None, None])
        ns.append(n_true * scale[..., None])
        ms.append(m.clone())
    return torch.stack(hs, 1), torch.stack(cs, 1), torch.stack(ns, 1), torch.stack(ms, 1)


def set_layer_state(cache, layer: int, state: tuple) -> None:
    """Overwrite ``layer``'s cached ``(C, n, m)`` in place (the model copies into these buffers)."""
    for buffer, value in zip(cache.rnn_state[layer], state):
        buffer.copy_(value.to(buffer.dtype))


@torch.no_grad()
def prefix_states(plain, ids: torch.Tensor, layer: int) -> tuple:
    """``(C, n, m)`` of ``layer``'s cache after a plain forward over each prefix: ``[B, T, ...]`` each."""
    found = []
    for t in range(ids.shape[1]):
        cache = output_cache(plain(ids[:, : t + 1], use_cache=True))
        found.append(tuple(x.clone() for x in cache.rnn_state[layer]))
    return tuple(torch.stack([state[j] for state in found], 1) for j in range(3))


@torch.no_grad()
def continue_from_state(plain, ids: torch.Tensor, T: int, layer: int, state: tuple) -> torch.Tensor:
    """Last-position logits after replacing ``layer``'s cached state after token ``T``, the rest fed one token at a time."""
    out = plain(ids[:, : T + 1], use_cache=True)
    cache = output_cache(out)
    set_layer_state(cache, layer, state)
    for j in range(T + 1, ids.shape[1]):
        out = plain(ids[:, j : j + 1], use_cache=True, **{cache_kwarg(plain): cache})
    return out.logits[:, -1]


@torch.no_grad()
def greedy(plain, ids: torch.Tensor, new: int, patch: Callable | None = None, suppress: tuple = ()) -> torch.Tensor:
    """Plain greedy decoding through the cache; ``patch(step, cache)`` runs before decode step ``step`` (1 is the first)."""
    out = plain(ids, use_cache=True)
    cache = output_cache(out)
    for step in range(1, new + 1):
        logits = out.logits[:, -1].clone()
        logits[:, list(suppress)] = float("-inf")
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
        if step == new:
            break
        if patch is not None:
            patch(step, cache)
        out = plain(nxt, use_cache=True, **{cache_kwarg(plain): cache})
    return ids
