"""MLP: the router's logits on every registered family with mixture-of-experts blocks, against the plain HF model.

Oracles for a read: exactly, a forward hook on each router of the loaded
model computing the router's linear map from its input, in the same run;
and the plain HF model's own ``output_router_logits=True`` (its
``OutputRecorder`` on the router class), to float32 rounding (a model loaded
through nnsight and a plain one differ by an ulp upstream of the first router
on some families, as the families' logits tests allow). Oracle for a write:
the plain HF model with that layer's router weight negated, against nnterp
writing the negated logits (``F.linear(x, -W)`` is ``-F.linear(x, W)``
exactly), so the routing itself must follow the write.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nnterp.components.mlp import DENSE, MLP
from nnterp.core.errors import ShapeError, Unavailable
from nnterp.families import REGISTRY, families

PROMPTS = ["Hello world there", "Hi"]


def _has_router(family) -> bool:
    """Whether the family's transformers module defines a router class (its blocks may be mixtures of experts)."""
    return getattr(family.LAYER, "MLP", None) is not None and any(
        isinstance(value, type) and issubclass(value, torch.nn.Module) and name.lower().endswith("router")
        for name, value in vars(family.MODELING).items()
    )


MOE = [family.MODEL_TYPES[0] for family in families() if _has_router(family)]


def _router(module: torch.nn.Module) -> torch.nn.Module | None:
    return next((getattr(module, name) for name in MLP.ROUTERS if isinstance(getattr(module, name, None), torch.nn.Module)), None)


def _moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.mlp is not None and _router(layer.mlp._module) is not None]


def _reasons(model) -> dict:
    """``support()``'s entry for ``mlp.router_logits`` per layer index (``None``: served)."""
    entry = model.support()["mlp.router_logits"]
    if isinstance(entry, dict):
        return entry
    return dict(enumerate(entry if isinstance(entry, list) else [entry] * len(model.layers)))


def _plain(checkpoint, model_type):
    return AutoModelForCausalLM.from_pretrained(str(checkpoint(model_type)), dtype=torch.float32).eval()


def _linear_map(found: list):
    """A forward hook appending the router's logits computed from its input (``F.linear`` in float32)."""

    def hook(module, args, output):
        x = args[0].reshape(-1, module.weight.shape[1])
        found.append(F.linear(x.float(), module.weight.float()).detach())

    return hook


def _hf_router_logits(hf, batch) -> list[torch.Tensor]:
    """Each MoE block's router logits ``[batch * seq, experts]``, in layer order, from the plain HF model."""
    routers = [module for module in hf.modules() if _router(module) is not None]
    with torch.no_grad():
        outputs = hf(**batch, output_router_logits=True)
    recorded = getattr(outputs, "router_logits", None)
    if recorded is not None and len(recorded) == len(routers):
        return list(recorded)
    found: list[torch.Tensor] = []
    handles = [_router(module).register_forward_hook(_linear_map(found)) for module in routers]
    try:
        with torch.no_grad():
            hf(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


def test_every_family_with_a_router_class_is_covered():
    # The registry decides: every family whose transformers module defines a router has its tiny MoE blocks tested.
    assert MOE and families()[0].NAME not in MOE
    for model_type in MOE:
        assert REGISTRY[model_type].MODEL_TYPES[0] == model_type


@pytest.mark.parametrize("model_type", MOE)
def test_router_logits_are_the_plain_models(model_type, load, checkpoint):
    model = load(model_type)
    layers = _moe_layers(model)
    assert layers, f"{model_type}'s tiny model has no mixture-of-experts block"
    batch = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    expected = _hf_router_logits(_plain(checkpoint, model_type), batch)
    assert len(expected) == len(layers)
    saved, computed = [], []
    handles = [_router(model.layers[i].mlp._module).register_forward_hook(_linear_map(computed)) for i in layers]
    try:
        with torch.no_grad(), model.trace(PROMPTS):
            for i in layers:
                saved.append(model.layers[i].mlp.router_logits.save())
    finally:
        for handle in handles:
            handle.remove()
    batch_size, seq = batch["input_ids"].shape
    assert len(computed) == len(layers)
    for i, got, same_run, want in zip(layers, saved, computed, expected):
        assert got.shape == (batch_size, seq, want.shape[-1]), i
        assert torch.equal(got, same_run.reshape(batch_size, seq, -1)), f"{model_type} layer {i}: the router's linear map"
        torch.testing.assert_close(got, want.reshape(batch_size, seq, -1), rtol=0, atol=1e-6, msg=f"{model_type} layer {i}: plain HF")
    reasons = _reasons(model)
    assert all(reasons[i] is None for i in layers)


@pytest.mark.parametrize("model_type", MOE)
def test_a_write_changes_the_routing(model_type, load, checkpoint):
    model = load(model_type)
    layer = _moe_layers(model)[-1]
    hf = _plain(checkpoint, model_type)
    batch = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        before = hf(**batch).logits
        _router(hf.get_submodule(f"{model.family.LAYERS}.{layer}.{model.family.LAYER.MLP}")).weight.neg_()
        expected = hf(**batch).logits
    assert not torch.equal(before, expected), "negating the router changes the routing on the tiny model"
    with torch.no_grad(), model.trace(PROMPTS):
        mlp = model.layers[layer].mlp
        mlp.router_logits = -mlp.router_logits
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert (logits - before).abs().max() > 1e-3


def test_a_write_of_the_wrong_shape_is_refused(load):
    model = load("qwen3_moe")
    with pytest.raises(ShapeError, match="experts"):
        with model.trace(PROMPTS):
            mlp = model.layers[0].mlp
            mlp.router_logits = torch.zeros(*mlp.router_logits.shape[:2], 3)


@pytest.mark.parametrize("model_type", [families()[0].NAME, *MOE])
def test_a_dense_block_has_no_router(model_type, load):
    model = load(model_type)
    dense = [i for i, layer in enumerate(model.layers) if layer.mlp is not None and _router(layer.mlp._module) is None]
    reasons = _reasons(model)
    if not dense:  # every block of this tiny MoE model routes: support() must serve the value on each
        assert model_type in MOE and all(reasons[i] is None for i, layer in enumerate(model.layers) if layer.mlp is not None)
        return
    assert all(reasons[i] == DENSE for i in dense)
    mlp = model.layers[dense[0]].mlp
    with pytest.raises(Unavailable, match="dense: no router"):
        with model.trace(PROMPTS):
            mlp.router_logits.save()
    with pytest.raises(Unavailable, match="dense: no router"):
        with model.trace(PROMPTS):
            mlp.router_logits = torch.zeros(1, 3, 4)
