"""Gradients through recurrent state against plain transformers' autograd.

The oracle (`tests.reference.hf_oracles.state_gradient`) makes a layer's state
after token ``t`` a leaf by hand: the prefix runs into a cache, the cached
state is replaced by a leaf with the same values, and the rest of the prompt
is fed one token at a time through the model's own decode kernels; autograd
gives the metric's derivative with respect to the leaf. nnterp must give the
same number from one traced forward of the whole prompt: ``states.grad[:, t]``
with its own per-token strategy, and ``.grad`` of a ``set_state_after(t,
target)`` target equal to the clean state with it and with the fast path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.components.kimi_delta_attention import KimiDeltaAttention
from nnterp.components.lightning_attention import LightningAttention
from nnterp.components.recurrent import RecurrentMixer
from nnterp.components.selective_scan import SelectiveScan
from nnterp.components.state_space import StateSpace
from nnterp.families import REGISTRY, families
from nnterp.testing import tiny_checkpoint
from tests.reference.hf_oracles import cache_kwarg, output_cache, state_gradient

#: The mixers whose state transformers keeps in its cache's ``recurrent_states`` (what the oracle replaces).
CACHED = (LinearAttention, KimiDeltaAttention, SelectiveScan, StateSpace, LightningAttention)
#: The first family of each such mixer.
KINDS = tuple(sorted({f.MIXER: f.NAME for f in reversed(families()) if f.MIXER in CACHED}.values()))
PROMPT = "The quick brown fox jumps over the"
POSITIONS = (1, 4)


def served_through_kernel_class(mixer: type) -> bool:
    return mixer.values()["state_input"].compute is RecurrentMixer._state_input and not mixer.ONE_STEP_DECODE


def metric(logits: torch.Tensor) -> torch.Tensor:
    """A scalar of the last position's logits ``[batch, vocab]`` that is not flat in any of them."""
    return (logits.log_softmax(-1)[:, 3] + 0.1 * logits.logsumexp(-1)).sum()


def own(model):
    """The model's own per-token setting: Mamba-2's chunk boundaries, routed kernels elsewhere."""
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def setting(model, strategy: str):
    return own(model) if strategy == "own" else nnterp.fast_states(model)


@pytest.fixture(scope="module", params=KINDS)
def case(request, load):
    model = load(request.param)
    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(request.param)).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    # The last recurrent layer's state is read by the fewest layers, the first by the most: take both.
    expected = {(layer, t): state_gradient(plain, ids, t, layer, metric) for layer in (layers[0], layers[-1]) for t in POSITIONS}
    return model, ids, expected


def close(mine: torch.Tensor, oracle: torch.Tensor, what: str) -> None:
    assert oracle.abs().sum() > 0, f"{what}: the oracle's gradient is zero, so the test would prove nothing"
    scale = float(oracle.abs().max())
    torch.testing.assert_close(mine, oracle, rtol=2e-3, atol=2e-4 * scale, msg=lambda m: f"{what}: {m}")


def test_states_grad_is_plain_autograd_through_the_cache(case):
    # The fast path's states carry no gradient (computed beside the kernel): support() says so, test_gradient_support checks it.
    model, ids, expected = case
    strategy = "own"
    layers = sorted({layer for layer, _ in expected})
    grads: list = []  # bound before the trace: a name first bound inside it does not outlive it
    with setting(model, strategy):
        with model.trace(ids):
            states = [model.layers[layer].linear_attn.states.save() for layer in layers]
            loss = metric(model.logits[:, -1]).save()
            with loss.backward():
                # The backward pass reaches the last layer first: gradients are read in that order.
                for value in reversed(states):
                    grads.append(value.grad.save())
    for layer, grad in zip(reversed(layers), grads):
        for t in POSITIONS:
            close(grad[:, t], expected[layer, t], f"{model.family.NAME} layer {layer} states.grad[:, {t}] ({strategy})")


@pytest.mark.parametrize("strategy", ["own", "fast"])
def test_set_state_after_target_grad_is_plain_autograd(case, strategy):
    model, ids, expected = case
    if strategy == "fast" and model.family.MIXER.FAST is None:
        pytest.skip(f"{model.family.MIXER.__name__} has no fast path (support() says so: test_contract)")
    layer, t = min(expected)
    mix = model.layers[layer].linear_attn
    with setting(model, strategy):
        with torch.no_grad(), model.trace(ids):
            clean = mix.state_after(t).save()
        target = clean.clone().requires_grad_(True)
        with model.trace(ids):
            mix.set_state_after(t, target)
            loss = metric(model.logits[:, -1]).save()
            with loss.backward():
                grad = target.grad.save()
    close(grad, expected[layer, t], f"{model.family.NAME} set_state_after({t}) target.grad ({strategy})")


#: The kinds whose kernel takes the entering state as an argument (the shared state_input; not a one-step decode
#: updating the cache in place): support() serves their state_input.grad.
ENTERING = tuple(kind for kind in KINDS if served_through_kernel_class(REGISTRY[kind].MIXER))


@pytest.mark.parametrize("model_type", ENTERING)
def test_state_input_grad_on_a_continued_cache_is_plain_autograd(load, model_type):
    # A trace over a cache holding the prefix: state_input is the state the call starts from, and its .grad the
    # metric's derivative by it, the oracle's at the prefix's last token.
    model = load(model_type)
    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type)).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    split = 3
    layer = next(i for i, block in enumerate(model.layers) if getattr(block, "linear_attn", None) is not None)
    expected = state_gradient(plain, ids, split - 1, layer, metric, one_call=True)
    row = model.support()["linear_attn.state_input.grad"]
    assert row is None or row[layer] is None, row
    with torch.no_grad():
        cache = output_cache(plain(input_ids=ids[:, :split], use_cache=True))
    mix = model.layers[layer].linear_attn
    # transformers writes the cache in place after the kernel, as it does without nnterp: autograd then needs this.
    # The mask covers the cached tokens too: nnsight's own, from the new tokens alone, would hide them from attention.
    inputs = {"input_ids": ids[:, split:], "attention_mask": torch.ones_like(ids)}
    with torch.autograd.graph.allow_mutation_on_saved_tensors(), model.trace(inputs, **{cache_kwarg(plain): cache}):
        entering = mix.state_input.save()
        loss = metric(model.logits[:, -1]).save()
        with loss.backward():
            grad = entering.grad.save()
    close(grad, expected, f"{model_type} state_input.grad on a continued cache")
