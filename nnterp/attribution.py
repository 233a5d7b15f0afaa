"""Attribution patching on recurrent state: which state, at which position, matters for an output.

Mental model: `nnterp.sweep.patch_sweep` runs one trace per cell (layer ×
position), writing the corrupt prompt's state after token ``t`` into the clean
run (``set_state_after(t, corrupt)``) and measuring the metric. Attribution
patching (Nanda 2023; Syed et al. 2023, arXiv:2310.10348) estimates every
cell at once, to first order:

    effect(l, t) ≈ ∂metric/∂S_l(t) · (S_l^corrupt(t) − S_l^clean(t))

with the gradient taken on the clean run, with respect to the state after
token ``t`` *as the tokens after t read it* (what ``set_state_after`` writes;
token ``t``'s own output keeps the state it computed). It costs one forward
of the corrupt prompt (its states) and one forward and one backward of the
clean one, whatever the number of cells. The gradient is ``states.grad``
(`nnterp.recurrent.gradients`): every layer's ``states`` on the clean run is a
leaf the later tokens read through.

It is an estimate: a state is a large matrix and the metric is not linear in
it, so a cell whose corrupt state is far from the clean one can be off, in
size and even in sign. Confirm the cells it ranks first with
``set_state_after`` (or ``patch_sweep`` on those layers and positions).

The states after every token need the token-by-token kernel (or, on
Mamba-2, a chunk per token): the clean and corrupt runs are made inside
`nnterp.sweep.per_token_states`, which routes the family for their duration.
Where a layer's states carry no gradient even then (``support()``'s
``linear_attn.states.grad`` row gives the reason: ``fast_states(model)``
computes them beside the kernel), `state_attribution` raises `Unavailable`
with that reason before running anything. A model transformers cannot run
with a cache (every layer recurrent: `nnterp.recurrent.no_cache`) is traced
with ``use_cache=False``, which serves the states and their gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .core.errors import InvalidArgument, ShapeError, Unavailable, WrongType
from .core.indices import layer_index
from .recurrent.no_cache import run_kwargs
from .sweep import per_token_states, prompt_states, recurrent_layers, sweep_positions, target_id

__all__ = ["AttributionResult", "state_attribution", "rank_correlation"]


class AttributionResult:
    """What `state_attribution` estimated.

    Attributes:
        layers: the recurrent layer indices (rows of the grid).
        positions: the token positions (columns).
        tokens: the clean prompt's tokens (``convert_ids_to_tokens``).
        clean: the metric on the clean prompt.
        estimate: ``[len(layers), len(positions)]``, gradient · (corrupt − clean)
            summed over the state: the first-order change of the metric when
            the clean state after that token is replaced by the corrupt one.
        gradients: ``{layer: [batch, seq, ...state]}``, the metric's gradient by
            each state (``states.grad`` of the clean run).
    """

    def __init__(self, layers: list, positions: list, tokens: list, clean: float, estimate: torch.Tensor, gradients: dict) -> None:
        self.layers, self.positions, self.tokens = layers, positions, tokens
        self.clean, self.estimate, self.gradients = clean, estimate, gradients

    @property
    def effect(self) -> torch.Tensor:
        """The estimate, named as `nnterp.sweep.SweepResult.effect` (the plots read either)."""
        return self.estimate

    def top(self, k: int = 5) -> list:
        """The ``k`` cells of largest estimated effect in size: ``[(layer, position, estimate), ...]``."""
        flat = self.estimate.abs().flatten()
        order = flat.argsort(descending=True)[:k]
        columns = len(self.positions)
        return [(self.layers[i // columns], self.positions[i % columns], float(self.estimate.flatten()[i])) for i in order.tolist()]

    def __repr__(self) -> str:
        return f"AttributionResult(layers={self.layers}, positions={len(self.positions)}, clean={self.clean:.4g})"


def _metric_function(model: Any, metric: Any) -> Callable[[Any], torch.Tensor]:
    """``metric`` as a function of the model inside a trace: a callable as given, a token as its next-token probability."""
    if callable(metric):
        return metric
    target = target_id(model, metric)
    return lambda m: m.next_token_probs[0, target]


def state_attribution(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Any,
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
) -> AttributionResult:
    """Estimate, per recurrent layer and position, the metric's change when the clean state is replaced by the corrupt one.

    Args:
        model: a `StandardizedTransformer` with recurrent mixers.
        clean: the prompt that is run (a string, or token ids ``[1, seq]``).
        corrupt: the prompt whose state after token ``t`` replaces the clean
            one's, or ``{layer: states [1, seq, ...state]}`` to give the
            corrupt states directly.
        metric: a one-token string or token id (its next-token probability,
            as `nnterp.sweep.patch_sweep` measures), or ``metric(model) ->``
            a scalar tensor, read inside the clean trace (for instance
            ``lambda m: m.logits[0, -1, a] - m.logits[0, -1, b]``).
        layers: recurrent layer indices (default: all).
        positions: token positions (default: every position both prompts
            have); negative counts from the clean prompt's end.

    Returns:
        an `AttributionResult`.
    """
    if torch.is_inference_mode_enabled():
        raise Unavailable(
            "state_attribution", "it takes the metric's gradient, which torch.inference_mode() disables: call it outside "
            "the inference_mode block (it turns gradients on itself, and touches no parameter's .grad)"
        )
    for name, prompt in (("clean", clean), ("corrupt", corrupt)):
        if isinstance(prompt, (list, tuple)):
            raise WrongType(f"state_attribution takes one {name} prompt (a string or ids [1, seq]), got a {type(prompt).__name__}: call it once per prompt")
        if isinstance(prompt, torch.Tensor) and (prompt.dim() != 2 or prompt.shape[0] != 1):
            raise ShapeError(f"state_attribution takes {name} ids of shape [1, seq], got {tuple(prompt.shape)}: call it once per prompt")
    function = _metric_function(model, metric)
    layers = recurrent_layers(model, layers)
    run = run_kwargs(model)  # without a cache where transformers refuses one: the states and gradients are served so
    with per_token_states(model):
        for index in layers:
            # What support() says in linear_attn.states.grad once the family is routed (the fast path's states, for one).
            reason = model.layers[index].linear_attn.gradients()["states"]
            if reason is not None:
                raise Unavailable(f"state_attribution on layer {index}", reason)
        if isinstance(corrupt, Mapping):
            where = "state_attribution(corrupt={layer: states})"
            corrupt_states = {layer_index(layer, len(model.layers), where): states for layer, states in corrupt.items()}
        else:
            corrupt_states = prompt_states(model, corrupt, layers, run)
        missing = [layer for layer in layers if layer not in corrupt_states]
        if missing:
            raise InvalidArgument(f"the corrupt states given have no layers {missing}")
        saved: list = []
        values: list = []
        with torch.enable_grad(), model.trace(clean, **{**run, **model.family.BACKWARD_KWARGS}):
            # A graph from the first layer on, whatever the parameters require: the states' taps need one.
            embedded = model.embed_tokens.output
            if not embedded.requires_grad:
                model.embed_tokens.output = embedded.detach().requires_grad_(True)
            for index in layers:
                saved.append(model.layers[index].linear_attn.states.save())
            value = function(model)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ShapeError(f"state_attribution: metric(model) must be a scalar tensor (one value), got {got}: reduce it, e.g. m.logits[0, -1, a]")
            values.append(value.detach().save())
            # Only the states' gradients: no parameter's .grad is touched.
            value.backward(inputs=list(saved))
    clean_states = dict(zip(layers, saved))
    for layer in layers:
        given, state = corrupt_states[layer], clean_states[layer]
        if not isinstance(given, torch.Tensor):
            raise WrongType(f"corrupt[{layer}] must be a tensor of states, got {type(given).__name__}")
        one = (1, *state.shape[2:])  # one token's state, as state_output serves it
        if given.dim() != state.dim() or given.shape[0] != 1 or tuple(given.shape[2:]) != one[1:]:
            raise ShapeError(
                f"corrupt[{layer}] has shape {tuple(given.shape)}; expected [1, seq, {', '.join(map(str, one[1:]))}]: one "
                f"prompt's state after every token (each of shape {one}, as state_output serves it), as `states` reads it"
            )
    seq = clean_states[layers[0]].shape[1]
    positions = sweep_positions(positions, seq, min(corrupt_states[layer].shape[1] for layer in layers))
    estimate = torch.zeros(len(layers), len(positions))
    gradients = {}
    for row, layer in enumerate(layers):
        grad = clean_states[layer].grad
        if grad is None:
            raise InvalidArgument(f"layer {layer}'s states got no gradient: the metric does not depend on them")
        gradients[layer] = grad
        difference = corrupt_states[layer][:, positions].to(grad.dtype) - clean_states[layer].detach()[:, positions]
        estimate[row] = (grad[:, positions] * difference).flatten(2).sum(-1).sum(0)
    ids = clean if not isinstance(clean, str) else model.tokenizer(clean, return_tensors="pt").input_ids
    tokens = model.tokenizer.convert_ids_to_tokens(torch.as_tensor(ids).reshape(-1).tolist())
    return AttributionResult(layers, positions, tokens, float(values[0]), estimate, gradients)


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties broken by order)."""
    ranks = [x.flatten().argsort().argsort().float() for x in (a, b)]
    centred = [r - r.mean() for r in ranks]
    denominator = float(centred[0].norm() * centred[1].norm())
    return float((centred[0] * centred[1]).sum()) / denominator if denominator else float("nan")
