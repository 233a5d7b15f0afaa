"""The mLSTM's state (Beck et al., 2024, arXiv:2405.04517) packed into one tensor, and its recurrence from a kernel call's arguments.

The mLSTM carries three tensors per head, stored as transformers' kernels
store them, scaled by ``exp(-m)`` so that exponential input gates never
overflow: the matrix memory ``C`` ``[key_dim, value_dim]`` (key first, as a
DeltaNet's state), the normalizer ``n`` ``[key_dim]`` and the stabilizer ``m``
(one number). nnterp serves the three as ONE tensor ``[..., key_dim,
value_dim + 2]``: ``[..., :value_dim]`` is ``C``, ``[..., value_dim]`` is
``n`` and ``[..., value_dim + 1]`` is ``m`` repeated along the key axis. A
single value keeps the three consistent: ``C`` and ``n`` mean nothing without
the ``m`` they are scaled by, so a patch from another prompt must carry all
three, and does. `unpack` reads ``m`` off key row 0.

Per token, from the gate pre-activations ``ĩ`` (input) and ``f̃`` (forget)::

    m_t = max(logsigmoid(f̃_t) + m_{t-1}, ĩ_t)
    C_t = exp(logsigmoid(f̃_t) + m_{t-1} - m_t) C_{t-1} + exp(ĩ_t - m_t) k_t v_tᵀ
    n_t = (the same gates) n_{t-1} + exp(ĩ_t - m_t) k_t

Pure torch: this file knows nothing of nnsight or of the components.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``(C [..., k, v], n [..., k], m [..., 1])`` -> one float32 tensor ``[..., k, v + 2]`` (a new tensor)."""
    c = c.float()
    return torch.cat([c, n.float()[..., None], m.float()[..., None, :].expand(*c.shape[:-1], 1)], dim=-1)


def unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed state ``[..., k, v + 2]`` -> ``(C [..., k, v], n [..., k], m [..., 1])``, float32, contiguous."""
    return (
        state[..., :-2].contiguous(),
        state[..., -2].contiguous(),
        state[..., 0, -1:].contiguous(),
    )


def mlstm_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    initial: torch.Tensor | None = None,
) -> torch.Tensor:
    """The packed state after every token, ``[batch, seq, heads, key_dim, value_dim + 2]``, float32.

    Args are tokens first, as nnterp serves them: ``q``/``k`` ``[batch, seq,
    heads, key_dim]``, ``v`` ``[batch, seq, heads, value_dim]``, ``igate``/
    ``fgate`` ``[batch, seq, heads]`` (pre-activations); ``initial`` a packed
    state or ``None`` (zeros). The update is transformers' one-step kernel's,
    in float32; ``q`` is not needed for the state.
    """
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if initial is None:
        c = k.new_zeros((batch, heads, key_dim, value_dim), dtype=torch.float32)
        n = k.new_zeros((batch, heads, key_dim), dtype=torch.float32)
        m = k.new_zeros((batch, heads, 1), dtype=torch.float32)
    else:
        c, n, m = unpack(initial.float())
    k32, v32 = k.float(), v.float()
    log_f = F.logsigmoid(fgate.float())
    i = igate.float()
    out = []
    for t in range(seq):
        m_new = torch.maximum(log_f[:, t, :, None] + m, i[:, t, :, None])
        f_act = torch.exp(log_f[:, t, :, None] + m - m_new)
        i_act = torch.exp(i[:, t, :, None] - m_new)
        c = f_act[..., None] * c + i_act[..., None] * (k32[:, t, :, :, None] @ v32[:, t, :, None, :])
        n = f_act * n + i_act * k32[:, t]
        m = m_new
        out.append(pack(c, n, m))
    return torch.stack(out, dim=1)
