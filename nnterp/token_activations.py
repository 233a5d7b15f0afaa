"""One token's activations per prompt and layer: nnterp 1.x's ``get_token_activations``, with ``values=``.

* `get_token_activations`: without ``values``, 1.x's ``[layers, prompts, hidden]``
  tensor of one token (the last by default) of each prompt; with ``values=`` any
  standard value (``"layer_output"``, ``"self_attn.attention_output"``,
  ``"mlp.mlp_output"``, ``"linear_attn.state_output"``, ...), as
  ``{value: {layer: tensor}}`` over the layers that have the value's part.
* `collect_token_activations_batched`: the same over prompts in batches.

Both are importable from ``nnterp.interventions``, 1.x's path, which builds its
lenses on them. The signature helpers every 1.x helper shares are here too:
`the_model` (the model first, as 1.x's ``nn_model``, or as ``model=``),
`run_locally` (``remote=True`` refused with the way to read on NDIF) and
`chosen_layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .core.errors import InvalidArgument, SignatureError, WrongType
from .core.indices import layer_indices

__all__ = ["get_token_activations", "collect_token_activations_batched", "the_model", "run_locally", "chosen_layers"]

#: The parts of a block a value may be named on, as ``"<part>.<value>"``.
_PARTS = ("self_attn", "linear_attn", "mlp")


def run_locally(remote: bool) -> None:
    """Refuse ``remote=True``: the helpers run here; the same reads run on NDIF inside a remote trace."""
    if remote:
        raise InvalidArgument(
            "nnterp's helpers run locally: for NDIF, make the same reads inside `with model.trace(..., remote=True)` "
            "(docs/remote.md), or build the model with remote=True and read there"
        )


def the_model(function: str, nn_model: Any, model: Any, **required: Any) -> Any:
    """The model a helper was given: first (1.x's ``nn_model``, by position or keyword) or as ``model=``; refuse neither or both."""
    if (nn_model is None) == (model is None):
        given = "both `nn_model` and `model`" if model is not None else "no model"
        raise WrongType(f"{function}() got {given}: pass the model once, first (or as `nn_model=`, 1.x's keyword, or `model=`)")
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise WrongType(f"{function}() missing required argument{'s' if len(missing) > 1 else ''}: {', '.join(map(repr, missing))}")
    return nn_model if nn_model is not None else model


def chosen_layers(model: Any, layers: int | list[int] | None, where: str) -> list[int]:
    """``layers`` as a list of indices counted from 0 (every layer when ``None``); ``where`` names the argument in errors."""
    if layers is None:
        return list(range(model.num_layers))
    return layer_indices(layers, model.num_layers, f"{where}(layers=...)")


def _value_reader(spec: str) -> Callable[[Any], Any]:
    """``"layer_output"`` / ``"linear_attn.state_output"`` -> a reader of it on a layer (giving None where the part is absent)."""
    part, _, name = spec.rpartition(".")
    if not part:
        if spec not in ("layer_input", "layer_output"):
            raise InvalidArgument(f"unknown value {spec!r}: a layer's own values are layer_input and layer_output; name another as '<part>.<value>'")
        return lambda layer: getattr(layer, spec)
    if part not in _PARTS:
        raise InvalidArgument(f"unknown part {part!r} in {spec!r}: one of self_attn, linear_attn, mlp")

    def read(layer: Any) -> Any:
        envoy = getattr(layer, part)
        if envoy is None:
            return None
        if name not in type(envoy).values():
            raise InvalidArgument(f"{part} ({type(envoy).__name__}) has no value {name!r}; it serves {', '.join(type(envoy).values())}")
        return getattr(envoy, name)

    return read


def _per_token(envoy: Any, spec: str) -> bool:
    """Whether a value is documented ``[batch, seq, ...]`` (its jaxtyping annotation), so one token is taken."""
    name = spec.rpartition(".")[2]
    value = type(envoy).values().get(name)
    dims = getattr(getattr(value, "annotation", None), "dim_str", "")
    return dims.split()[:2] == ["batch", "seq"]


def get_token_activations(
    nn_model: Any = None,
    prompts: str | list[str] | None = None,
    layers: int | list[int] | None = None,
    get_activations: Callable[[Any, int], Any] | None = None,
    remote: bool = False,
    idx: int | None = None,
    tracer: Any = None,
    values: str | list[str] | None = None,
    *,
    model: Any = None,
) -> Any:
    """One token's activations (the last by default) of each prompt, at each layer.

    Without ``values``: 1.x's ``[layers, prompts, hidden]`` tensor of
    ``get_activations(model, layer)`` (the layer's output by default).
    With ``values`` (a standard value's name or a list of them:
    ``"layer_output"``, ``"self_attn.attention_output"``, ``"mlp.mlp_output"``,
    ``"linear_attn.state_output"``): ``{value: {layer: tensor}}`` over the
    layers that have the value's part, each ``[prompts, ...]`` at token
    ``idx`` where the value is documented ``[batch, seq, ...]`` (a value without a sequence axis, a recurrent state, whole).
    Batched prompts are left-padded, so ``idx=-1`` is every prompt's last token.
    Inside a trace, pass ``tracer=`` and no prompts: the values come back unsaved.
    ``nn_model`` (first) is 1.x's name for the model; ``model=`` also takes it.
    """
    model = the_model("get_token_activations", nn_model, model)
    with torch.no_grad():  # a block, not a decorator: a server rebuilds the bare function
        run_locally(remote)
        if tracer is None and prompts is None:
            raise SignatureError("pass prompts, or tracer= inside a trace")
        idx = -1 if idx is None else idx
        if idx < 0 and model.tokenizer.padding_side != "left":
            raise InvalidArgument(f"a negative idx needs left padding; the tokenizer pads {model.tokenizer.padding_side}")
        layers = chosen_layers(model, layers, "get_token_activations")
        if values is None:
            get_activations = get_activations or (lambda m, layer: m.layers_output[layer])
            acts: list = []

            def collect() -> None:
                for layer in layers:
                    value = get_activations(model, layer)[:, idx]
                    acts.append(value if tracer is not None else value.cpu().save())

            if tracer is not None:
                collect()
            else:
                with model.trace(prompts) as run:
                    collect()
                    run.stop()
            return torch.stack(acts)
        specs = [values] if isinstance(values, str) else list(values)
        # In the order the family's blocks compute them (Zamba2's shared MLP runs before its mixer).
        order = {"layer_input": 0, **{part: i + 1 for i, part in enumerate(model.family.PART_ORDER)}, "layer_output": 99}
        readers = sorted(((_value_reader(spec), spec) for spec in specs), key=lambda item: order[item[1].rpartition(".")[0] or item[1]])
        found: dict = {spec: {} for spec in specs}

        def collect_values() -> None:
            for layer in sorted(layers):
                block = model.layers[layer]
                for read, spec in readers:
                    value = read(block)
                    if value is None and getattr(block, spec.rpartition(".")[0] or "layer_output", None) is None:
                        continue  # this layer has no such part (a hybrid)
                    envoy = block if "." not in spec else getattr(block, spec.rpartition(".")[0])
                    if value is not None and _per_token(envoy, spec):
                        value = value[:, idx]
                    found[spec][layer] = value if tracer is not None or value is None else value.cpu().save()

        if tracer is not None:
            collect_values()
        else:
            with model.trace(prompts) as run:
                collect_values()
                run.stop()
        return found


def collect_token_activations_batched(
    nn_model: Any = None,
    prompts: list[str] | None = None,
    batch_size: int | None = None,
    layers: int | list[int] | None = None,
    get_activations: Callable[[Any, int], Any] | None = None,
    remote: bool = False,
    idx: int | None = None,
    tqdm: Any = None,
    use_session: bool = True,
    values: str | list[str] | None = None,
    *,
    model: Any = None,
) -> Any:
    """`get_token_activations` over ``prompts`` in batches of ``batch_size``, concatenated along the prompts.

    ``tqdm``: a progress bar factory (``tqdm.auto.tqdm``), ``True`` for
    ``tqdm.auto.tqdm``, or ``None`` for none. ``use_session`` is accepted for
    1.x's signature (it mattered remotely only); ``nn_model`` (first) is 1.x's name for the model; ``model=`` also takes it.
    """
    model = the_model("collect_token_activations_batched", nn_model, model, prompts=prompts, batch_size=batch_size)
    run_locally(remote)
    starts: Any = range(0, len(prompts), batch_size)
    if tqdm is True:
        from tqdm.auto import tqdm
    if tqdm:
        starts = tqdm(starts)
    batches = [
        get_token_activations(model, prompts[start:start + batch_size], layers, get_activations, idx=idx, values=values)
        for start in starts
    ]
    if values is None:
        return torch.cat(batches, dim=1)
    return {
        spec: {layer: torch.cat([batch[spec][layer] for batch in batches]) for layer in batches[0][spec]}
        for spec in batches[0]
    }
