"""``state`` under ``tracer.iter`` in ``generate``: each step's own state, read and written.

In a trace, ``tracer.iter[t]`` counts the tokens of the prompt call; under
``generate`` it counts the steps, one forward call each, so ``state`` there is
the state the step leaves (its ``state_output``) and assigning it is where the
next step starts. Before this was told apart, a decode step's ``state`` read
the prompt's token ``t`` instead, silently. Oracles: transformers' cache in a
plain greedy loop (before each call it holds the previous call's state), and
the same loop with the cache replaced after the written step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.state_space import StateSpace
from nnterp.families import families
from nnterp.testing import tiny_checkpoint
from tests.reference import hf_oracles as hf

KINDS = tuple(sorted({f.MIXER: f.NAME for f in reversed(families()) if f.MIXER is not None}.values()))
#: The mixers whose state transformers keeps in its cache's ``recurrent_states`` (what the greedy oracle reads).
CACHED = tuple(sorted({f.MIXER: f.NAME for f in reversed(families()) if f.MIXER in (LinearAttention, KimiDeltaAttention, SelectiveScan, StateSpace)}.values()))
PROMPT = "The quick brown fox"
NEW = 5


def own(model):
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def first_mixer(model) -> int:
    return next(i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None)


def generate_kwargs() -> dict:
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("model_type", KINDS)
def test_state_in_generate_is_each_steps_state_output(load, model_type):
    model = load(model_type)
    layer = first_mixer(model)
    mix = model.layers[layer].linear_attn
    with own(model) if model.family.MIXER.FAST is not None or model.family.MIXER.CHUNKED_SCAN else contextlib.nullcontext():
        reason = model.support()["linear_attn.state"]
        if reason is not None and (reason if isinstance(reason, str) else reason[layer]) is not None:
            with pytest.raises(nnterp.Unavailable):
                with torch.no_grad(), model.generate(PROMPT, **generate_kwargs()) as tracer:
                    for _ in tracer.iter[1]:
                        mix.state.save()
            return
        read, expected = [], []
        with torch.no_grad(), model.generate(PROMPT, **generate_kwargs()) as tracer:
            for _ in tracer.iter[1:4]:
                read.append(mix.state.save())
        with torch.no_grad(), model.generate(PROMPT, **generate_kwargs()) as tracer:
            for _ in tracer.iter[1:4]:
                expected.append(mix.state_output.save())
    assert len(read) == 3
    for step, (a, b) in enumerate(zip(read, expected), start=1):
        assert torch.equal(a, b), (model_type, step)


@pytest.mark.parametrize("model_type", CACHED)
def test_state_in_generate_against_a_plain_greedy_loop(load, model_type):
    model = load(model_type)
    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type)).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layer = first_mixer(model)
    mix = model.layers[layer].linear_attn
    cached: dict = {}
    hf.greedy(plain, ids, NEW, patch=lambda step, cache: cached.__setitem__(step, hf.recurrent_state(cache, layer).clone()))
    read = []
    with own(model):
        with torch.no_grad(), model.generate(PROMPT, **generate_kwargs()) as tracer:
            for _ in tracer.iter[1:4]:
                read.append(mix.state.save())
        # Before call s + 1 the cache holds what call s left.
        for step, value in enumerate(read, start=1):
            torch.testing.assert_close(value, cached[step + 1], rtol=1e-4, atol=1e-5)
        donor = 30.0 * torch.randn(cached[2].shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), model.generate(PROMPT, **generate_kwargs()) as tracer:
            for _ in tracer.iter[2]:
                mix.state = donor
            patched = tracer.result.save()

    def patch(step, cache):
        if step == 3:
            hf.set_recurrent_state(cache, layer, donor)

    expected = hf.greedy(plain, ids, NEW, patch=patch)
    assert torch.equal(patched, expected)
    assert not torch.equal(patched, hf.greedy(plain, ids, NEW)), "the write changes the continuation"
