"""Steering the recurrent state: add a vector to what a mixer carries forward, and find one from contrasting prompts.

Mental model. A recurrent mixer's memory is its state; steering it is adding
``scale * delta`` to the state after some tokens, so every later token (and,
for the state a call leaves, every later decode step) reads the steered
memory. ``mix.steer_state(delta, positions=None, scale=1.0)`` does it on one
mixer (`nnterp.recurrent.knockout.RecurrenceInterventions.steer_state`);
`steer_states` is ``model.steer_states``, one delta per layer.

`state_steering_vectors` is the state analogue of contrastive activation
addition (Rimsky et al. 2023; Paulo et al. 2404.05971 on recurrent models):
per layer, the mean state after ``position`` over the positive prompts minus
the same over the negative ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .core.errors import InvalidArgument, WrongType
from .core.indices import layer_index, layer_indices


def _mixer(model: Any, layer: int, what: str) -> Any:
    index = layer_index(layer, len(model.layers), what)
    mixer = getattr(model.layers[index], "linear_attn", None)
    if mixer is None:
        raise InvalidArgument(f"`{what}`: layer {layer} has no recurrent mixer (linear_attn) to steer")
    return mixer


def steer_states(model: Any, vectors: dict, scale: float = 1.0, positions: Any = None) -> None:
    """``model.steer_states``: ``steer_state(vectors[layer], positions, scale)`` on each listed layer's mixer, in layer order."""
    what = "model.steer_states"
    if not isinstance(vectors, dict) or not vectors:
        raise WrongType(f"`{what}` takes a non-empty dict {{layer: delta}}, got {type(vectors).__name__}")
    for layer in sorted(vectors, key=lambda i: layer_index(i, len(model.layers), what)):
        _mixer(model, layer, what).steer_state(vectors[layer], positions=positions, scale=scale)


def _mean_states(model: Any, prompts: Sequence[str], layers: list[int], position: int, batch_size: int, bar: Any) -> dict:
    total: dict[int, torch.Tensor] = {}
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        found: dict = {}
        with torch.no_grad(), model.trace(batch):
            for layer in layers:
                mixer = model.layers[layer].linear_attn
                found[layer] = (mixer.state_output if position == -1 else mixer.state_after(position)).save()
        for layer, state in found.items():
            total[layer] = total.get(layer, 0) + state.float().sum(0)
        bar.update(len(batch))
    return {layer: state / len(prompts) for layer, state in total.items()}


def state_steering_vectors(
    model: Any, positive: Sequence[str], negative: Sequence[str], layers: Any = None, position: int = -1,
    batch_size: int = 8, progress: bool = True,
) -> dict[int, torch.Tensor]:
    """``{layer: mean state after position over positive - the same over negative}``, float32, one position's state
    (without a batch axis), for each recurrent layer in ``layers`` (default: every one).

    ``position=-1`` reads each prompt's ``state_output`` (no per-token setting needed); another position reads
    ``state_after(position)``, which needs the kind's per-token setting (``route_kernels``, ``fast_states``) and
    counts in the padded sequence of a batch: pass prompts of one length, or ``batch_size=1``. The prompts run
    in batches of ``batch_size`` (the tokenizer pads them), under ``torch.no_grad()``, with a progress bar.
    """
    what = "state_steering_vectors"
    for name, prompts in (("positive", positive), ("negative", negative)):
        if isinstance(prompts, str) or not prompts:
            raise InvalidArgument(f"`{what}`: {name} is a non-empty sequence of prompts, got {prompts!r}")
    recurrent = [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    chosen = recurrent if layers is None else layer_indices(layers, len(model.layers), what)
    for layer in chosen:
        _mixer(model, layer, what)
    from tqdm.auto import tqdm

    with tqdm(total=len(positive) + len(negative), disable=not progress, desc=what) as bar:
        plus = _mean_states(model, list(positive), chosen, position, batch_size, bar)
        minus = _mean_states(model, list(negative), chosen, position, batch_size, bar)
    return {layer: plus[layer] - minus[layer] for layer in chosen}
