"""`Layer`: one block of the residual stream, with its parts under standard names.

Whatever a family calls them, a layer exposes

* ``self_attn``: its softmax attention block (an `Attention`), or ``None``;
* ``linear_attn``: its recurrent mixer (a `RecurrentMixer`: a gated DeltaNet,
  a Mamba mixer, Kimi's delta attention), or ``None``;
* ``mlp``: its feed-forward block (the whole sparse block on a mixture of
  experts), or ``None`` where the block has none (Mamba).

so ``getattr(layer, "linear_attn", None) is not None`` tells a recurrent block.
The parts are found by the component class nnterp built for each child, not by
name: Kimi-Linear keeps its delta attention under HF's ``self_attn``, and it
is ``linear_attn`` here.

Values, ``[batch, seq, hidden]``, unwrapped from the tuple some releases
return and rewrapped on write:

* ``layer_input``: the hidden states entering the block.
* ``layer_output``: the hidden states leaving it (the residual stream after it).
"""

from __future__ import annotations

from typing import Any

from ..core.dims import Hidden
from ..core.standard import Standard
from ..core.values import EProperty, FirstInput, Unwrap, check_tensor

PARTS = ("self_attn", "linear_attn", "mlp")


def _validate(name: str):
    return lambda envoy, new, current: check_tensor(f"`layer.{name}`", new, current)


class Layer(Standard):
    """A decoder block (``model.layers[i]``)."""

    KIND = "layer"
    #: The attribute of the HF block holding its feed-forward part, or ``None``.
    MLP: str | None = "mlp"

    layer_input = EProperty(
        "input", select=FirstInput(), description="hidden states entering the block, [batch, seq, hidden]",
        validate=_validate("layer_input"), annotation=Hidden,
    )
    layer_output = EProperty(
        "output", select=Unwrap(), description="hidden states leaving the block, [batch, seq, hidden]",
        validate=_validate("layer_output"), annotation=Hidden,
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(Layer, self).__init__(*args, **kwargs)
        parts: dict[str, Any] = dict.fromkeys(PARTS)
        for child in self._children:
            kind = getattr(child, "KIND", None)
            if kind in ("self_attn", "linear_attn"):
                parts[kind] = child
        if self.MLP is not None:
            parts["mlp"] = self._child_map.get(self.MLP)
        # Instance attributes, so they shadow the HF child of the same name
        # (Kimi's delta attention sits at `self_attn`) and a missing part is None.
        for name, envoy in parts.items():
            object.__setattr__(self, name, envoy)

    def parts(self) -> dict[str, Any]:
        """``{part: envoy}`` for the parts this block has."""
        return {name: getattr(self, name) for name in PARTS if getattr(self, name) is not None}

