"""``model.states_of(positions=None, layers=None)``: the named layers' states after the named tokens, in one trace.

Oracles: each mixer's own ``states`` read in a separate trace (itself checked
against transformers' cache in tests/recurrent), transformers' own cache after
the whole prompt for the last position, and the layers that hold a recurrent
mixer found from the HF modules' classes (not from nnterp's envoys). That
unselected layers compute nothing is seen in the requests the trace's worker
makes to the model, and on the fast path in the buffers it allocates and the
tokens its spec is given.
"""

from __future__ import annotations

import dataclasses

import nnsight
import pytest
import torch
from nnsight.intervention.interleaver import Mediator
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import NnterpError, NotInTrace, PositionError, Unavailable, WrongType
from nnterp.recurrent.per_token import from_arguments
from nnterp.recurrent.per_token.from_arguments import FromArguments
from tests.reference import hf_oracles as hf

PROMPT = "The quick brown fox jumps over the lazy dog"
#: A gated DeltaNet hybrid and Mamba-2 (each on its own strategy and on the fast path), and the RG-LRU, which has no
#: fast path (its own strategy only); the DeltaNet and the RG-LRU hybrids have attention layers to refuse.
CASES = (
    ("qwen3_5_text", "own"),
    ("qwen3_5_text", "fast"),
    ("mamba2", "own"),
    ("mamba2", "fast"),
    ("recurrent_gemma", "own"),
)
#: The kinds transformers' cache holds one recurrent state per layer for (``cache.layers[i].recurrent_states``).
CACHED = ("qwen3_5_text", "mamba2")


def setting(model, name):
    """The fast path, or the model's own per-token strategy (chunk_per_token on Mamba-2, routed kernels otherwise)."""
    if name == "fast":
        return nnterp.fast_states(model)
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def hf_recurrent_layers(model):
    """The blocks holding a module of a class the family builds its recurrent mixer from, by the HF modules alone."""
    classes = tuple(
        hf_class for hf_class, component in model.family.COMPONENTS.items() if component is model.family.MIXER
    )
    blocks = model.layers._module
    return [i for i, block in enumerate(blocks) if any(isinstance(m, classes) for m in block.modules())]


def ids_of(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


def close(actual, expected):
    # The fast path computes a selection a block at a time: float32 rounding of the largest entry at most.
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6 * max(1.0, expected.abs().max().item()))


@pytest.fixture(scope="module", params=CASES, ids=[f"{kind}-{name}" for kind, name in CASES])
def case(request, load):
    kind, name = request.param
    return load(kind), name


def every_mixers_states(model, ids, layers):
    with torch.no_grad(), model.trace(ids):
        states = nnsight.save({i: model.layers[i].linear_attn.states for i in layers})
    return states


def test_the_selection_is_each_mixers_own_states_at_those_positions(case):
    model, name = case
    ids = ids_of(model)
    seq = ids.shape[1]
    recurrent = hf_recurrent_layers(model)
    assert len(recurrent) >= 2
    first, last = recurrent[0], recurrent[-1]
    with setting(model, name):
        states = every_mixers_states(model, ids, recurrent)
        with torch.no_grad(), model.trace(ids):
            # Given last layer first and with a repeat: read in model order, each once.
            chosen = model.states_of(positions=[3, -1, 3], layers=[last, first, last - len(model.layers)]).save()
        with torch.no_grad(), model.trace(ids):
            every = model.states_of().save()
        with torch.no_grad(), model.trace(ids):
            one = nnsight.save(model.states_of(positions=range(1, 4), layers=first))
    assert list(chosen) == [first, last]
    for layer in (first, last):
        assert chosen[layer].shape == (1, 3, *states[layer].shape[2:]) and chosen[layer].dtype == torch.float32
        close(chosen[layer], states[layer][:, [3, seq - 1, 3]])
    assert list(every) == recurrent
    for layer in recurrent:
        assert torch.equal(every[layer], states[layer]), f"layer {layer}: positions=None is the mixer's states"
    assert list(one) == [first]
    close(one[first], states[first][:, 1:4])


@pytest.mark.parametrize("name", ["own", "fast"])
@pytest.mark.parametrize("kind", CACHED)
def test_the_last_position_is_transformers_cached_state(kind, name, load, checkpoint):
    model = load(kind)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint(kind)).eval()
    ids = ids_of(model)
    with torch.no_grad():
        cache = hf.output_cache(plain(input_ids=ids, use_cache=True))
    with setting(model, name), torch.no_grad(), model.trace(ids):
        last = model.states_of(positions=[-1]).save()
    assert list(last) == hf_recurrent_layers(model)
    for layer, got in last.items():
        expected = hf.recurrent_state(cache, layer)
        torch.testing.assert_close(got[:, 0], expected, rtol=1e-4, atol=1e-5 * max(1.0, expected.abs().max().item()))


def test_unselected_layers_are_not_asked_for_anything(case, monkeypatch):
    model, name = case
    ids = ids_of(model)
    recurrent = hf_recurrent_layers(model)
    selected = recurrent[1:]
    asked: list = []
    event = Mediator.__dict__["event"].__func__

    def logged(cls, kind, location, *rest):
        asked.append(location)
        return event(cls, kind, location, *rest)

    monkeypatch.setattr(Mediator, "event", classmethod(logged))
    with setting(model, name), torch.no_grad(), model.trace(ids):
        model.states_of(positions=[2, -1], layers=selected)
    paths = {i: model.layers[i].path + "." for i in range(len(model.layers))}
    reached = {i for i, path in paths.items() for location in asked if location.startswith(path)}
    assert reached == set(selected), f"asked the model for {sorted(set(asked))}"


@pytest.mark.parametrize("kind", ["qwen3_5_text", "mamba2"])
def test_on_the_fast_path_memory_and_work_follow_the_selection(kind, load, monkeypatch):
    model = load(kind)
    block = 4
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", block)
    ids = ids_of(model)
    recurrent = hf_recurrent_layers(model)
    selected = recurrent[:1] + recurrent[-1:]
    mixer = type(model.layers[recurrent[0]].linear_attn)
    buffers, tokens = [], []
    allocate = FromArguments._buffer
    spec = mixer.FAST

    def probe(self, shape, device, differentiable, *dtype):
        buffers.append(tuple(shape))
        return allocate(self, shape, device, differentiable, *dtype)

    def compute(arguments, out):
        tokens.append(arguments[spec.tokens[0]].shape[1])
        return spec.compute(arguments, out)

    with nnterp.fast_states(model):
        states = every_mixers_states(model, ids, selected)
        monkeypatch.setattr(FromArguments, "_buffer", probe)
        monkeypatch.setattr(mixer, "FAST", dataclasses.replace(spec, compute=compute))
        with torch.no_grad(), model.trace(ids):
            got = model.states_of(positions=[6, 2], layers=selected).save()
    batch, state = states[selected[0]].shape[0], tuple(states[selected[0]].shape[2:])
    assert buffers == [(batch, block, *state)] * len(selected), (
        "one block-sized buffer per selected layer, no [batch, seq, ...]"
    )
    assert sum(tokens) == 7 * len(selected) and max(tokens) <= block, (
        "tokens up to the last selected one, selected layers only"
    )
    for layer in selected:
        close(got[layer], states[layer][:, [6, 2]])


def test_a_generator_of_positions_serves_every_layer(load):
    model = load("qwen3_5_text")
    ids = ids_of(model)
    with nnterp.fast_states(model):
        states = every_mixers_states(model, ids, [0, 2])
        with torch.no_grad(), model.trace(ids):
            got = model.states_of(positions=(p for p in (4, 1)), layers=[0, 2]).save()
    for layer in (0, 2):
        close(got[layer], states[layer][:, [4, 1]])


def test_on_every_step_of_generate_the_last_position_is_the_state_the_step_leaves(load):
    model = load("qwen3_5_text")
    steps = 3
    run = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    with nnterp.fast_states(model):
        with torch.no_grad(), model.generate(PROMPT, **run) as tracer:
            chosen = nnsight.save([])
            for _ in tracer.iter[:steps]:
                chosen.append(model.states_of(positions=[-1], layers=[2, 0]))
        with torch.no_grad(), model.generate(PROMPT, **run) as tracer:
            leaving = nnsight.save([])
            for _ in tracer.iter[:steps]:
                leaving.append({i: model.layers[i].linear_attn.state_output for i in (0, 2)})
    assert len(chosen) == len(leaving) == steps
    for got, expected in zip(chosen, leaving):
        assert list(got) == [0, 2]
        for layer in (0, 2):
            close(got[layer][:, 0], expected[layer])


def test_bad_layers_and_positions_are_refused_with_what_to_ask_for(load):
    model = load("qwen3_5_text")  # layers 0-2 gated DeltaNet, layer 3 attention
    ids = ids_of(model)
    with nnterp.fast_states(model):
        for layers in ([3], [0, -1]):
            with pytest.raises(
                NnterpError, match=r"layer 3 of qwen3_5_text has no recurrent mixer; the layers with one are 0-2"
            ):
                with model.trace(ids):
                    model.states_of(layers=layers)
        with (
            pytest.raises(PositionError, match=r"layer 4 is out of range for the model's 4 layers; a layer index is in \[-4, 4\)"),
            model.trace(ids),
        ):
            model.states_of(layers=[0, 4])
        for layers in ([1.0], ["0"], True, "0"):
            with pytest.raises(WrongType, match="layer ind"), model.trace(ids):
                model.states_of(layers=layers)
        # Positions: the per-mixer states_of's own errors.
        with pytest.raises(PositionError, match="outside this call"), model.trace(ids):
            model.states_of(positions=[0, ids.shape[1]])
        with pytest.raises(WrongType, match="sequence of token positions"), model.trace(ids):
            model.states_of(positions=2)
        with pytest.raises(NotInTrace, match="model.states_of"):
            model.states_of(layers=[0])
    # Without a setting, transformers' chunked kernel: refused before any layer is read, naming the layer.
    reason = model.support()["linear_attn.states"][0]
    with (
        pytest.raises(Unavailable, match=r"layers\[0\]\.linear_attn\.states_of is unavailable") as raised,
        model.trace(ids),
    ):
        model.states_of(positions=[1])
    assert raised.value.reason == reason


def test_a_model_without_a_recurrent_mixer_says_so(load):
    model = load("llama")
    with pytest.raises(NnterpError, match="llama has no recurrent mixer on any layer"), model.trace("Hello"):
        model.states_of()
