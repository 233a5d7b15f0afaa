"""The one check of a layer index, for every place nnterp takes one.

A layer index is an int in ``[-n, n)`` for a model of ``n`` layers, a
negative one counting from the end as a Python list does. Anything outside
raises `PositionError` (an ``IndexError``, as ``list[n]`` does) naming the
range; it never wraps. A float or a bool is not an index: `WrongType`.
The toolkit (``interventions``, ``steer``, ``skip_layers``, the
``layers_output[i]`` accessors, ``plot.logit_lens``, ``patch_sweep``,
``state_attribution``, ``model.states_of``) checks through here.
"""

from __future__ import annotations

import operator
from typing import Any

from .errors import PositionError, WrongType


def layer_index(layer: Any, count: int, where: str) -> int:
    """``layer`` as an index from 0 into ``count`` layers; `PositionError` outside ``[-count, count)``.

    ``where`` names the argument in the message (``"get_token_activations(layers=...)"``).
    """
    if isinstance(layer, bool) or not hasattr(layer, "__index__"):
        raise WrongType(f"{where}: a layer index is an int, got {type(layer).__name__} {layer!r}")
    index = operator.index(layer)
    if not -count <= index < count:
        raise PositionError(
            f"{where}: layer {index} is out of range for the model's {count} layers; a layer index is in "
            f"[-{count}, {count}) (negative ones count from the end), and nnterp does not wrap it (IndexError)"
        )
    return index % count


def layer_indices(layers: Any, count: int, where: str) -> list[int]:
    """An int or an iterable of them (a 1-d tensor too), each checked by `layer_index`, in the order given."""
    if hasattr(layers, "tolist") and getattr(layers, "ndim", 1) <= 1:
        layers = layers.tolist()
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        return [layer_index(layers, count, where)]
    return [layer_index(layer, count, where) for layer in layers]
