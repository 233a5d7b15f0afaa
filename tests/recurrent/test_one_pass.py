"""The one pass: reading ``states`` computes the kernel's output with them and skips the kernel call.

One switch decides it for every kind (`from_arguments.one_pass`), on the fast
path (`nnterp.fast_states`) of every family with one and on the own strategy
of RWKV-4, lightning attention and the mLSTM. A `Kernel` per case says what is
counted: transformers' pure-torch kernel body (by a profile hook,
`tests.reference.calls`) or lightning's block-loop products. On Mamba, a write
runs the same pass on both parts of the split call. A kind's own one-pass
cases are in tests/components/test_<kind>.py.

Oracles, none from nnterp: a plain transformers forward (its logits and its
cache's final states), the cache after each prefix, a plain forward from a
replaced state, a plain greedy loop, and whether the kernel ran at all. Where
the kernel must run instead (another dtype, two invokes sharing the call,
autograd, a write, one_pass switched off) it is checked to run, with the same
answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import OrderError, StandardizedTransformer, fast_states
from nnterp.components.lightning_attention import LightningAttention
from nnterp.components.mlstm import MLSTM
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.short_convolution import ShortConvolution
from nnterp.components.state_space import StateSpace
from nnterp.components.wkv import WKV
from nnterp.families import REGISTRY, present
from nnterp.recurrent.per_token import from_arguments
from tests.components.test_lightning_attention import blocks, products
from tests.recurrent.test_from_arguments import FAST, LONG, OTHER, PROMPT, loaded, mixers, state_donor, tolerance  # noqa: F401 (a fixture)
from tests.reference import hf_oracles as hf
from tests.reference.calls import counting
from tests.suites.caches import of_kind

#: The kinds whose kernel is a function or a method this file counts the runs of on the fast path; a kind that runs
#: its own (lightning attention's forward, the short convolution's `run_kernel`) has no such body to count.
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


@dataclass(frozen=True)
class Kernel:
    """What a case counts (``count(model, plain)``: a context whose list grows by one a kernel call), per layer's prompt
    call and per decode step; the states' tolerance against the cache's, and the logits', final states' and kernel's
    against the one pass's (``exact``: equal where the pass is the kernel's own arithmetic)."""

    count: Callable
    per_layer: Callable = lambda model, ids: 1
    per_step: Callable = lambda model: len(mixers(model)) if model.family.MIXER.CHUNK_FUNCTION == model.family.MIXER.RECURRENT_FUNCTION else 0
    tol: Callable = tolerance
    exact: Callable = tolerance
    split_reruns: bool = False  # a write's split runs the kernel on both parts (``len(calls) >= full``)

    def full(self, model, ids) -> int:
        """The calls of a prompt call whose every layer runs its kernel."""
        return self.per_layer(model, ids) * len(mixers(model))


def fixed(rtol: float, atol: float) -> Callable:
    return lambda expected: {"rtol": rtol, "atol": atol}


#: The fast path's: transformers' pure-torch body (a decode step runs it where it serves one-token calls too).
FAST_PATH = Kernel(lambda model, plain: counting(kernel_body(model)))
#: The own strategies' (no setting; the installed families): RWKV-4's token loop, whose pass is its own arithmetic (equal
#: logits and final states; the prefixes round their matmuls apart), lightning attention's block loop, the mLSTM's backend.
OWN_KERNELS = {
    WKV: Kernel(lambda model, plain: counting(model.family.MODELING.rwkv_linear_attention_cpu), per_step=lambda model: len(mixers(model)),
                   tol=fixed(1e-4, 1e-5), exact=fixed(0, 0)),
    # A prompt call's block loop makes 4 products a block; a one-token call takes the forward's token loop: 2.
    LightningAttention: Kernel(lambda model, plain: products(plain), per_layer=lambda model, ids: 4 * blocks(model, ids),
                      per_step=lambda model: 2 * len(mixers(model)), tol=fixed(1e-4, 2e-5), exact=fixed(1e-4, 2e-5)),
    MLSTM: Kernel(lambda model, plain: counting(kernel_body(model)), tol=fixed(1e-4, 1e-5), exact=fixed(1e-4, 1e-5), split_reruns=True),
}
#: One installed family per kind of `OWN_KERNELS`, from the registry (rwkv, minimax, xlstm today).
OWN = {
    t: kernel for kind, kernel in OWN_KERNELS.items()
    for t in [next((t for t in sorted(present()) if REGISTRY[t].MIXER is kind), None)] if t is not None
}
CASES = [pytest.param(t, "fast", id=f"{t}-fast") for t in COUNTED] + [pytest.param(t, "own", id=f"{t}-own") for t in OWN]


@pytest.fixture(scope="module")
def run(loaded, checkpoint):
    """``run(model_type, path) -> (model, plain, kernel)``: on the fast path (`loaded`'s), or on the mixer's own
    strategy (a model of its own, no setting)."""
    own = {}

    def get(model_type, path):
        if path == "fast":
            return (*loaded(model_type), FAST_PATH)
        if model_type not in own:
            saved = str(checkpoint(model_type))
            model, plain = StandardizedTransformer(saved, dispatch=True, device="cpu"), AutoModelForCausalLM.from_pretrained(saved)
            own[model_type] = (model, plain.eval(), OWN[model_type])
        return own[model_type]

    return get


def plain_run(model, plain, ids):
    """The plain model's logits and what it keeps the states in (``cache`` of the kind's adapter, `of_kind`)."""
    with torch.no_grad():
        return of_kind(model.family.MIXER).prefill(plain, ids)


# -- every case: the fast path of each family, the own strategies ----------------------------------------------------


@pytest.mark.parametrize("model_type, path", CASES)
def test_reading_every_layers_states_skips_the_kernel_and_keeps_the_forward(run, model_type, path):
    model, plain, kernel = run(model_type, path)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layers = mixers(model)
    states, finals, logits = [], [], []  # names first bound inside a trace body do not outlive it
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        for i in layers:
            states.append(model.layers[i].linear_attn.states.save())
            finals.append(model.layers[i].linear_attn.state_output.save())
        logits.append(model.logits.save())
    assert calls == [], "the kernel ran although every call's states were read"
    expected_logits, cache = plain_run(model, plain, ids)
    torch.testing.assert_close(logits[0], expected_logits, **kernel.exact(expected_logits))
    adapter = of_kind(model.family.MIXER)
    for layer, read, final in zip(layers, states, finals):
        cached = adapter.read(cache, layer)
        torch.testing.assert_close(final, cached, **kernel.exact(cached), msg=f"layer {layer}: the final state")
        assert torch.equal(read[:, -1], final), "the call's final state is the last one the pass wrote"
        prefixes = adapter.prefix_states(plain, ids, layer)
        torch.testing.assert_close(read, prefixes, **kernel.tol(prefixes), msg=f"layer {layer}: the states")


@pytest.mark.parametrize("model_type, path", CASES)
def test_with_one_pass_off_the_kernel_runs_and_the_answers_are_the_same(run, model_type, path, monkeypatch):
    model, plain, kernel = run(model_type, path)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[0]
    with torch.no_grad(), model.trace(ids):
        one = model.layers[layer].linear_attn.states.save()
        one_logits = model.logits.save()
    monkeypatch.setattr(from_arguments, "ONE_PASS", False)
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        two = model.layers[layer].linear_attn.states.save()
        two_logits = model.logits.save()
    assert len(calls) == kernel.full(model, ids), "every recurrent layer's kernel runs"
    torch.testing.assert_close(one, two, **kernel.exact(two))
    torch.testing.assert_close(one_logits, two_logits, **kernel.exact(two_logits))
    prefixes = of_kind(model.family.MIXER).prefix_states(plain, ids, layer)
    torch.testing.assert_close(two, prefixes, **kernel.tol(prefixes))
    expected_logits, _ = plain_run(model, plain, ids)
    torch.testing.assert_close(two_logits, expected_logits, **kernel.tol(expected_logits))


@pytest.mark.parametrize("model_type, path", CASES)
def test_a_generate_continues_from_the_one_pass_final_state(run, model_type, path):
    model, plain, kernel = run(model_type, path)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = mixers(model)
    out = []
    with kernel.count(model, plain) as calls, torch.no_grad():
        with model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4) as tracer:
            for i in layers:
                model.layers[i].linear_attn.states  # the prompt's call: every layer's kernel skipped
            out.append(tracer.result.save())
    out = out[0]
    # A kernel that serves one-token calls too (RWKV-4's loop, the RG-LRU's scan, the mLSTM's backend, lightning's) runs on each.
    assert len(calls) == 3 * kernel.per_step(model), "the prompt's kernel calls were skipped (decode steps run the one-token kernel)"
    expected = of_kind(model.family.MIXER).greedy(plain, ids, 4)
    assert torch.equal(out[:, : expected.shape[1]], expected)


# -- two invokes; the fast path's dtypes and Mamba's split ------------------------------------------------------------------


@pytest.mark.parametrize("model_type, path", CASES[:1] + [c for c in CASES if c.values[1] == "own"])
def test_two_invokes_sharing_a_call_run_the_kernel(run, model_type, path):
    model, plain, kernel = run(model_type, path)
    other = OTHER if path == "fast" else PROMPT  # RWKV-4 and the mLSTM refuse a padded batch
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            first = model.layers[mixers(model)[0]].linear_attn.states.save()
        with tracer.invoke(other):
            logits = model.logits.save()
    ids, other = (model.tokenizer(p, return_tensors="pt").input_ids for p in (PROMPT, other))
    assert len(calls) == kernel.full(model, ids), "a skip must cover every row: each layer's kernel runs"
    expected = of_kind(model.family.MIXER).prefix_states(plain, ids, mixers(model)[0])
    torch.testing.assert_close(first[:, -ids.shape[1]:], expected, **kernel.tol(expected))
    expected_logits, _ = plain_run(model, plain, other)
    torch.testing.assert_close(logits[-1:, -other.shape[1]:], expected_logits, **kernel.tol(expected_logits))


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


# -- the own strategies: where their kernel must run, and an entering state -----------------------------------------


def on_own(run, model_type):
    """``(model, plain, kernel, ids, adapter)`` of a kind whose own strategy runs the one pass, on the prompt."""
    model, plain, kernel = run(model_type, "own")
    return model, plain, kernel, model.tokenizer(PROMPT, return_tensors="pt").input_ids, of_kind(model.family.MIXER)


@pytest.fixture(params=list(OWN))
def own_case(request, run):
    return on_own(run, request.param)


@torch.no_grad()
def other_state(model, plain, adapter, layer):
    """The plain model's state at ``layer`` after another prompt: a real state, far from this prompt's."""
    return adapter.read(adapter.prefill(plain, model.tokenizer(OTHER, return_tensors="pt").input_ids)[1], layer)


def test_state_after_reads_the_one_pass_and_a_later_write_is_refused(own_case):
    model, plain, kernel, ids, adapter = own_case
    layer = mixers(model)[1]
    mix = model.layers[layer].linear_attn
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        states = mix.states.save()
        middle = mix.state_after(2).save()
        last = mix.state_after(-1).save()
    assert len(calls) == kernel.full(model, ids) - kernel.per_layer(model, ids), "only this layer's kernel is skipped"
    assert torch.equal(middle, states[:, 2]) and torch.equal(last, states[:, -1])
    prefixes = adapter.prefix_states(plain, ids, layer)
    torch.testing.assert_close(middle, prefixes[:, 2], **kernel.tol(prefixes))
    with pytest.raises(OrderError, match="states"):
        with torch.no_grad(), model.trace(ids):
            mix.states.save()
            mix.set_state_after(1, torch.zeros_like(states[:, 1]))


#: The kinds whose one pass starts from an entering state, their adapter the plain model's fresh state to write one in
#: (lightning's starts from zeros: with a state written its loop runs, tests/components/test_lightning_attention.py).
ENTERING = [t for t in OWN if hasattr(of_kind(REGISTRY[t].MIXER), "fresh")]


@pytest.mark.parametrize("model_type", ENTERING)
def test_a_written_state_input_is_where_the_one_pass_starts(run, model_type):
    model, plain, kernel, ids, adapter = on_own(run, model_type)
    layer = mixers(model)[1]
    donor = other_state(model, plain, adapter, layer)
    mix = model.layers[layer].linear_attn
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        mix.state_input = donor
        states = mix.states.save()
        logits = model.logits.save()
    assert len(calls) == kernel.full(model, ids) - kernel.per_layer(model, ids), "only the other layers' kernels run"
    cache = adapter.fresh(plain, ids.shape[0])
    adapter.write(cache, layer, donor)
    with torch.no_grad():
        expected, cache = adapter.step(plain, ids, 0, cache)
    torch.testing.assert_close(logits, expected, **kernel.tol(expected))
    torch.testing.assert_close(states[:, -1], adapter.read(cache, layer), **kernel.tol(states))


def test_under_autograd_the_own_kernel_runs_and_the_states_carry_gradients(own_case):
    model, plain, kernel, ids, adapter = own_case
    layer = mixers(model)[0]
    mix = model.layers[layer].linear_attn
    with kernel.count(model, plain) as calls, model.trace(ids, **model.family.BACKWARD_KWARGS):
        states = mix.states
        kept = states.save()
        loss = model.logits.sum()
        with loss.backward():
            grad = states.grad.save()
    assert len(calls) == kernel.full(model, ids)
    prefixes = adapter.prefix_states(plain, ids, layer)
    torch.testing.assert_close(kept.detach(), prefixes, **kernel.tol(prefixes))
    assert grad.shape == kept.shape and grad[:, :-1].abs().sum() > 0


def test_a_write_runs_the_own_kernel_and_continues_from_it(own_case):
    model, plain, kernel, ids, adapter = own_case
    layer = mixers(model)[0]
    donor = other_state(model, plain, adapter, layer)
    mix = model.layers[layer].linear_attn
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        before = mix.state_after(1).save()
        mix.set_state_after(2, donor)
        after = mix.state_after(2).save()
        logits = model.logits.save()
    # The mLSTM's split runs its backend on both parts: more calls than one a layer.
    assert len(calls) >= kernel.full(model, ids) if kernel.split_reruns else len(calls) == kernel.full(model, ids)
    prefixes = adapter.prefix_states(plain, ids, layer)
    torch.testing.assert_close(before, prefixes[:, 1], **kernel.tol(prefixes))
    assert torch.equal(after, donor)
    expected, _ = adapter.continue_from(plain, ids, 2, layer, donor)
    torch.testing.assert_close(logits[:, 3:], expected, **kernel.tol(expected))


#: The own strategies that serve ``states`` whole after a write or after ``state_output`` (`FromArguments`, from the
#: call's arguments); RWKV-4's token loop serves positions in the order the model runs.
WHOLE = [t for t in OWN if REGISTRY[t].MIXER.STATES_FROM_ARGUMENTS]


@pytest.mark.parametrize("model_type", WHOLE)
def test_states_after_a_write_or_after_state_output_run_the_own_kernel(run, model_type):
    model, plain, kernel, ids, adapter = on_own(run, model_type)
    layer = mixers(model)[0]
    donor = other_state(model, plain, adapter, layer)
    mix = model.layers[layer].linear_attn
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        mix.set_state_after(2, donor)
        written = mix.states.save()
    assert len(calls) >= kernel.full(model, ids) if kernel.split_reruns else len(calls) == kernel.full(model, ids)
    assert torch.equal(written[:, 2], donor)
    with kernel.count(model, plain) as calls, torch.no_grad(), model.trace(ids):
        final = mix.state_output.save()
        late = mix.states.save()
    assert len(calls) == kernel.full(model, ids), "state_output first: the kernel had run"
    prefixes = adapter.prefix_states(plain, ids, layer)
    torch.testing.assert_close(late, prefixes, **kernel.tol(prefixes))
    torch.testing.assert_close(late[:, -1], final, **kernel.exact(final))
