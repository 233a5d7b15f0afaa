"""The RG-LRU's scan (RecurrentGemma, Griffin arXiv:2402.19427): the state after every token and the effective attention.

The RG-LRU's method ``_rnn_scan(hidden_states=x, recurrent_gate=a, reset=,
recurrent_states=h_in)`` adds ``x_t`` (the normalized, gated input
``sqrt(1 - a_t²) i_t ⊙ x_t`` the layer computed) to a state it decays by
``ã_t = a_t ⊙ ¬reset_t`` (0 at a reset: position 0 of a sequence):

    h_t = ã_t h_{t-1} + x_t,        y_t = h_t

so ``y_t = Σ_{s≤t} (∏_{s<j≤t} ã_j) x_s + (∏_{j≤t} ã_j) h_in``, per channel.
Shapes, tokens first: ``x``, ``a`` ``[batch, seq, lru_width]``, ``reset``
``[batch, seq, 1]`` (bool), a state ``[batch, lru_width]``; the scan
accumulates in float32 and returns its outputs in ``x``'s dtype.

`lru_states` runs the scan's own operations (the gate masked by the reset,
cast to float32, times the state, plus the input in float32), so its states
equal the scan's bit for bit; `effective_attention` gives ``A[c, t, s] =
∏_{s<j≤t} ã_j[c]`` as products, never a difference of log sums. The failure
mode worth knowing: ``ã`` is exactly 0 at a reset, so its log is ``-inf``; a
log-space formula would read ``-inf - (-inf)`` as NaN there.

By the scan method's names (`nnterp.fast.spec`): `states`, `one_pass`,
`state_shape`, `effective_attention`; the specs ``FAST``, ``EFFECTIVE``.
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import empty_states
from .scan import differentiable
from .spec import EffectiveSpec, FastSpec, indices


def lru_states(
    x: torch.Tensor, a: torch.Tensor, reset: torch.Tensor, initial_state: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The state after every token, ``[batch, seq, lru_width]`` float32, by ``_rnn_scan``'s operations.

    Without autograd written into ``out`` (`empty_states` when ``None``); under
    it stacked (in-place writes into a buffer the graph keeps would break it).
    """
    gate = a * ~reset
    h = x.new_zeros(x[:, 0].shape, dtype=torch.float32) if initial_state is None else initial_state.float()
    if differentiable(x, a, initial_state):
        found = []
        for t in range(x.shape[1]):
            h = gate[:, t].type(torch.float32) * h + x[:, t].type(torch.float32)
            found.append(h)
        return torch.stack(found, 1)
    if out is None:
        out = empty_states(x.shape, x.device)
    for t in range(x.shape[1]):
        if out.dtype != torch.float32:  # stored rounded (fast_states' dtype): the state carried on stays float32
            h = gate[:, t].type(torch.float32) * h + x[:, t].type(torch.float32)
            out[:, t] = h
            continue
        torch.mul(gate[:, t].type(torch.float32), h, out=out[:, t])
        h = out[:, t].add_(x[:, t].type(torch.float32))
    return out


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """`lru_states` of a served call's arguments, into ``out`` when given (under autograd too: a copy of the stack)."""
    a = arguments
    state = a.get("state")
    found = lru_states(a["x"], a["a"], a["reset"], state if isinstance(state, torch.Tensor) else None, out)
    if out is None or found is out:
        return found
    out.copy_(found)
    return out


def one_pass(arguments: dict, out: torch.Tensor) -> tuple | None:
    """The scan's return ``(outputs, final state)`` with the states: its outputs are its states, cast to ``x``'s
    dtype; ``None`` where ``out`` stores them rounded (the outputs need the float32 states)."""
    if out.dtype != torch.float32:
        return None
    states(arguments, out)
    return (out.to(arguments["x"].dtype, copy=True), out[:, -1].clone()), out


def state_shape(arguments: dict) -> tuple:
    """``(batch, lru_width)``."""
    x = arguments["x"]
    return (x.shape[0], x.shape[2])


def effective_attention(arguments: dict, positions: Any, channels: Any, coefficients: bool) -> tuple:
    """``(A [batch, channels, positions, seq], readout [batch, positions, channels] or None)`` of one scan call.

    ``A[c, t, s] = ∏_{s<j≤t} ã_j[c]`` (1 on the diagonal, 0 above it), with
    ``ã = a`` masked by the reset as the scan masks it; products, never a
    difference of log sums (ã is exactly 0 at a reset).
    """
    a = arguments
    gate = (a["a"] * ~a["reset"]).float()
    seq, width = gate.shape[1], gate.shape[2]
    chosen = indices(channels, width, "channels").to(gate.device)
    gate = gate.index_select(2, chosen)
    rows = indices(positions, seq, "positions")
    readout = None
    if a.get("state") is not None and isinstance(a["state"], torch.Tensor):
        decayed = torch.cumprod(gate, dim=1).index_select(1, rows.to(gate.device))  # ∏_{j≤t}
        readout = decayed * a["state"].float().index_select(1, chosen)[:, None]
    if not coefficients:
        return None, readout
    out = gate.new_zeros(gate.shape[0], chosen.numel(), rows.numel(), seq)
    for k, t in enumerate(rows.tolist()):
        out[:, :, k, t] = 1.0
        if t:
            # ∏_{s<j≤t} for every s < t: a reversed cumulative product over j = t, t-1, ..., 1.
            out[:, :, k, :t] = torch.cumprod(gate[:, 1 : t + 1].flip(1), dim=1).flip(1).transpose(1, 2)
    return out, readout


def entering(arguments: dict) -> torch.Tensor | None:
    """The state the scan starts from, ``[batch, lru_width]``: zeros in a row that resets at its first token (the
    scan drops what it held: a prompt), so a replay never keeps a state the recurrence discards."""
    state = arguments.get("state")
    return state.float() * ~arguments["reset"][:, 0] if isinstance(state, torch.Tensor) else None


#: RecurrentGemma's ``_rnn_scan``, prompt and decode step alike.
FAST = FastSpec("rg-lru scan", states, ("x", "a", "reset"), state_shape, one_pass=one_pass, entering=entering)
#: RecurrentGemma's ``_rnn_scan``, prompt and decode step alike.
EFFECTIVE = EffectiveSpec("rg-lru scan", effective_attention, "channels")
