"""Exact effective attention of a recurrent mixer, from its kernel call's arguments.

Mental model. Given everything but the values (the queries, keys, decays,
write strengths, gates), a recurrent mixer's kernel output is *linear* in the
values it is fed, so it is exactly an attention pattern over them plus the
readout of the state entering the call:

    out_t = Σ_{s ≤ t} A[t, s] v_s  +  readout_t(state entering)

``A`` is ``[batch, heads, seq, seq]`` (a value head of a gated DeltaNet,
a Mamba-2 head) or ``[batch, channels, seq, seq]`` (Mamba-1, whose decays
differ per channel). It is the kernel's own coefficient, not an estimate:
``Σ_s A[t, s] v_s + readout_t`` reproduces the kernel's output within float32
rounding.

* The delta rules (gated DeltaNet, Kimi delta attention): `effective_delta`.
* The scans (Mamba-2's SSD, Mamba-1's selective scan): `effective_scan`.
* The other kinds (RG-LRU, WKV, the mLSTM, the short convolution) in their
  own modules of this package, each with its `EffectiveSpec`.

This module holds what they share: the row and head selection (`indices`),
grouped heads expanded as the kernels expand them (`expand_groups`), and
`EffectiveSpec`, what a component computes by its signature table's names.

Numerics: every exponent is a sum of log decays over ``s < j ≤ t`` (≤ 0),
accumulated from a nearby anchor, never a difference of two long prefix
sums; everything runs in float32, the time step ``Δ`` in ``dt``'s dtype
first as the kernels compute it.

Memory: the result is ``4 · batch · heads · seq²`` bytes (Mamba-1:
``channels`` for ``heads``, 1536 channels on Mamba-130m: 6 GB for 1000
tokens), plus ``4 · batch · heads · key_dim · seq`` bytes of carried ``P`` on
a DeltaNet and bounded blocks elsewhere. ``positions=`` (rows ``t``) and
``heads=`` / ``channels=`` keep it bounded: the result is then
``[batch, len(selection), len(positions), seq]``.

Pure torch: nothing here imports nnsight or the rest of nnterp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Selection = Sequence[int] | torch.Tensor | range | slice | int | None


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
