"""Lightning attention's recurrence, written from the paper's equation (MiniMax-01, arXiv:2501.08313, §2.2.1).

Per head ``h`` with decay rate ``λ_h``, in float32, one plain loop over tokens:

    S_t = exp(-λ_h) S_{t-1} + k_tᵀ v_t        [key_dim, value_dim]
    o_t = q_t S_t

Independent of nnterp and of transformers' module (which computes it blockwise
on a prompt). ``test_lightning.py`` checks it reproduces the HF module's output.
Shapes: ``q``, ``k`` ``[B, T, H, Dk]``, ``v`` ``[B, T, H, Dv]``, ``slope`` ``[H]``;
returns the outputs ``[B, T, H, Dv]`` and the state after every token ``[B, T, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch


def lightning_recurrence(q, k, v, slope, initial_state=None):
    """``(outputs [B, T, H, Dv], states [B, T, H, Dk, Dv])``, float32."""
    batch, seq, heads, key_dim = q.shape
    q, k, v = q.float(), k.float(), v.float()
    decay = torch.exp(-slope.float()).view(1, heads, 1, 1)
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs, states = [], []
    for t in range(seq):
        state = decay * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
        states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


def slope_rates(heads: int, layer: int, layers: int) -> torch.Tensor:
    """λ per head of block ``layer`` (MiniMax-01: ALiBi-like slopes ``2^(-8i/heads)``, shrunk linearly with depth)."""
    base = 2 ** (-8 / heads)
    rates = torch.tensor([base ** (i + 1) for i in range(heads)], dtype=torch.float64)
    return (rates * (1 - layer / (layers - 1 + 1e-5) + 1e-5)).float()
