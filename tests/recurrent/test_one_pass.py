"""The fast path's one pass: reading ``states`` computes the kernel's output with them and skips the kernel call.

On Mamba, a write runs the same pass (two slots for states) on both parts of the split call instead of
transformers' torch kernel.

Oracles, none from nnterp: a plain transformers forward (its logits and its
cache's final states), transformers' cache after each prefix, a plain greedy
loop, and whether transformers' pure-torch kernel body ran at all (counted by
a profile hook, `tests.reference.calls`). Every family with a fast path, in
float32; the cases where the kernel must run instead (another dtype, two
invokes sharing the call, one_pass switched off) are checked to run it and to
give the same answers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer, fast_states
from nnterp.components.mlstm import MLSTM
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.short_convolution import ShortConvolution
from nnterp.components.state_space import StateSpace
from nnterp.components.wkv import WKV
from nnterp.families import REGISTRY
from nnterp.recurrent.per_token import from_arguments
from tests.recurrent.test_from_arguments import (  # noqa: F401 (loaded: a fixture)
    FAST,
    LONG,
    OTHER,
    PROMPT,
    loaded,
    mixers,
    state_donor,
    tolerance,
)
from tests.reference import hf_oracles as hf
from tests.reference.calls import counting
from tests.suites.caches import of_kind

#: The kinds whose kernel is a function or a method this file counts the runs of; a kind that runs its own (lightning
#: attention's forward, `run_kernel`) has its one pass checked by counting its own operations (test_lightning_one_pass.py).
COUNTED = [t for t in FAST if getattr(REGISTRY[t].MIXER, "run_kernel", None) is None]


def kernel_body(model):
    """transformers' pure-torch body of the mixer's prompt kernel, read from the modeling module's binding (a
    method-call source, the RG-LRU's: its module's scan method)."""
    mixer = model.family.MIXER
    if issubclass(mixer, MLSTM):  # a method-call source: the backend module's body (chunkwise, then a token loop)
        return model.family.MODELING.wrap_chunkwise_arbitrary_sequence_length
    if not mixer.CHUNK_FUNCTION:
        return mixer.loop_body(model.family.MODELING)
    fn = getattr(model.family.MODELING, mixer.CHUNK_FUNCTION)
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return cells.get("torch_function", fn)


def plain_run(model, plain, ids):
    """The plain model's logits and what it keeps the states in (``cache`` of the kind's adapter, `of_kind`)."""
    with torch.no_grad():
        return of_kind(model.family.MIXER).prefill(plain, ids)


@pytest.mark.parametrize("model_type", COUNTED)
def test_reading_every_layers_states_skips_the_kernel_and_keeps_the_forward(loaded, model_type):
    model, plain = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layers = mixers(model)
    states, finals, logits = [], [], []  # names first bound inside a trace body do not outlive it
    with counting(kernel_body(model)) as calls, torch.no_grad(), model.trace(ids):
        for i in layers:
            states.append(model.layers[i].linear_attn.states.save())
        finals.append(model.layers[layers[-1]].linear_attn.state_output.save())
        logits.append(model.logits.save())
    logits = logits[0]
    assert calls == [], "the kernel body ran although every call's states were read"
    expected_logits, cache = plain_run(model, plain, ids)
    torch.testing.assert_close(logits, expected_logits, **tolerance(expected_logits))
    adapter = of_kind(model.family.MIXER)
    for layer, read in zip(layers, states):
        cached = adapter.read(cache, layer)
        torch.testing.assert_close(read[:, -1], cached.float(), **tolerance(cached))
    torch.testing.assert_close(finals[0].float(), adapter.read(cache, layers[-1]).float(), **tolerance(finals[0]))
    first = adapter.prefix_states(plain, ids, layers[0])
    torch.testing.assert_close(states[0], first.float(), **tolerance(first))


@pytest.mark.parametrize("model_type", COUNTED)
def test_with_one_pass_off_the_kernel_runs_and_the_answers_are_the_same(loaded, model_type, monkeypatch):
    model, _ = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[0]
    with torch.no_grad(), model.trace(ids):
        one = model.layers[layer].linear_attn.states.save()
        one_logits = model.logits.save()
    monkeypatch.setattr(from_arguments, "ONE_PASS", False)
    with counting(kernel_body(model)) as calls, torch.no_grad(), model.trace(ids):
        two = model.layers[layer].linear_attn.states.save()
        two_logits = model.logits.save()
    assert len(calls) == len(mixers(model)), "every recurrent layer's kernel runs once"
    torch.testing.assert_close(one, two, **tolerance(two))
    torch.testing.assert_close(one_logits, two_logits, **tolerance(two_logits))


@pytest.mark.parametrize("model_type", COUNTED)
def test_a_generate_continues_from_the_one_pass_final_state(loaded, model_type):
    model, plain = loaded(model_type)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = mixers(model)
    out = []
    with counting(kernel_body(model)) as calls, torch.no_grad():
        with model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4) as tracer:
            for i in layers:
                model.layers[i].linear_attn.states  # the prompt's call: every layer's kernel skipped
            out.append(tracer.result.save())
    out = out[0]
    # A kernel that serves decode steps too (the RG-LRU's scan method) runs on each of the 3 one-token calls.
    steps = 3 if model.family.MIXER.CHUNK_FUNCTION == model.family.MIXER.RECURRENT_FUNCTION else 0
    assert len(calls) == steps * len(layers), "the prompt's kernel calls were skipped (decode steps run the one-token kernel)"
    expected = of_kind(model.family.MIXER).greedy(plain, ids, 4)
    assert torch.equal(out[:, : expected.shape[1]], expected)


def test_two_invokes_sharing_a_call_run_the_kernel(loaded):
    model, plain = loaded(COUNTED[0])
    layer = mixers(model)[0]
    with counting(kernel_body(model)) as calls, torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            first = model.layers[layer].linear_attn.states.save()
        with tracer.invoke(OTHER):
            logits = model.logits.save()
    assert calls, "a skip must cover every row: the kernel runs when another invoke shares the call"
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = hf.prefix_states(plain, ids, layer)
    torch.testing.assert_close(first[:, -ids.shape[1]:], expected, **tolerance(expected))
    other = model.tokenizer(OTHER, return_tensors="pt").input_ids
    expected_logits, _ = plain_run(model, plain, other)
    torch.testing.assert_close(logits[-1:, -1], expected_logits[:, -1], **tolerance(expected_logits))


#: Mamba-1 and Mamba-2 families: transformers' torch kernel (a token loop, a chunk scan) is slower than the pass.
RING = [t for t in COUNTED if issubclass(REGISTRY[t].MIXER, (SelectiveScan, StateSpace))]
#: RWKV-4's, the mLSTM's and the short convolution's: their one pass is float32 only (RWKV-4's kernel mixes the model's
#: dtype into the state's float32 updates; the mLSTM backend's chunkwise kernel computes in the model's dtype; the
#: convolution's body convolves in the weight's dtype).
FLOAT32 = [t for t in COUNTED if issubclass(REGISTRY[t].MIXER, (WKV, MLSTM, ShortConvolution))]
#: The delta rule's and the RG-LRU's families: transformers' torch kernels compute in float32 from any dtype and round
#: their output only.
DELTA = [t for t in COUNTED if t not in RING and t not in FLOAT32]


@pytest.mark.parametrize("model_type", RING[:1] + FLOAT32)
def test_a_bfloat16_mamba_or_rwkv_model_runs_the_kernel(checkpoint, model_type):
    # The pure-torch body rounds its states to the model's dtype before its readout: one pass would not equal it.
    model = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", dtype=torch.bfloat16)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[0]
    with fast_states(model), counting(kernel_body(model)) as calls, torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.states.save()
    assert len(calls) == len(mixers(model))


@pytest.mark.parametrize("model_type", sorted({REGISTRY[t].MIXER: t for t in DELTA}.values()))
def test_a_bfloat16_delta_rule_model_skips_the_kernel_and_keeps_the_forward(checkpoint, model_type):
    # The body casts to float32, computes, and rounds its output to bfloat16: the one pass does the same.
    model = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", dtype=torch.bfloat16)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint(model_type), dtype=torch.bfloat16).eval()
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    logits = []
    with fast_states(model), counting(kernel_body(model)) as calls, torch.no_grad(), model.trace(ids):
        for layer in mixers(model):
            model.layers[layer].linear_attn.states.save()
        logits.append(model.logits.save())
    assert calls == [], "the kernel body ran although every call's states were read"
    expected, _ = plain_run(model, plain, ids)
    # Each output the one pass rounds is the body's float32 value: equal, or one bfloat16 rounding apart at a tie.
    torch.testing.assert_close(logits[0].float(), expected.float(), rtol=0, atol=2.0**-7 * expected.abs().max().item())


@pytest.mark.parametrize("model_type", RING)
@pytest.mark.parametrize("T", [5, -2])  # -2: the second part is one token
def test_a_write_on_mamba_runs_the_pass_on_both_parts_not_the_kernel(loaded, model_type, T):
    model, plain = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[0]
    mix = model.layers[layer].linear_attn
    value = state_donor(mix)
    logits = []
    with counting(kernel_body(model)) as calls, torch.no_grad(), model.trace(ids):
        mix.state_after(T)
        mix.set_state_after(T, value)
        logits.append(model.logits.save())
    # The other recurrent layers run the kernel as usual; the written one runs the pass on each part.
    assert len(calls) == len(mixers(model)) - 1
    expected = hf.continue_from_state(plain, ids, T % ids.shape[1], layer, value)
    torch.testing.assert_close(logits[0][:, -1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", RING[:1])
def test_under_autograd_a_write_runs_the_kernel_and_its_target_gets_a_gradient(loaded, model_type):
    model, plain = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[0]
    mix = model.layers[layer].linear_attn
    value = state_donor(mix).requires_grad_(True)
    grads = []
    with counting(kernel_body(model)) as calls, model.trace(ids):
        mix.set_state_after(5, value)
        model.logits[:, -1].sum().backward()
        grads.append(value.grad.save())
    assert len(calls) == len(mixers(model)) + 1, "the written layer's kernel runs on both parts"
    assert grads[0] is not None and grads[0].abs().sum() > 0
