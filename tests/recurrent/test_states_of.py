"""``linear_attn.states_of(positions)``: the states after the named tokens only, on every recurrent kind and strategy.

Oracle: ``states[:, positions]`` from the same strategy (every strategy's
``states`` is itself checked against transformers' cache elsewhere). The
order rules are `state_after`'s; on the fast path, a probe on the buffers
the strategy allocates and on the tokens its spec is given shows that memory
and work follow the selection, not the prompt.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

import nnterp
from nnterp import OrderError
from nnterp.components.lightning_attention import LightningAttention
from nnterp.core.errors import PositionError, WrongType
from nnterp.families import REGISTRY, families
from nnterp.recurrent.gradients import VIEW_MARK
from nnterp.recurrent.per_token import from_arguments
from nnterp.recurrent.per_token.from_arguments import FromArguments
from tests.reference.lightning import lightning_recurrence

#: The first family of each recurrent mixer (gated DeltaNet, Kimi, Mamba-1, Mamba-2).
KINDS = tuple(sorted({f.MIXER: f.NAME for f in reversed(families()) if f.MIXER}.values()))
SETTINGS = ("own", "fast")
PROMPT = "The quick brown fox jumps over the lazy dog, again and again"
#: Selections: one token, repeats and negatives out of order, a range, a tensor.
SELECTIONS = ([0], [3, -1, 1, 3], range(2, 6), torch.tensor([5, 0]))


def needs_fast(model):
    """Skip a kind that has no fast path (LFM2, the mLSTM, lightning: their own strategy only)."""
    if model.family.MIXER.FAST is None:
        pytest.skip(f"{model.family.MIXER.__name__} has no fast path")


def fast(model):
    """The fast path (a setting applied now, undone by ``with``), or a skip on a kind that has none."""
    needs_fast(model)
    return nnterp.fast_states(model)


def setting(model, name):
    """The model's own per-token strategy (routed kernels; chunk_per_token on Mamba-2), or the fast path."""
    if name == "fast":
        return fast(model)
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def first_mixer(model):
    return next(layer.linear_attn for layer in model.layers if getattr(layer, "linear_attn", None) is not None)


def ids_of(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


def as_list(selection, seq):
    return [p % seq for p in (selection.tolist() if isinstance(selection, torch.Tensor) else selection)]


def close(actual, expected):
    # The fast path computes a selection a block at a time: float32 rounding of the largest entry at most.
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6 * max(1.0, expected.abs().max().item()))


#: The first family of each recurrent mixer with a fast path (the others: `fast_states` refuses them, test_settings).
FAST_KINDS = tuple(kind for kind in KINDS if REGISTRY[kind].MIXER.FAST is not None)
#: ``(model_type, setting)``: the own strategy on every kind, the fast path where there is one.
CASES = tuple((kind, name) for kind in KINDS for name in SETTINGS if name == "own" or kind in FAST_KINDS)


@pytest.fixture(scope="module", params=KINDS)
def model(request, load):
    return load(request.param)


@pytest.fixture(scope="module", params=FAST_KINDS)
def fast_model(request, load):
    return load(request.param)


@pytest.fixture(scope="module", params=CASES, ids=[f"{kind}-{name}" for kind, name in CASES])
def case(request, load):
    kind, name = request.param
    return load(kind), name


def test_states_of_is_states_at_those_positions(case, monkeypatch):
    model, name = case
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", 4)  # several blocks on a short prompt
    ids, mix = ids_of(model), first_mixer(model)
    seq = ids.shape[1]
    with setting(model, name):
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        for selection in SELECTIONS:
            with torch.no_grad(), model.trace(ids):
                got = mix.states_of(selection).save()
            positions = as_list(selection, seq)
            assert got.shape == (states.shape[0], len(positions), *states.shape[2:]) and got.dtype == torch.float32
            close(got, states[:, positions])
        with torch.no_grad(), model.trace(ids):
            empty = mix.states_of([]).save()
    assert empty.shape == (states.shape[0], 0, *states.shape[2:])


def test_the_order_rules_are_state_afters(case):
    model, name = case
    ids, mix = ids_of(model), first_mixer(model)
    with setting(model, name):
        # A write at an earlier position after the selection reached a later one.
        with pytest.raises(OrderError, match="was asked for after"), torch.no_grad(), model.trace(ids):
            mix.states_of([1, 5])
            mix.set_state_after(3, torch.zeros(mix.state_output.shape))
        # After the kernel returned: refused where state_after is (the token loop, the boundaries), read where it is
        # not (the fast path reads the call's arguments, kept from before the kernel ran).
        outcomes = []
        for read in (lambda: mix.state_after(2), lambda: mix.states_of([2])):
            try:
                with torch.no_grad(), model.trace(ids):
                    mix.state_output.save()
                    read().save()
                outcomes.append(None)
            except (OrderError, OutOfOrderError):
                # nnterp's OrderError names the order; a component reading its own bindings (LFM2's gates) gets nnsight's.
                outcomes.append("refused")
        assert outcomes[0] == outcomes[1], outcomes
        # A component computing its states from the call's arguments (the mLSTM, lightning attention; the short
        # convolution, whose own strategy is the fast path) reads them later too.
        from_arguments = name == "fast" or type(mix).STATES_FROM_ARGUMENTS
        assert outcomes[0] == (None if from_arguments else "refused")
        with pytest.raises(PositionError, match="outside this call"), model.trace(ids):
            mix.states_of([0, ids.shape[1]])
        with pytest.raises(WrongType, match="sequence of token positions"), model.trace(ids):
            mix.states_of(2)


def test_on_the_fast_path_reads_around_a_write_see_it(fast_model, monkeypatch):
    model = fast_model
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", 3)
    ids, mix = ids_of(model), first_mixer(model)
    with fast(model):
        with torch.no_grad(), model.trace(ids):
            clean = mix.state_after(3).save()
        value = 2.0 * clean
        with torch.no_grad(), model.trace(ids):
            mix.set_state_after(3, value)
            got = mix.states_of([1, 3, 4, 9]).save()
            states = mix.states.save()
    assert torch.equal(got[:, 1], value)
    close(got, states[:, [1, 3, 4, 9]])


def test_on_the_fast_path_memory_and_work_follow_the_selection(fast_model, monkeypatch):
    model = fast_model
    block = 4
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", block)
    ids, mix = ids_of(model), first_mixer(model)
    needs_fast(model)
    buffers, tokens = [], []
    allocate = FromArguments._buffer

    def probe(self, shape, device, differentiable, *dtype):
        buffers.append(tuple(shape))
        return allocate(self, shape, device, differentiable, *dtype)

    spec = type(mix).FAST
    if spec is None:
        pytest.skip(f"{type(mix).__name__} has no fast path")

    def compute(arguments, out):
        tokens.append(arguments[spec.tokens[0]].shape[1])
        return spec.compute(arguments, out)

    def one_pass(arguments, out):  # `states` computes the kernel's output with them (and skips the kernel)
        tokens.append(arguments[spec.tokens[0]].shape[1])
        return spec.one_pass(arguments, out)

    monkeypatch.setattr(FromArguments, "_buffer", probe)
    monkeypatch.setattr(type(mix), "FAST", dataclasses.replace(spec, compute=compute, one_pass=spec.one_pass and one_pass))
    with fast(model):
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        assert buffers == [tuple(states.shape)] and sum(tokens) == ids.shape[1], "states: one [batch, seq, ...] buffer"
        buffers.clear()
        tokens.clear()
        with torch.no_grad(), model.trace(ids):
            got = mix.states_of([2, 6]).save()
    batch, state = states.shape[0], tuple(states.shape[2:])
    assert buffers == [(batch, block, *state)], "one block-sized buffer, reused"
    assert sum(tokens) == 7 and max(tokens) <= block, "tokens up to the last selected one, a block at a time"
    close(got, states[:, [2, 6]])


def test_on_a_decode_step_the_only_position_is_the_new_state(model):
    mix = first_mixer(model)
    ids = ids_of(model)
    with setting(model, "fast" if type(mix).FAST is not None else "own"), torch.no_grad(), model.generate(ids, max_new_tokens=2, do_sample=False) as tracer:
        for _ in tracer.iter[1]:
            got = mix.states_of([0, -1]).save()
            new = mix.state_output.save()
    assert torch.equal(got, torch.stack([new, new], 1))



def check_tapped_states_of(model, monkeypatch):
    """A fast path with a tap: states_of under autograd is a function of the values, as the paper's recurrence is."""
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", 4)
    ids, mix = ids_of(model), first_mixer(model)
    with fast(model), model.trace(ids):
        q, k, value, g = (x.save() for x in (mix.attention_queries, mix.attention_keys, mix.attention_values, mix.decays))
        got = mix.states_of([6, 2]).save()
    leaf = value.detach().requires_grad_(True)
    _, expected_states = lightning_recurrence(q.detach(), k.detach(), leaf, -g[0, 0].detach())
    close(got.detach(), expected_states.detach()[:, [6, 2]])
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(0))
    (expected,) = torch.autograd.grad((expected_states[:, [6, 2]] * weights).sum(), leaf)
    (grad,) = torch.autograd.grad((got * weights).sum(), value)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6 * max(1.0, expected.abs().max().item()))


def test_on_the_fast_path_under_autograd_a_function_of_the_arguments(fast_model, monkeypatch):
    model = fast_model
    if issubclass(model.family.MIXER, LightningAttention):
        # Also against the paper's recurrence: states read before the forward's loop are a leaf its outputs read
        # (states.grad, test_one_pass.py), not a function of the arguments; states_of still is one.
        return check_tapped_states_of(model, monkeypatch)
    monkeypatch.setattr(from_arguments, "SELECTION_BLOCK", 4)
    ids, mix = ids_of(model), first_mixer(model)
    # A tapped spec's states read before the kernel runs are a leaf its output is read through (tests/recurrent/
    # test_gradients.py); read once it has run, they are computed beside it from the arguments, as every kind's.
    tapped = type(mix).FAST.tap is not None
    with fast(model), model.trace(ids):
        value = mix.attention_values.save()
        if not tapped:
            states = mix.states.save()
        got = mix.states_of([6, 2]).save()
        if tapped:
            mix.state_output.save()
            states = mix.states.save()
    close(got.detach(), states.detach()[:, [6, 2]])
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(0))
    # Mamba-1's kernel holds x channel-first: the served value is a view of it.
    held = value._base if getattr(value, VIEW_MARK, False) else value
    (expected,) = torch.autograd.grad((states[:, [6, 2]] * weights).sum(), held, retain_graph=True)
    (grad,) = torch.autograd.grad((got * weights).sum(), held)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6 * max(1.0, expected.abs().max().item()))
