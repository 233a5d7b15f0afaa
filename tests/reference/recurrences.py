"""Naive reference recurrences, written from the papers' equations.

Each function is one plain loop over tokens, computed in float32, and returns the
output *and the state after every token*. They are test oracles: slow, obvious and
independent of transformers and of nnterp. ``tests/reference/test_recurrences.py``
checks them against the pure-torch kernels that transformers ships.

Shape letters: ``B`` batch, ``T`` tokens, ``H`` heads (``Hk`` query/key heads,
``Hv`` value heads), ``Dk``/``Dv`` key/value head dims, ``D`` Mamba-1 inner channels,
``N`` SSM state size, ``P`` Mamba-2 head dim, ``G`` Mamba-2 B/C groups.

State layouts match what transformers keeps in its cache:

=========================  =====================  ==============================
recurrence                 per-token state        cached state
=========================  =====================  ==============================
``gated_delta_rule``       ``[B, T, Hv, Dk, Dv]``  ``[B, Hv, Dk, Dv]`` (key dim first)
``kimi_delta_attention``   ``[B, T, H, Dk, Dv]``   ``[B, H, Dk, Dv]``
``selective_scan``         ``[B, T, D, N]``        ``[B, D, N]``
``ssd``                    ``[B, T, H, P, N]``     ``[B, H, P, N]``
=========================  =====================  ==============================
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["gated_delta_rule", "kimi_delta_attention", "selective_scan", "ssd", "l2norm", "decayed_outer_products"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (FLA's convention: ``+ eps``, not ``max``)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, num_heads: int, what: str) -> torch.Tensor:
    """Repeat each head of ``x [B, T, h, ...]`` so it serves ``num_heads // h`` consecutive heads."""
    h = x.shape[2]
    if num_heads % h:
        raise ValueError(f"{what}: {num_heads} heads is not a multiple of {h}")
    return x.repeat_interleave(num_heads // h, dim=2) if h != num_heads else x


def _delta_rule(q, k, v, decay, beta, initial_state, use_qk_l2norm):
    """Shared loop. ``decay`` is ``[B, T, Hv, Dk]`` (per key channel, log space)."""
    batch, seq_len, num_v_heads, v_dim = v.shape
    k_dim = k.shape[-1]
    q, k, v, decay, beta = (t.float() for t in (q, k, v, decay, beta))
    q = _expand_heads(q, num_v_heads, "q")
    k = _expand_heads(k, num_v_heads, "k")
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * k_dim**-0.5

    if initial_state is None:
        state = q.new_zeros(batch, num_v_heads, k_dim, v_dim)
    else:
        state = initial_state.float().clone()

    outputs, states = [], []
    for t in range(seq_len):
        q_t, k_t, v_t, beta_t = q[:, t], k[:, t], v[:, t], beta[:, t]  # [B,Hv,Dk], ..., [B,Hv,Dv], [B,Hv]
        # S_t = diag(exp(g_t)) S_{t-1}   (rows of S are key channels)
        state = decay[:, t].exp()[..., None] * state
        # S_t = S_t + k_t ⊗ β_t (v_t − S_tᵀ k_t)
        prediction = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = beta_t[..., None] * (v_t - prediction)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        # o_t = S_tᵀ q_t
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
        states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule (Gated DeltaNet; qwen3_5, qwen3_next, olmo_hybrid), one token at a time.

    Args:
        q, k: ``[B, T, Hk, Dk]``. ``Hv`` must be a multiple of ``Hk``; each q/k head
            serves ``Hv // Hk`` consecutive value heads.
        v: ``[B, T, Hv, Dv]``.
        g: ``[B, T, Hv]``, the log decay (``<= 0``): the state is multiplied by ``exp(g_t)``.
        beta: ``[B, T, Hv]``, the write strength.
        initial_state: ``[B, Hv, Dk, Dv]`` or ``None`` (zeros).
        use_qk_l2norm: l2-normalise q and k (eps 1e-6) before anything else.

    Queries are scaled by ``Dk ** -0.5`` after the l2 norm. Per token::

        S_t = exp(g_t) S_{t-1}
        S_t = S_t + k_t ⊗ β_t (v_t − S_tᵀ k_t)
        o_t = S_tᵀ q_t

    Returns:
        ``(outputs [B, T, Hv, Dv], states [B, T, Hv, Dk, Dv])``, float32;
        ``states[:, t]`` is the state after token ``t``.
    """
    decay = g.float()[..., None].expand(*g.shape, k.shape[-1])
    return _delta_rule(q, k, v, decay, beta, initial_state, use_qk_l2norm)


def kimi_delta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi delta attention (KDA; kimi_linear): the delta rule with a per-key-channel decay.

    Args:
        q, k: ``[B, T, H, Dk]`` (transformers' Kimi uses one head count throughout; a
            smaller q/k head count is expanded as in :func:`gated_delta_rule`).
        v: ``[B, T, H, Dv]``.
        g: ``[B, T, H, Dk]``, log decay per key channel.
        beta: ``[B, T, H]``.
        initial_state: ``[B, H, Dk, Dv]`` or ``None`` (zeros).
        use_qk_l2norm: l2-normalise q and k (eps 1e-6), then scale q by ``Dk ** -0.5``
            (the same order as transformers' ``recurrent_kimi_delta_attention``).

    Per token::

        S_t = diag(exp(g_t)) S_{t-1}          (rows of S are key channels)
        S_t = S_t + k_t ⊗ β_t (v_t − S_tᵀ k_t)
        o_t = S_tᵀ q_t

    Returns:
        ``(outputs [B, T, H, Dv], states [B, T, H, Dk, Dv])``, float32.
    """
    if g.shape[-1] != k.shape[-1] or g.ndim != 4:
        raise ValueError(f"kimi_delta_attention: g must be [B, T, H, Dk], got {tuple(g.shape)}")
    return _delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm)


def selective_scan(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1 selective scan (S6), tokens first, one token at a time.

    Args:
        x: ``[B, T, D]``, the conv'd inner activations.
        dt: ``[B, T, D]``, the time step before bias and softplus.
        A: ``[D, N]`` (negative; ``-exp(A_log)``).
        B, C: ``[B, T, N]``.
        D: ``[D]`` skip weight, or ``None``.
        z: ``[B, T, D]`` gate, or ``None``.
        dt_bias: ``[D]`` or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        initial_state: ``[B, D, N]`` or ``None`` (zeros). transformers' prompt kernel has no
            such argument; it always starts from zeros.

    Per token, with ``Δ_t = softplus(dt_t + dt_bias)``::

        h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t       h: [B, D, N]
        y_t = h_t C_t + D ⊙ x_t
        y_t = y_t ⊙ silu(z_t)                              (when z is given)

    Note: transformers' kernels take channel-first ``[B, D, T]`` / ``[B, N, T]`` tensors;
    this one is tokens-first.

    Returns:
        ``(y [B, T, D], states [B, T, D, N])``, float32.
    """
    x, dt, A, B, C = (t.float() for t in (x, dt, A, B, C))
    batch, seq_len, dim = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    delta = F.softplus(dt) if dt_softplus else dt  # [B, T, D]

    h = x.new_zeros(batch, dim, A.shape[-1]) if initial_state is None else initial_state.float().clone()
    ys, states = [], []
    for t in range(seq_len):
        decay = torch.exp(delta[:, t, :, None] * A)  # [B, D, N]
        h = decay * h + (delta[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]
        y = torch.einsum("bdn,bn->bd", h, C[:, t])
        if D is not None:
            y = y + D.float() * x[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].float())
        ys.append(y)
        states.append(h)
    return torch.stack(ys, dim=1), torch.stack(states, dim=1)


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 state space duality (SSD) written as a token recurrence.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]``, the time step before bias and softplus.
        A: ``[H]`` (negative; one scalar per head).
        B, C: ``[B, T, G, N]``; ``H`` must be a multiple of ``G`` and each group is
            shared by ``H // G`` consecutive heads.
        D: ``[H]`` skip weight, or ``None``.
        dt_bias: ``[H]`` or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``Δ`` is clamped to this range after the softplus.
        initial_state: ``[B, H, P, N]`` or ``None`` (zeros).

    Per token, with ``Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit)``::

        h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t           h: [B, H, P, N]
        y_t = h_t C_t + D x_t

    The gate ``z`` is not part of the scan in Mamba-2 (transformers applies it in a gated
    RMSNorm afterwards).

    Returns:
        ``(y [B, T, H, P], states [B, T, H, P, N])``, float32.
    """
    x, dt, A, B, C = (t.float() for t in (x, dt, A, B, C))
    batch, seq_len, num_heads, head_dim = x.shape
    B = _expand_heads(B, num_heads, "B")
    C = _expand_heads(C, num_heads, "C")
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    delta = F.softplus(dt) if dt_softplus else dt
    delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])  # [B, T, H]

    if initial_state is None:
        h = x.new_zeros(batch, num_heads, head_dim, B.shape[-1])
    else:
        h = initial_state.float().clone()
    ys, states = [], []
    for t in range(seq_len):
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]  # [B, H, 1, 1]
        h = decay * h + delta[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", h, C[:, t])
        if D is not None:
            y = y + D.float()[:, None] * x[:, t]
        ys.append(y)
        states.append(h)
    return torch.stack(ys, dim=1), torch.stack(states, dim=1)


def decayed_outer_products(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, initial_state: torch.Tensor) -> torch.Tensor:
    """The recurrence the fast fills write, ``S_t = exp(g_t) ⊙ S_{t-1} + a_t ⊗ b_t``, in the inputs' own dtype.

    What the gated DeltaNet (``a = k``, ``b`` its delta), Kimi (a decay per key
    row), Mamba-2 (``a = Δx``, ``b = B``) and Mamba-1 (one channel's ``[N, 1]``
    state, a decay per row) each carry once their writes are known.

    Args:
        g: ``[B, H, T, 1 | R]``, the log decay (one per head, or per row).
        a: ``[B, H, T, R]``; b: ``[B, H, T, C]``.
        initial_state: ``[B, H, R, C]``.

    Returns:
        ``states [B, T, H, R, C]``: ``states[:, t]`` is ``S_t``.
    """
    state, states = initial_state.clone(), []
    for t in range(g.shape[2]):
        state = g[:, :, t].exp()[..., None] * state + a[:, :, t, :, None] * b[:, :, t, None, :]
        states.append(state)
    if not states:
        return initial_state.new_zeros(initial_state.shape[0], 0, *initial_state.shape[1:])
    return torch.stack(states, dim=1)
