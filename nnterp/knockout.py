"""``model.knockout``: token-to-token knockout on every mixer and attention layer of a model at once.

The knockout itself is each part's: ``linear_attn.knockout``
(`nnterp.recurrent.knockout`) and ``self_attn.knockout``
(`nnterp.components.attention.Attention.knockout`), which this module's
docstring describes for attention:

Mental model. An attention head's output at ``t`` is ``Σ_s a[t, s] · v_s``
with ``a`` its softmax weights; knocking out the flow from source ``s`` to
target ``t`` is editing ``a[t, s]``, in the eager forward (load the model
with ``StandardizedTransformer(..., enable_attention_probs=True)``):

* ``mode="value"``: the term ``a[t, s] · v_s`` removed, every other weight as
  it was (no renormalization): the exact analogue of a recurrent mixer's
  ``knockout(mode="value")``, which removes ``A[t, s] · v_s`` from its
  effective attention (`nnterp.recurrent.knockout`);
* ``mode="mask"``: the pre-softmax score of ``(t, s)`` set to ``-inf`` and the
  row renormalized (Geva et al. 2023's attention knockout), computed as
  ``a[t, s] = 0`` and the row divided by what is left of it (an attention
  sink's share, where the family has one, stays in the denominator, as the
  softmax keeps it).

Positions are positions of this call (negative ones count from the end), as
the recurrent mixers take them; on a decode step with a cache the keys before
the call are not positions of it. Every head is knocked out.

`model_knockout` is ``model.knockout``: the same knockout on the mixer and
the attention layer of each listed layer.
"""

from __future__ import annotations

from typing import Any

from .core.errors import InvalidArgument
from .core.indices import layer_indices


def model_knockout(model: Any, sources: Any, targets: Any = None, layers: Any = None, mode: str = "value") -> None:
    """``model.knockout``: the knockout on every mixer and attention layer of ``layers`` (default: all), in layer order.

    ``mode="value"`` acts on both kinds; ``"skip"`` on the mixers only and ``"mask"`` on the attention layers
    only (a layer that has neither part for the mode raises).
    """
    what = "model.knockout"
    if mode not in ("value", "skip", "mask"):
        raise InvalidArgument(f"`{what}`: mode must be 'value', 'skip' (recurrent mixers) or 'mask' (attention layers), got {mode!r}")
    chosen = layer_indices(layers, len(model.layers), what) if layers is not None else range(len(model.layers))
    acted = False
    for index in chosen:
        layer = model.layers[index]
        mixer, attention = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        if mixer is not None and mode != "mask":
            mixer.knockout(sources, targets=targets, mode=mode)
            acted = True
        if attention is not None and mode != "skip":
            attention.knockout(sources, targets=targets, mode=mode)
            acted = True
    if not acted:
        part = {"skip": "a recurrent mixer", "mask": "an attention layer"}.get(mode, "a mixer or an attention layer")
        raise InvalidArgument(f"`{what}`: none of layers {list(chosen)} has {part} for mode={mode!r}")
