"""What a kind's fast path and effective attention compute from a call's arguments: `FastSpec` and `EffectiveSpec`.

A call of a recurrent mixer runs one kernel (or one method, or the forward's
own operations); a component's signature table (``CHUNK_ARGUMENTS``) names
its arguments (``q``, ``k``, ``v``, ``g``, ``beta`` on a gated DeltaNet;
``x``, ``dt``, ``A``, ``B``, ``C``, ``dt_bias``, ... on Mamba-2; ``state`` the
state the call starts from). Every kind file of this package (`gated_deltanet`,
`state_space`, `selective_scan`, `lightning_attention`, `mlstm`, `rg_lru`,
`wkv`, `short_convolution`) exposes the same functions of those
``arguments``, served tokens first (the table's layouts applied), and its
specs built from them (``FAST``, ``EFFECTIVE``):

* ``states(arguments, out=None)``: the state after every token, ``[batch,
  seq, ...state]`` float32, into ``out`` when given (stored in its dtype);
* ``state_shape(arguments)``: ``(batch, ...state)`` of one state;
* ``one_pass(arguments, out)``: the kernel's own return computed with the
  states in one pass, as ``(result, states)``, so the kernel call can be
  skipped; ``None`` where it would not equal the kernel's pure-torch body
  within float32 rounding (Mamba's in a model of another dtype: their bodies
  round their states first; the delta rule's compute in float32 from any
  dtype and round their output only, so their one pass runs in a bfloat16
  model too, its output rounded alike). Only for a call the pure-torch body would run, without autograd;
* ``effective_attention(arguments, positions, selection, coefficients)``:
  ``(A, readout)``, below;
* ``resume(arguments, initial, result)``: only for a kernel that takes no
  initial state (Mamba-1's always starts from zeros): its ``result`` on
  ``arguments``, turned into what it would have returned starting from
  ``initial`` (exact: the recurrence is linear in its start state);
* ``tap(arguments, taps)``: an exact zero in the layout of the kernel's output
  on the call's tokens that depends on ``taps`` (a leaf of the states' shape,
  holding them) as the later tokens' outputs read an addition to each state;
  added to the call's output under autograd (on its last tokens along
  ``output_axis``: the short convolution's output also holds its window's
  leading entries), so the output's gradient reaches the state after every
  token (``states.grad``: lightning attention's, the mLSTM's, the short
  convolution's).

A `FastSpec` also says which arguments carry one entry per token (``tokens``:
a call is split at a position by slicing these), the token axis of the
kernel's output (``output_axis``: the outputs on two parts of a split call
are concatenated there), and whether ``one_pass`` takes an ``out`` with fewer
tokens than the call (``ring``: token ``t`` in slot ``t % slots``, the
kernel's result without keeping the states). ``result`` is the kernel's own
return, in its own layout.

Effective attention. Given everything but the values (the queries, keys,
decays, write strengths, gates), a recurrent mixer's kernel output is
*linear* in the values it is fed, so it is exactly an attention pattern over
them plus the readout of the state entering the call:

    out_t = Σ_{s ≤ t} A[t, s] v_s  +  readout_t(state entering)

``A`` is ``[batch, heads, seq, seq]`` (a value head of a gated DeltaNet, a
Mamba-2 head) or ``[batch, channels, seq, seq]`` (Mamba-1, whose decays
differ per channel). It is the kernel's own coefficient, not an estimate:
``Σ_s A[t, s] v_s + readout_t`` reproduces the kernel's output within float32
rounding. Every exponent is a sum of log decays over ``s < j ≤ t`` (≤ 0),
accumulated from a nearby anchor, never a difference of two long prefix
sums; everything runs in float32, the time step ``Δ`` in ``dt``'s dtype first
as the kernels compute it (`step`).

Memory: ``A`` is ``4 · batch · heads · seq²`` bytes (Mamba-1: ``channels``
for ``heads``, 1536 channels on Mamba-130m: 6 GB for 1000 tokens).
``positions=`` (rows ``t``) and ``heads=`` / ``channels=`` (`indices`) keep
it bounded: the result is then ``[batch, len(selection), len(positions), seq]``.

Pure torch: this file knows nothing of nnsight, of the components or of any kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Selection = Sequence[int] | torch.Tensor | range | slice | int | None


@dataclass(frozen=True)
class FastSpec:
    """What a component's fast path computes from its kernel call, by its signature table's names (module docstring)."""

    name: str
    compute: Callable[[dict, torch.Tensor | None], torch.Tensor]
    tokens: tuple
    state_shape: Callable[[dict], tuple]
    resume: Callable[[dict, torch.Tensor, object], object] | None = None
    one_pass: Callable[[dict, torch.Tensor | None], tuple | None] | None = None
    ring: bool = False
    #: The kernel output's token axis (split outputs are concatenated on it): Mamba-1's is channel-first.
    output_axis: int = 1
    #: The ``tokens`` the states are written from (the others only the output reads: queries, Mamba's ``C``, ``z``);
    #: ``None``: all of them. A replay of the states (`nnterp.recurrent.replay`) stores only these.
    state_tokens: tuple | None = None
    #: The state ``arguments`` start from as one of ``compute``'s own states ``[batch, ...state]`` (``None``: zeros, a
    #: fresh prompt), where the call takes it in another format than ``compute`` returns (RWKV-4's triple, a window).
    entering: Callable[[dict], torch.Tensor | None] | None = None
    #: The inverse: the arguments that make ``compute`` continue from one of its own states (``{"state": state}``).
    starting: Callable[[torch.Tensor | None], dict] | None = None
    #: The final state the kernel returns as one of ``compute``'s own (``None``: the same already; RWKV-4's triple).
    leaving: Callable[[Any], torch.Tensor] | None = None
    #: ``tap(arguments, taps)``: an exact zero in the kernel output's layout on the call's tokens that depends on ``taps``
    #: ``[batch, seq, ...state]`` as the later tokens' outputs read an addition to each state; added to the output's last
    #: tokens under autograd, so a leaf's gradient at ``t`` is the loss's by the state after ``t`` (``states.grad``).
    #: ``None``: no tap.
    tap: Callable[[dict, torch.Tensor], torch.Tensor] | None = None
    #: ``final_state(arguments)``: the state after the run's last token as ``compute`` computes it, the others not kept,
    #: where a call source has no kernel to run for it (lightning's forward). ``None``: the kernel's final state.
    final_state: Callable[[dict], torch.Tensor] | None = None
    #: The inverse of ``leaving``, where the kernel returns its final state in another format than ``starting`` passes
    #: it (the mLSTM takes one packed state through its table and returns ``(C, n, m)``); ``None``: as ``starting``'s.
    returned: Callable[[torch.Tensor], Any] | None = None

    def __repr__(self) -> str:
        return f"FastSpec({self.name})"

    def entering_state(self, arguments: dict) -> torch.Tensor | None:
        """The state ``arguments`` start from, ``[batch, ...state]`` as ``compute`` writes states, or ``None`` (zeros)."""
        if self.entering is not None:
            return self.entering(arguments)
        state = arguments.get("state")
        return state if isinstance(state, torch.Tensor) else None

    def starting_from(self, state: torch.Tensor | None) -> dict:
        """The arguments that make ``compute`` start from ``state`` (one of its own, ``[batch, ...state]``; ``None``: zeros)."""
        return self.starting(state) if self.starting is not None else {"state": state}

    def returned_state(self, state: torch.Tensor) -> Any:
        """``state`` (one of ``compute``'s own) as the kernel returns its final state."""
        return self.returned(state) if self.returned is not None else self.starting_from(state)["state"]


@dataclass(frozen=True)
class EffectiveSpec:
    """What a component's effective attention computes from its kernel call, by its signature table's names.

    ``compute(arguments, positions, selection, coefficients)`` takes the
    call's arguments tokens first (the layouts applied) and returns ``(A,
    readout)`` (``A`` is ``None`` when ``coefficients`` is false);
    ``axis`` names what ``selection`` picks on axis 1 (``"heads"`` or
    ``"channels"``).
    """

    name: str
    compute: Callable[[dict, Any, Any, bool], tuple]
    axis: str

    def __repr__(self) -> str:
        return f"EffectiveSpec({self.name})"


def indices(selection: Selection, size: int, what: str) -> torch.Tensor:
    """``selection`` (``None`` for all, an int, a slice, a range, a sequence, a tensor) as a long tensor in ``[0, size)``."""
    if selection is None:
        return torch.arange(size)
    if isinstance(selection, slice):
        return torch.arange(size)[selection]
    if isinstance(selection, int):
        selection = [selection]
    index = torch.as_tensor(list(selection) if isinstance(selection, range) else selection, dtype=torch.long).reshape(-1).cpu()
    index = torch.where(index < 0, index + size, index)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
        raise IndexError(f"{what} out of range for {size}: {selection}")
    return index


def expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, seq, groups, d]`` -> ``[b, seq, heads, d]``, each group serving ``heads // groups`` consecutive heads."""
    groups = x.shape[2]
    if groups == heads:
        return x
    if heads % groups:
        raise ValueError(f"{heads} heads is not a multiple of {groups} groups")
    return x.repeat_interleave(heads // groups, dim=2)


def last_state(out: torch.Tensor, seq: int) -> torch.Tensor:
    """The state after the last of ``seq`` tokens in ``out`` (a ring too), as a copy: the cache keeps it, and a
    view would keep every state alive."""
    return out[:, (seq - 1) % out.shape[1]].clone()
