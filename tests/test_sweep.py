"""patch_sweep against a hand-written loop of set_state_after, and its interruption, on the tiny Qwen3.5."""

from __future__ import annotations

import math

import pytest
import torch

import nnterp
from nnterp import NnterpError
from nnterp.sweep import patch_sweep

PROMPT = "The Eiffel Tower is in the city of"
DONOR = "My favourite food is pizza with"


@pytest.fixture(scope="module")
def model(load):
    return load("qwen3_5_text")


@pytest.fixture(scope="module")
def target(model):
    with torch.no_grad(), model.trace(PROMPT):
        probs = model.next_token_probs.save()
    return int(probs[0].argmax())


def _by_hand(model, layer, position, target):
    """One cell as a user would write it: the donor's state after `position`, written after the prompt's."""
    with nnterp.route_kernels(model.family, "torch"):
        with torch.no_grad(), model.trace(DONOR):
            donor = model.layers[layer].linear_attn.state_after(position).save()
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[layer].linear_attn.set_state_after(position, donor)
            prob = model.next_token_probs[0, target].save()
    return float(prob)


def test_cells_equal_a_manual_loop(model, target):
    result = patch_sweep(model, PROMPT, DONOR, target, layers=[0, 2], positions=[1, 4, -3], progress=False)
    n = len(model.tokenizer(PROMPT).input_ids)
    assert result.complete and result.done == 6
    assert result.layers == [0, 2] and result.positions == [1, 4, n - 3]
    assert result.tokens == model.tokenizer.convert_ids_to_tokens(model.tokenizer(PROMPT).input_ids)
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.next_token_probs[0, target].save()
    assert result.clean == pytest.approx(float(clean), abs=1e-6)  # routed and chunked kernels agree
    for row, layer in enumerate(result.layers):
        for column, position in enumerate(result.positions):
            assert result.probs[row, column].item() == pytest.approx(_by_hand(model, layer, position, target), abs=1e-7)
    assert torch.equal(result.effect, result.probs - result.clean)
    assert result.effect.abs().max() > 1e-4  # the patches do something on this checkpoint


def test_defaults_cover_every_recurrent_layer_and_shared_position(model, target):
    result = patch_sweep(model, PROMPT, DONOR, target, progress=False)
    shorter = min(len(model.tokenizer(p).input_ids) for p in (PROMPT, DONOR))
    assert result.layers == [0, 1, 2]  # block 3 is softmax attention
    assert result.positions == list(range(shorter))
    assert result.complete and torch.isfinite(result.probs).all()


def test_an_interrupt_returns_what_was_gathered(model, target):
    seen = []

    def stop_after_four(layer, position, prob):
        seen.append((layer, position, prob))
        if len(seen) == 4:
            raise KeyboardInterrupt  # what Ctrl-C raises

    result = patch_sweep(model, PROMPT, DONOR, target, layers=[0, 1], positions=[0, 1, 2], on_cell=stop_after_four, progress=False)
    assert not result.complete and result.done == 4
    flat = result.probs.flatten().tolist()
    assert [p for p in flat[:4]] == [prob for _, _, prob in seen]  # row by row, in order
    assert all(math.isnan(p) for p in flat[4:])
    # routing is undone on the way out, interrupted or not (the conftest fixture checks it too)
    stash = model.family.MODELING._nnterp_kernels
    assert all(model.family.MODELING.__dict__[name] is fn for name, fn in stash.items())


def test_a_string_target_and_bad_arguments(model, target):
    token = model.tokenizer.decode([target])
    if len(model.tokenizer(token, add_special_tokens=False).input_ids) == 1:
        one = patch_sweep(model, PROMPT, DONOR, token, layers=[0], positions=[0], progress=False)
        assert one.target == target
    with pytest.raises(NnterpError, match="tokens here"):
        patch_sweep(model, PROMPT, DONOR, "Eiffel Tower city", progress=False)
    with pytest.raises(NnterpError, match="no recurrent mixer"):
        patch_sweep(model, PROMPT, DONOR, target, layers=[3], progress=False)
    with pytest.raises(IndexError, match="outside the tokens both prompts have"):
        patch_sweep(model, PROMPT, DONOR, target, positions=[len(model.tokenizer(PROMPT).input_ids) - 1], progress=False)


def test_a_target_id_outside_the_vocabulary_is_refused(model, target):
    size = model.lm_head._module.weight.shape[0]
    for bad in (-1, -size, size, size + 10):
        with pytest.raises(ValueError, match=rf"ids run 0\.\.{size - 1} \(a vocabulary of {size}\)") as caught:
            patch_sweep(model, PROMPT, DONOR, bad, layers=[0], positions=[0], progress=False)
        assert isinstance(caught.value, NnterpError)
    for bad in (True, 3.0, None):
        with pytest.raises(TypeError, match="token id"):
            patch_sweep(model, PROMPT, DONOR, bad, layers=[0], positions=[0], progress=False)
    # the last id is a token; a one-element integer tensor (`probs.argmax()`) is its id
    last = patch_sweep(model, PROMPT, DONOR, size - 1, layers=[0], positions=[0], progress=False)
    assert last.target == size - 1
    assert patch_sweep(model, PROMPT, DONOR, torch.tensor(target), layers=[0], positions=[0], progress=False).target == target


def test_on_mamba2_every_token_is_a_boundary_for_the_sweep_only(load):
    mamba2 = load("mamba2")
    sizes = [layer.linear_attn._module.chunk_size for layer in mamba2.layers]
    assert all(size > 1 for size in sizes)
    result = patch_sweep(mamba2, PROMPT, DONOR, 5, layers=[1], positions=[0, 3], progress=False)
    assert result.complete and torch.isfinite(result.probs).all()
    assert [layer.linear_attn._module.chunk_size for layer in mamba2.layers] == sizes  # restored
