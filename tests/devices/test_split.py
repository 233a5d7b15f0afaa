"""Models split across devices (`device_map`): the same reads and writes as a plain load, checked on CPU maps.

No GPU here: an explicit per-layer map and a layer offloaded to disk (accelerate
keeps its weights on ``meta`` until its forward) stand in for a model spread over
devices; `scripts/gpu_check.py` runs the GPU half where there is one. Another
device is stood in for by ``meta`` where only the device is looked at.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import KernelFailure, StandardizedTransformer
from nnterp.core.errors import NnterpError
from nnterp.families import REGISTRY
from nnterp.testing import tiny_checkpoint
from tests.suites.standins import Compiled, compiled_kernels, mixer_kernels

PROMPT = "The quick brown fox jumps over the lazy dog"
#: A gated DeltaNet hybrid (routed token loop and fast path) and Mamba-2 (chunk boundaries and fast path).
KINDS = ["qwen3_5_text", "mamba2"]


def device_map(model: StandardizedTransformer, offloaded: int | None) -> dict:
    """Every module down to the layers on ``"cpu"``, one entry per layer; layer ``offloaded`` on ``"disk"``."""
    layers = model.family.LAYERS  # the HF path of the decoder blocks ("model.layers", "backbone.layers")
    body = layers.rpartition(".")[0]
    mapping = {name: "cpu" for name, _ in model._module.named_children() if name != body}
    mapping.update({f"{body}.{name}": "cpu" for name, _ in model._at(body)._module.named_children() if f"{body}.{name}" != layers})
    mapping.update({f"{layers}.{i}": "cpu" for i in range(len(model.layers))})
    if offloaded is not None:
        mapping[f"{layers}.{offloaded}"] = "disk"
    return mapping


def mixer_layer(model: StandardizedTransformer) -> int:
    return next(i for i, layer in enumerate(model.layers) if layer.linear_attn is not None)


def reads(model: StandardizedTransformer, layer: int) -> dict:
    mix = model.layers[layer].linear_attn
    found = {}
    with torch.no_grad(), model.trace(PROMPT):
        found["leaving"] = mix.state_output.save()
        found["logits"] = model.logits.save()
    with nnterp.fast_states(model):
        with torch.no_grad(), model.trace(PROMPT):
            found["fast"] = mix.states.save()
        with torch.no_grad(), model.trace(PROMPT):
            first = mix.state_after(0)
            mix.set_state_after(1, 2 * first)
            found["written"] = model.logits.save()
    slow = nnterp.chunk_per_token(model) if REGISTRY[model.family.NAME].MIXER.CHUNKED_SCAN else nnterp.route_kernels(model.family, "torch")
    with slow, torch.no_grad(), model.trace(PROMPT):
        found["slow"] = mix.states.save()
    return found


@pytest.fixture(scope="module")
def plain():
    cache: dict = {}

    def get(kind: str) -> StandardizedTransformer:
        if kind not in cache:
            cache[kind] = StandardizedTransformer(str(tiny_checkpoint(kind)), dispatch=True, device="cpu")
        return cache[kind]

    return get


@pytest.mark.parametrize("offload", [False, True], ids=["per-layer-cpu-map", "one-layer-on-disk"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_split_model_reads_and_writes_as_a_plain_load(kind, offload, plain, tmp_path):
    reference = plain(kind)
    layer = mixer_layer(reference)
    mapping = device_map(reference, layer if offload else None)
    split = StandardizedTransformer(str(tiny_checkpoint(kind)), dispatch=True, device_map=mapping, offload_folder=str(tmp_path))
    assert getattr(split._module, "hf_device_map", mapping) == mapping  # (transformers keeps no map for one device)
    if offload:
        assert next(split.layers[layer].linear_attn._module.parameters()).device.type == "meta"  # on disk until its forward
    ours, theirs = reads(split, layer), reads(reference, layer)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_a_split_model_with_a_compiled_kernel_bound_serves_the_call_and_names_the_fix_where_it_fails(kind, plain, tmp_path):
    # A compiled stand-in that runs (a package working on this device) serves the call's own values on a split model;
    # one that refuses the device (mamba_ssm on CPU tensors) fails the trace with its error and route_kernels.
    reference = plain(kind)
    layer = mixer_layer(reference)
    split = StandardizedTransformer(str(tiny_checkpoint(kind)), dispatch=True, device_map=device_map(reference, layer), offload_folder=str(tmp_path))
    mix = split.layers[layer].linear_attn
    with torch.no_grad(), split.trace(PROMPT):
        leaving = mix.state_output.save()
    with compiled_kernels(split.family.MODELING, mixer_kernels(split.family.MIXER), Compiled):
        with torch.no_grad(), split.trace(PROMPT):
            bound = mix.state_output.save()
    assert torch.equal(bound, leaving)
    with compiled_kernels(split.family.MODELING, mixer_kernels(split.family.MIXER)):
        with pytest.raises(KernelFailure, match=r"route_kernels\(model.family, 'torch'\)"), split.trace(PROMPT):
            split.logits.save()


@pytest.mark.parametrize("write", ["state_output", "set_state_after"])
def test_a_write_on_another_device_names_the_move(write, plain):
    model = plain("qwen3_5_text")
    mix = model.layers[mixer_layer(model)].linear_attn
    with torch.no_grad(), model.trace(PROMPT):
        shape = mix.state_output.shape.save()
    elsewhere = torch.zeros(shape, device="meta")
    with pytest.raises(NnterpError, match=r"on cpu, got one on meta: move it with `\.to\('cpu'\)`"):
        with nnterp.fast_states(model), torch.no_grad(), model.trace(PROMPT):
            if write == "state_output":
                mix.state_output = elsewhere
            else:
                mix.set_state_after(1, elsewhere)
