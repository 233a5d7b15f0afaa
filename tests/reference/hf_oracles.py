"""Oracles on a plain transformers causal LM, without nnsight.

Everything here drives a ``PreTrainedModel`` (eval mode, float32 for tight comparisons)
through its own forward and its own ``DynamicCache``, and reads or writes a layer's
recurrent state through the cache's layer objects (``cache.layers[i].recurrent_states[0]``).
The library's tests compare what nnterp reads and patches against these.

Portability across the transformers range nnterp supports (5.18-5.24):

* the model forward takes the cache as ``cache=`` from 5.24, and before that as
  ``past_key_values=`` (attention-hybrid families) or ``cache_params=`` (mamba, mamba2);
  :func:`cache_kwarg` finds the name from the forward signature;
* the output exposes it as ``.cache`` from 5.24, ``.past_key_values`` / ``.cache_params``
  before (:func:`output_cache`);
* the layer fields ``recurrent_states`` / ``conv_states`` (dicts keyed by ``state_idx``) are
  the same in that whole range, whereas ``Cache.get_recurrent_state`` only exists from 5.21.

Only unpadded batches are supported: no attention mask is passed, so every row must be
a full-length prompt. Positions are passed (``position_ids``, where the forward takes
them) counting on from the tokens already cached, as ``generate`` does for an unpadded
prompt: some forwards (Bamba's) do not derive them from the cache.

Aliasing: the cached state tensors keep one address for the life of the cache. Prompt
calls write them with ``copy_`` and Mamba-1/Mamba-2 decode kernels update them in place
(``state.copy_``), so :func:`recurrent_state` returns a live view: clone it to keep a value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

__all__ = [
    "cache_kwarg",
    "output_cache",
    "recurrent_state",
    "conv_state",
    "set_recurrent_state",
    "set_conv_state",
    "prefix_states",
    "continue_from_state",
    "greedy",
    "state_gradient",
]

_CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its cache by in the installed transformers.

    ``"cache"`` (5.24+), ``"past_key_values"`` (attention-hybrid families before 5.24) or
    ``"cache_params"`` (mamba, mamba2 before 5.24). In 5.24 the old names are still accepted
    through ``deprecate_kwarg`` but warn; the signature only lists the new one.
    """
    params = inspect.signature(model.forward).parameters
    for name in _CACHE_KWARGS:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes none of {_CACHE_KWARGS}: {list(params)}")


def output_cache(outputs):
    """The cache of a model output: ``.cache`` (5.24+), ``.past_key_values`` or ``.cache_params``."""
    for name in _CACHE_KWARGS:
        cache = getattr(outputs, name, None)
        if cache is not None:
            return cache
    raise ValueError(f"{type(outputs).__name__} carries no cache (was use_cache=True?)")


def _linear_layer(cache, layer_idx: int, field: str):
    layers = cache.layers
    if not 0 <= layer_idx < len(layers):
        raise IndexError(f"layer {layer_idx} out of range for a cache of {len(layers)} layers")
    layer = layers[layer_idx]
    if not hasattr(layer, field):
        raise ValueError(f"cache layer {layer_idx} is a {type(layer).__name__}, which has no {field}")
    if getattr(layer, field).get(0) is None:
        raise ValueError(f"cache layer {layer_idx} has no {field}[0] yet (run a prompt first)")
    return layer


def recurrent_state(cache, layer_idx: int) -> torch.Tensor:
    """The live recurrent state tensor of ``layer_idx`` (``cache.layers[i].recurrent_states[0]``).

    Shapes: GDN ``[B, Hv, Dk, Dv]``, Kimi ``[B, H, Dk, Dv]``, Mamba-1 ``[B, D_inner, N]``,
    Mamba-2 ``[B, H, P, N]``; float32 in every family. Not a copy: clone it to keep it.
    MiniMax keeps its lightning blocks' states in a list of its own (``MiniMaxCache.linear_cache``,
    ``[B, H, Dk, Dv]`` in the model's dtype), replaced on every call: read it, or write into it, between calls.
    """
    linear = getattr(cache, "linear_cache", None)
    if linear is not None:
        if not 0 <= layer_idx < len(linear) or not isinstance(linear[layer_idx], torch.Tensor):
            raise ValueError(f"cache layer {layer_idx} has no linear state yet (run a prompt first)")
        return linear[layer_idx]
    return _linear_layer(cache, layer_idx, "recurrent_states").recurrent_states[0]


def conv_state(cache, layer_idx: int) -> torch.Tensor:
    """The live conv state of ``layer_idx``, ``[B, conv_dim, conv_kernel]`` (not a copy)."""
    return _linear_layer(cache, layer_idx, "conv_states").conv_states[0]


def _copy_into(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
    with torch.no_grad():
        target.copy_(value)


def set_recurrent_state(cache, layer_idx: int, value: torch.Tensor) -> None:
    """Overwrite layer ``layer_idx``'s recurrent state in place (same tensor object, same address)."""
    _copy_into(recurrent_state(cache, layer_idx), value, f"recurrent state of layer {layer_idx}")


def set_conv_state(cache, layer_idx: int, value: torch.Tensor) -> None:
    """Overwrite layer ``layer_idx``'s conv state in place."""
    _copy_into(conv_state(cache, layer_idx), value, f"conv state of layer {layer_idx}")


def _forward(model, input_ids, cache=None, start: int = 0):
    """One call from position ``start``: positions are passed where the forward takes them, as ``generate`` does
    (Bamba's forward counts from 0 on every call without them, cache or not)."""
    kwargs = {"use_cache": True}
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    if "position_ids" in inspect.signature(model.forward).parameters:
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        kwargs["position_ids"] = positions.unsqueeze(0).expand(input_ids.shape[0], -1)
    return model(input_ids=input_ids, **kwargs)


@torch.no_grad()
def prefix_states(model, input_ids: torch.Tensor, layer_idx: int, attention_mask=None) -> torch.Tensor:
    """The state ``layer_idx`` holds after each prefix, from independent plain forwards.

    For each ``t``, runs ``input_ids[:, :t+1]`` with ``use_cache=True`` and a fresh cache
    and clones the layer's cached recurrent state.

    Args:
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]`` or ``None``; sliced like the ids when given.

    Returns:
        ``[B, T, *state_shape]``; ``[:, t]`` is the state after token ``t``.
    """
    states = []
    for t in range(input_ids.shape[1]):
        kwargs = {"use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, : t + 1]
        out = model(input_ids=input_ids[:, : t + 1], **kwargs)
        states.append(recurrent_state(output_cache(out), layer_idx).clone())
    return torch.stack(states, dim=1)


@torch.no_grad()
def continue_from_state(
    model,
    input_ids: torch.Tensor,
    T: int,
    layer_idx: int,
    state: torch.Tensor,
    conv_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last-position logits after replacing ``layer_idx``'s state after token ``T``.

    Runs the prefix ``input_ids[:, :T+1]`` with a cache, overwrites the layer's cached
    recurrent state (and conv state, if given) with ``state``, then feeds the remaining
    tokens one at a time through the cache. One at a time matters: Mamba-1's prompt path
    restarts its SSM state from zero, so a multi-token continuation would ignore the cache.

    Args:
        input_ids: ``[B, L]``, unpadded.
        T: the position whose post-token state is replaced (``0 <= T < L``).
        state: the layer's state shape (see :func:`recurrent_state`).

    Returns:
        logits ``[B, vocab]`` at position ``L - 1``. When ``T == L - 1`` nothing runs after
        the replacement, so these are the prefix run's logits.
    """
    length = input_ids.shape[1]
    if not 0 <= T < length:
        raise IndexError(f"T={T} outside a prompt of {length} tokens")
    out = _forward(model, input_ids[:, : T + 1])
    cache = output_cache(out)
    set_recurrent_state(cache, layer_idx, state)
    if conv_state is not None:
        set_conv_state(cache, layer_idx, conv_state)
    for i in range(T + 1, length):
        out = _forward(model, input_ids[:, i : i + 1], cache, start=i)
    return out.logits[:, -1]


@torch.no_grad()
def greedy(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    patch: Callable[[int, object], None] | None = None,
    suppress_tokens: tuple[int, ...] = (),
) -> torch.Tensor:
    """Plain greedy decoding with the cache: one prompt call, then one token per call.

    Args:
        input_ids: ``[B, T]``, unpadded (no attention mask is used).
        max_new_tokens: tokens to generate; no EOS stopping.
        suppress_tokens: ids never chosen (``generate``'s ``min_new_tokens`` does this for EOS).
        patch: optional ``patch(step, cache)``, called before decode step ``step``
            (``1 .. max_new_tokens - 1``; step 1 is the first one-token call, which feeds
            the token the prompt call chose). It may overwrite states in ``cache``.

    Returns:
        ``[B, T + max_new_tokens]``: the prompt and the generated ids.
    """
    ids = input_ids
    if max_new_tokens <= 0:
        return ids
    out = _forward(model, ids)
    cache = output_cache(out)
    for step in range(1, max_new_tokens + 1):
        logits = out.logits[:, -1].clone()
        # As generate's min_new_tokens does for EOS: never chosen.
        logits[:, list(suppress_tokens)] = float("-inf")
        next_ids = logits.argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_ids.to(ids.dtype)], dim=1)
        if step == max_new_tokens:
            break
        if patch is not None:
            patch(step, cache)
        out = _forward(model, next_ids, cache, start=ids.shape[1] - 1)
    return ids


def state_gradient(
    model,
    input_ids: torch.Tensor,
    T: int,
    layer_idx: int,
    metric: Callable[[torch.Tensor], torch.Tensor],
    one_call: bool = False,
) -> torch.Tensor:
    """``d metric / d state`` of ``layer_idx``'s state after token ``T``, by autograd through plain transformers.

    ``one_call``: feed the rest as one call continuing the cache (what a trace over that cache runs: transformers'
    prefill kernel from the cached state, whose convolution starts from zeros) instead of one token at a time.

    The prefix ``input_ids[:, :T+1]`` runs without gradients; the layer's cached
    state is then replaced by a leaf holding the same values, and the rest of the
    prompt is fed one token at a time through the cache, so every later token
    reads the state through the model's own decode kernels. ``metric`` maps the
    last position's logits ``[B, vocab]`` to a scalar.

    The decode kernels update the cached state in place (Mamba's
    ``state.copy_``), which autograd refuses on a tensor it saved;
    ``allow_mutation_on_saved_tensors`` keeps a copy of what it saved instead.

    Returns:
        the gradient, shaped like the layer's state (:func:`recurrent_state`).
    """
    length = input_ids.shape[1]
    if not 0 <= T < length - 1:
        raise IndexError(f"T={T}: a token must follow the state for it to have a gradient (prompt of {length})")
    with torch.no_grad():
        cache = output_cache(_forward(model, input_ids[:, : T + 1]))
    live = recurrent_state(cache, layer_idx)
    leaf = live.detach().clone().requires_grad_(True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        live.copy_(leaf)
        if one_call:
            out = _forward(model, input_ids[:, T + 1 :], cache, start=T + 1)
        for i in range(T + 1, length if not one_call else T + 1):
            out = _forward(model, input_ids[:, i : i + 1], cache, start=i)
        (grad,) = torch.autograd.grad(metric(out.logits[:, -1]), leaf)
    return grad
