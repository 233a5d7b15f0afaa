"""What every per-token strategy shares, on every recurrent kind: one meaning for `state`, validated writes, no cache.

Oracles: ``set_state_after`` (itself checked against a replaced-cache
continuation in the suites), the shapes and dtypes of what the model serves,
and transformers' own forward without a cache.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import nnterp
from nnterp import NnterpError, Unavailable
from nnterp.families import REGISTRY, families

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"

RECURRENT = [family for family in families() if family.MIXER is not None]
#: One family per recurrent component (the first registered), the kinds' representatives.
KINDS = sorted({family.MIXER: family.NAME for family in reversed(RECURRENT)}.values())
#: The DeltaNet and Mamba-1 representatives, whose `state` write used to be the raw binding.
TOKEN_LOOP_KINDS = [t for t in KINDS if not REGISTRY[t].MIXER.CHUNKED_SCAN and REGISTRY[t].MIXER.__name__ != "KimiDeltaAttention"]
#: The families whose mixer keeps no final state without a cache (lightning attention's forward returns it anyway).
CACHE_ONLY = [family.NAME for family in RECURRENT if not getattr(family.MIXER, "FINAL_STATE_WITHOUT_CACHE", False)]


def per_token(model):
    """How the model's prompts reach the state after every token, without the fast path."""
    mixer = model.family.MIXER
    if mixer.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    if mixer.ONE_STEP_DECODE:  # Mamba-1's pure-torch prompt kernel is itself the token loop
        return contextlib.nullcontext()
    return nnterp.route_kernels(model.family, "torch")


def _mixer(model):
    return next(layer.linear_attn for layer in model.layers if layer.linear_attn is not None)


def _needs_iteration(model):
    """Skip, with support()'s reason, a kind with no per-token location for ``tracer.iter`` (a short convolution)."""
    reason = model.support()["linear_attn.state"]
    reasons = set(reason.values()) if isinstance(reason, dict) else set(reason) if isinstance(reason, list) else {reason}
    if None not in reasons:
        pytest.skip(f"`state` under tracer.iter is unavailable: {reasons.pop()}")


@pytest.mark.parametrize("model_type", KINDS)
def test_assigning_state_under_tracer_iter_is_set_state_after(load, model_type):
    model = load(model_type)
    mix = _mixer(model)
    with per_token(model):
        _needs_iteration(model)
        with torch.no_grad(), model.trace(PROMPT):
            donor = (mix.state_after(2) * 3 + 1).save()
        with torch.no_grad(), model.trace(PROMPT):
            mix.set_state_after(2, donor)
            expected = model.logits.save()
        with torch.no_grad(), model.trace(PROMPT) as tracer:
            for _ in tracer.iter[2]:
                mix.state = donor
            got = model.logits.save()
        with torch.no_grad(), model.trace(PROMPT):
            plain = model.logits.save()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, :3], plain[:, :3], rtol=1e-5, atol=1e-6, msg="tokens up to t keep their output")
    assert not torch.allclose(got[:, 3:], plain[:, 3:]), "the tokens after t continue from the assigned state"


@pytest.mark.parametrize("model_type", TOKEN_LOOP_KINDS)
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda s: s[:, :1], "shape"),
        (lambda s: s.to(torch.int64), "dtype"),
        (lambda s: s.to(torch.float16), "dtype"),
        (lambda s: 0.5, "tensor"),
    ],
    ids=["one-head", "int64", "float16", "python-float"],
)
def test_assigning_state_under_tracer_iter_is_validated(load, model_type, bad, message):
    model = load(model_type)
    mix = _mixer(model)
    with per_token(model):
        _needs_iteration(model)
        with torch.no_grad(), model.trace(PROMPT):
            state = mix.state_after(1).save()
        with pytest.raises(NnterpError, match=message), torch.no_grad(), model.trace(PROMPT) as tracer:
            for _ in tracer.iter[1]:
                mix.state = bad(state)


@pytest.mark.parametrize("model_type", CACHE_ONLY)
def test_without_a_cache_state_output_is_unavailable_naming_use_cache(load, model_type):
    model = load(model_type)
    mix = _mixer(model)
    with pytest.raises(Unavailable, match="use_cache=True"), torch.no_grad(), model.trace(PROMPT, use_cache=False):
        mix.state_output
    with torch.no_grad(), model.trace(PROMPT, use_cache=True):
        state = mix.state_output.save()
    with pytest.raises(Unavailable, match="use_cache=True"), torch.no_grad(), model.trace(PROMPT, use_cache=False):
        mix.state_output = state


@pytest.mark.parametrize("model_type", [t for t in KINDS if REGISTRY[t].MIXER.FAST is not None])
def test_fast_path_writes_in_one_invoke_of_two(load, model_type):
    model = load(model_type)
    mix = _mixer(model)
    with nnterp.fast_states(model):
        with torch.no_grad(), model.trace(PROMPT):
            value = (mix.state_after(2) * 2).save()
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                mix.set_state_after(2, value)
                patched = model.next_token_probs.save()
            with tracer.invoke(PROMPT):
                untouched = model.next_token_probs.save()
        with torch.no_grad(), model.trace(PROMPT):
            mix.set_state_after(2, value)
            patched_alone = model.next_token_probs.save()
        with torch.no_grad(), model.trace(PROMPT):
            alone = model.next_token_probs.save()
    torch.testing.assert_close(patched, patched_alone, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(untouched, alone, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(patched, alone)


@pytest.mark.parametrize("model_type", KINDS)
def test_a_stepped_tracer_iter_over_state_is_refused_and_a_list_of_steps_is_served(load, model_type):
    # nnsight drops a slice's step: tracer.iter[1:L:3] would yield every token from 1 on, silently.
    model = load(model_type)
    mix = _mixer(model)
    seq = len(model.tokenizer(PROMPT).input_ids)
    with per_token(model):
        _needs_iteration(model)
        with torch.no_grad(), model.trace(PROMPT):
            every = mix.states.save()
        seen = []
        with pytest.raises(ValueError, match=r"drops a slice's step.*list\(range\(1, ") as raised:
            with torch.no_grad(), model.trace(PROMPT) as tracer:
                for _ in tracer.iter[1:seq:3]:
                    seen.append(mix.state.save())
        assert isinstance(raised.value, NnterpError) and seen == []
        got = []
        with torch.no_grad(), model.trace(PROMPT) as tracer:
            for _ in tracer.iter[list(range(1, seq, 3))]:
                got.append(mix.state.save())
        assert len(got) == len(range(1, seq, 3))
        torch.testing.assert_close(torch.stack(got, 1).float(), every[:, 1:seq:3].float(), rtol=1e-5, atol=1e-6)
        got = []
        with torch.no_grad(), model.trace(PROMPT) as tracer:  # a step of 1 is the plain slice
            for _ in tracer.iter[1:3:1]:
                got.append(mix.state.save())
        torch.testing.assert_close(torch.stack(got, 1).float(), every[:, 1:3].float(), rtol=1e-5, atol=1e-6)
