"""StateSpace: Mamba-2's state-space-duality mixer (minimal: its output only, for now)."""

from __future__ import annotations

from ..core.standard import Standard
from .attention import unwrapped_output


class StateSpace(Standard):
    """A Mamba-2 mixer (``layer.linear_attn``)."""

    KIND = "linear_attn"

    attention_output = unwrapped_output("the mixer's output, [batch, seq, hidden]")
