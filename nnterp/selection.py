"""``model.states_of(positions=None, layers=None)``: the states of the layers and tokens a researcher names.

One read over several recurrent layers, inside a trace::

    with model.trace(prompt):
        chosen = model.states_of(positions=[3, -1], layers=[0, 2]).save()
    chosen[2]            # [batch, 2, ...state]: layer 2's states after tokens 3 and -1

It returns a plain ``dict`` ``{layer index: tensor}``. nnsight 0.8 mounts
``.save()`` on every object, a dict included, and a saved dict keeps the
tensors it holds; ``nnsight.save(model.states_of(...))`` is the same where
that mount is off (``CONFIG.APP.PYMOUNT``).

Each selected layer is its mixer's own read: ``states`` (every token) when
``positions`` is ``None``, else ``states_of(positions)``, whose cost and memory
follow the positions (`RecurrentMixer.states_of`). An unselected
layer is not touched, so nothing is computed for it. The layers are read in
the model's order whatever order they are given in, since a trace serves
values in the order the forward computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.calls import mediator
from .core.errors import InvalidArgument, Unavailable, WrongType
from .core.indices import layer_indices


def recurrent_layers(model: Any) -> list[int]:
    """The indices of the layers that have a recurrent mixer (``layer.linear_attn``), in model order."""
    return [index for index, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 4, 5]`` as ``"0-2, 4-5"``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def chosen_layers(model: Any, layers: Any) -> list[int]:
    """``layers`` (``None``, an int, a sequence of ints, a 1-d tensor) as distinct layer indices from 0, in model order.

    Raises `WrongType` for a value that is not a layer index, `PositionError`
    for one outside the model's layers, and `InvalidArgument` naming the layers
    that have a recurrent mixer for one that has none.
    """
    recurrent = recurrent_layers(model)
    if not recurrent:
        raise InvalidArgument(f"{model.family.NAME} has no recurrent mixer on any layer, so no `model.states_of`")
    if layers is None:
        return recurrent
    if isinstance(layers, torch.Tensor) and layers.dim() > 1:
        raise WrongType(
            f"model.states_of(layers=...) takes a layer index or a sequence of them (ints), got a {layers.dim()}-d tensor"
        )
    found = set(layer_indices(layers, len(model.layers), "model.states_of(layers=...)"))
    missing = sorted(found - set(recurrent))
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise InvalidArgument(
            f"model.states_of(layers=...): layer{plural} {_spans(missing)} of {model.family.NAME} ha{'ve' if plural else 's'} "
            f"no recurrent mixer; the layers with one are {_spans(recurrent)}"
        )
    return sorted(found)


def states_of(model: Any, positions: Any = None, layers: Any = None) -> dict[int, torch.Tensor]:
    """See `StandardizedTransformer.states_of`."""
    chosen = chosen_layers(model, layers)
    what = "states" if positions is None else "states_of"
    mediator("`model.states_of`")
    for index in chosen:
        mixer = model.layers[index].linear_attn
        reason = type(mixer).values()["states"].reason(mixer)
        if reason is not None:
            raise Unavailable(f"layers[{index}].linear_attn.{what}", reason)
    if (
        positions is not None
        and not isinstance(positions, (torch.Tensor, int, str, bytes))
        and hasattr(positions, "__iter__")
    ):
        positions = list(positions)  # every layer reads the same positions: an iterator is consumed once
    found = {}
    for index in chosen:  # in model order: the forward serves them in that order
        mixer = model.layers[index].linear_attn
        found[index] = mixer.states if positions is None else mixer.states_of(positions)
    return found
