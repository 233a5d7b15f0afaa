"""`LongContextProfile`: what `nnterp.long_context_profile` returns, and its plot.

Every tensor is float32 on the CPU, keyed by model layer index. ``state_norm[layer]``
and ``decay[layer]`` are ``[tokens, heads]`` (channels on Mamba-1, the RG-LRU,
RWKV-4 and the short convolution), row ``i`` the token at ``positions[i]``;
``memory[layer]`` and ``memory_all`` are ``[len(memory_at), len(lags)]``, entry
``[i, j]`` the KL at ``T = memory_at[i]`` when the state entering
``t = T - lags[j]`` is reset (NaN where ``lags[j] > T``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .plot import INSTALL

__all__ = ["LongContextProfile"]


@dataclass
class LongContextProfile:
    """Per recurrent layer: state norms and mean log decays per kept token and head, and effective memory."""

    state_norm: dict[int, torch.Tensor]
    decay: dict[int, torch.Tensor]
    memory: dict[int, torch.Tensor]
    memory_all: torch.Tensor
    positions: torch.Tensor
    memory_at: list[int] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)

    def plot(self, layer: int | None = None, title: str = "Long-context profile") -> Any:
        """A matplotlib ``Figure``: one layer's (default: the first profiled) state norm and mean decay per head
        against the token position, and effective memory against the lag, one line per ``T``."""
        try:
            from matplotlib.figure import Figure
        except ImportError as error:  # the optional extra is missing
            raise ImportError(f"LongContextProfile.plot needs matplotlib: {INSTALL}") from error
        layer = next(iter(self.state_norm)) if layer is None else layer
        figure = Figure(figsize=(12, 3.2), layout="constrained")
        norm, decay, memory = figure.subplots(1, 3)
        x = self.positions.numpy()
        norm.plot(x, self.state_norm[layer].numpy(), linewidth=0.8)
        norm.set(title=f"layer {layer}: state norm per head", xlabel="token")
        if layer in self.decay:
            decay.plot(x, self.decay[layer].numpy(), linewidth=0.8)
        decay.set(title="mean log decay per head", xlabel="token")
        lags = [max(lag, 0.5) for lag in self.lags]  # lag 0 on a log axis
        table = self.memory.get(layer)
        for i, T in enumerate(self.memory_at if table is not None else []):
            memory.plot(lags, table[i].numpy(), marker="o", label=f"T={T}")
        memory.set(title="effective memory: KL when reset at T - lag", xlabel="lag (tokens)", xscale="log")
        if self.memory_at and table is not None:
            memory.legend(fontsize="small")
        figure.suptitle(title)
        return figure
