"""Effective attention: the exact coefficients with which a recurrent mixer's output is a sum over its values.

Given a call's queries, keys, gates and decays, the kernel's output is
linear in the values it writes: ``o_t = Σ_s A[t, s] v_s`` plus what it reads
from the state entering the call (``state_input_readout``). Each kind's file of
`nnterp.fast` computes ``A`` from the kernel call's own arguments (by the signature table's
names), per head (a gated DeltaNet, Kimi, Mamba-2) or per channel (Mamba-1), and
`RecurrentMixer` declares these values and methods (in its own body, so they
keep their place among its values) for every component with an ``EFFECTIVE`` spec.

Memory: ``A`` is ``4 · batch · heads · seq²`` bytes (per channel on Mamba-1);
`effective_attention_of` selects rows (``positions``) and heads or channels to
keep it bounded.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..core import indices
from ..core.calls import mediator
from ..core.dims import BATCH, MIXER_HEADS, SEQ, Values
from ..core.errors import SignatureError, Unavailable
from ..core.values import DerivedEProperty
from ..recurrent import arguments
from ..recurrent.kernels import needs_torch_kernels

#: ``[batch, mixer_heads, seq, seq]``: rows are the output's tokens t, columns the values' tokens s.
EffectiveAttention = Float[Tensor, f"{BATCH} {MIXER_HEADS} {SEQ} {SEQ}"]


def _effective_reason(mixer: Any) -> str | None:
    if type(mixer).EFFECTIVE is None:
        return f"{type(mixer).__name__} has no effective attention"
    return needs_torch_kernels(mixer)


def _effective_attention(mixer: Any) -> torch.Tensor:
    return mixer._effective(None, None, True)[0]


def _state_input_readout(mixer: Any) -> torch.Tensor | None:
    return mixer._effective(None, None, False)[1]


#: The values `RecurrentMixer` declares in its own body (the descriptor objects live here).
EFFECTIVE_ATTENTION = DerivedEProperty(
    _effective_attention,
    description=(
        "the exact effective attention A[t, s]: the kernel's output at t is sum_s A[t, s] * attention_values[s] "
        "(+ state_input_readout), [batch, mixer_heads, seq, seq], float32; 4*batch*mixer_heads*seq^2 bytes "
        "(effective_attention_of(positions=...) keeps it bounded)"
    ),
    unavailable=_effective_reason,
    annotation=EffectiveAttention,
)
STATE_INPUT_READOUT = DerivedEProperty(
    _state_input_readout,
    description=(
        "the part of the kernel's output read from the state entering the call (the rest of it is "
        "sum_s effective_attention[t, s] * attention_values[s]), [batch, seq, mixer_heads, value_dim]; None on a fresh prompt"
    ),
    unavailable=_effective_reason,
    annotation=Values,
    none_on_fresh_prompt=True,
)

def effective_attention_of(self, positions: Any = None, heads: Any = None, channels: Any = None) -> torch.Tensor:
    """Rows ``positions`` of `effective_attention`, for some heads (Mamba-1: ``channels``) only.

    ``positions``, ``heads``, ``channels``: ``None`` (all), an int, a
    slice, a range, a list or a tensor of indices (negative ones count
    from the end), in the order given. The result is ``[batch,
    len(heads or channels), len(positions), seq]``, float32, and costs
    ``4 · batch · len(heads) · len(positions) · seq`` bytes. ``heads``
    selects a gated DeltaNet's value heads or Mamba-2's heads, ``channels``
    Mamba-1's channels; the other one raises. Indices are checked as
    ``states_of`` checks its positions (`nnterp.core.indices`): a float or a
    bool raises `WrongType`, one outside the axis `PositionError`.
    """
    what = "linear_attn.effective_attention_of"
    reason = _effective_reason(self)
    if reason is not None:
        raise Unavailable(what, reason)
    mediator(f"`{what}`")
    axis = type(self).EFFECTIVE.axis
    chosen, other = (heads, channels) if axis == "heads" else (channels, heads)
    if other is not None:
        wrong = "channels" if axis == "heads" else "heads"
        raise SignatureError(f"`{what}`: {type(self).__name__}'s effective attention has one pattern per {axis[:-1]}: pass {axis}=, not {wrong}=")
    seq = self._record().seq
    rows = indices.selection(positions, seq, what, "position")
    width = self.dims()[type(self).values()["effective_attention"].annotation.dim_str.split()[1]]
    picked = indices.selection(chosen, width, what, axis[:-1], f"the mixer's {width} {axis}")
    return self._effective(rows, picked, True)[0]

def effective_values(self, positions: Any, selection: Any, coefficients: bool) -> tuple:
    """``(A, readout)`` of this call, from its kernel's arguments by name, tokens first."""
    call = self._record()
    table = self._table(call)
    served = {name: arguments.serve(table, name, call.arguments) for name in table}
    return type(self).EFFECTIVE.compute(served, positions, selection, coefficients)
