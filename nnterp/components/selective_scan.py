"""SelectiveScan: Mamba-1's selective state-space mixer (minimal: its output only, for now)."""

from __future__ import annotations

from ..core.standard import Standard
from .attention import unwrapped_output


class SelectiveScan(Standard):
    """A Mamba-1 mixer (``layer.linear_attn``)."""

    KIND = "linear_attn"

    attention_output = unwrapped_output("the mixer's output, [batch, seq, hidden]")
