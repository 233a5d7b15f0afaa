"""The indices a researcher passes (token positions, heads, channels, layers): one check for every reader.

An index is a Python ``int`` (not a ``bool``, not a float), a negative one
counting from the end of its axis. Anything else raises `WrongType`; an index
outside the axis raises `PositionError` naming the range, never wraps.
``states_of``, ``state_after``, ``set_state_after`` and
``effective_attention_of`` on every kind check their indices here, so one
input is refused, or served, the same by all of them.

A *layer* index (`layer_index`, `layer_indices`) is checked the same way over
the model's ``n`` layers, ``[-n, n)``: the toolkit (``interventions``,
``steer``, ``skip_layers``, the ``layers_output[i]`` accessors,
``plot.logit_lens``, ``patch_sweep``, ``state_attribution``,
``model.states_of``) checks through here, and an index outside never wraps.

A *sequence* (`sequence`: a list, a tuple, a range, a 1-d integer tensor) is
what ``states_of(positions)`` takes; a *selection* (`selection`) also takes
``None`` (all), one ``int`` and a ``slice``, as ``effective_attention_of`` does.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .errors import PositionError, WrongType

#: How the type error names one index of each unit.
NOUNS = {"position": "token position"}


def index(t: Any, size: int, what: str, unit: str = "position", place: str | None = None) -> int:
    """``t`` as an index of an axis of ``size`` (negative counts from the end), or an error naming the range.

    ``what`` names the reader (``"state_after(3)"``); ``unit`` one index
    (``"position"``, ``"head"``, ``"channel"``); ``place`` the axis
    (default: ``"this call's <size> tokens"``).
    """
    if not isinstance(t, int) or isinstance(t, bool):
        raise WrongType(f"{what} takes a {NOUNS.get(unit, unit)} (an int), got {type(t).__name__}")
    found = t + size if t < 0 else t
    if not 0 <= found < size:
        where = place if place is not None else f"this call's {size} tokens"
        raise PositionError(f"{what}: {unit} {t} is outside {where} (0..{size - 1})")
    return found


def _elements(chosen: Any) -> Any:
    # A tensor's elements as Python numbers: a float or bool tensor gives floats or bools, which `index` refuses.
    if isinstance(chosen, torch.Tensor) and chosen.dim() <= 1:
        return chosen.reshape(-1).tolist()
    return chosen


def sequence(chosen: Any, size: int, what: str, unit: str = "position", place: str | None = None) -> list[int]:
    """``chosen`` (a sequence of ints, a range, a 1-d tensor) as indices from 0, in the order given (repeats kept)."""
    chosen = _elements(chosen)
    if isinstance(chosen, (int, str, bytes, torch.Tensor)) or not hasattr(chosen, "__iter__"):
        plural = NOUNS.get(unit, unit)
        raise WrongType(f"{what} takes a sequence of {plural}s (ints), got {type(chosen).__name__}")
    return [index(t, size, what, unit, place) for t in chosen]


def selection(chosen: Any, size: int, what: str, unit: str = "position", place: str | None = None) -> list[int] | None:
    """``chosen`` as `sequence` takes it, or ``None`` (all: returned as ``None``), one ``int``, or a ``slice``."""
    if chosen is None:
        return None
    if isinstance(chosen, slice):
        return list(range(size))[chosen]
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        return [index(chosen, size, what, unit, place)]
    if isinstance(chosen, torch.Tensor) and chosen.dim() == 0:
        return [index(chosen.item(), size, what, unit, place)]  # a float or bool tensor's item is refused
    return sequence(chosen, size, what, unit, place)


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


__all__ = ["index", "sequence", "selection", "layer_index", "layer_indices"]
