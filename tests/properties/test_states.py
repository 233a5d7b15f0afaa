"""Properties of the state after every token, over families x sizes x prompt lengths x left-padded batches x strategies.

Oracles independent of nnterp (tests/reference/hf_oracles.py): transformers'
own cache after a plain forward over each prefix of each row, unpadded; a plain
forward continued token by token from a replaced cached state.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.properties.models import CASES, build, serving
from tests.properties.strategies import layers, prompts, variants
from tests.reference import hf_oracles as hf

TOL = dict(rtol=1e-4, atol=1e-5)


def scaled(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal within float32 rounding relative to the largest entry (states grow with the prompt)."""
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual / scale, expected / scale, **TOL, msg=what)


@pytest.mark.parametrize(("model_type", "strategy"), CASES)
@given(data=st.data())
def test_states_equal_the_hf_cache_after_each_prefix(model_type, strategy, data):
    variant = data.draw(variants(model_type), label="variant")
    batch = data.draw(prompts(model_type, variant), label="prompts")
    layer = data.draw(layers(model_type, variant), label="layer")
    built = build(model_type, variant)
    mix = built.model.layers[layer].linear_attn
    with serving(built.model, strategy), torch.no_grad(), built.model.trace(batch.inputs):
        states = mix.states.save()
        final = mix.state_output.save()
    assert states.shape[:2] == (len(batch.rows), batch.width)
    if strategy == "fast":  # computed by nnterp.fast, beside the kernel: equal within float32 rounding (documented)
        scaled(states[:, -1], final, "the last state is the call's final state")
    else:
        assert torch.equal(states[:, -1], final), "the last state is the call's final state"
    for row in range(len(batch.rows)):
        pad = batch.pad(row)
        expected = hf.prefix_states(built.plain, batch.row_ids(row), layer)[0]
        scaled(states[row, pad:], expected, f"row {row} (left pad {pad}), layer {layer}: states vs the HF cache per prefix")
        assert torch.count_nonzero(states[row, :pad]) == 0, f"row {row}: a padding position carries no state"


@pytest.mark.parametrize(("model_type", "strategy"), CASES)
@given(data=st.data())
def test_set_state_after_equals_the_replaced_cache_continuation(model_type, strategy, data):
    variant = data.draw(variants(model_type), label="variant")
    batch = data.draw(prompts(model_type, variant), label="prompts")
    layer = data.draw(layers(model_type, variant), label="layer")
    first = max(batch.pad(row) for row in range(len(batch.rows)))  # a position every row has reached
    T = data.draw(st.integers(first, batch.width - 1), label="T")
    scale = data.draw(st.sampled_from([0.0, 1.0, 5.0]), label="scale")
    built = build(model_type, variant)
    with torch.no_grad():
        cached = hf.recurrent_state(hf.output_cache(built.plain(batch.row_ids(0), use_cache=True)), layer)
    generator = torch.Generator().manual_seed(T)
    value = scale * torch.randn((len(batch.rows), *cached.shape[1:]), generator=generator)
    mix = built.model.layers[layer].linear_attn
    with serving(built.model, strategy), torch.no_grad(), built.model.trace(batch.inputs):
        mix.set_state_after(T, value)
        after = mix.state_after(T).save()
        probs = built.model.next_token_probs.save()
    assert torch.equal(after, value), "state_after(T) reads the value written"
    for row in range(len(batch.rows)):
        ids, at = batch.row_ids(row), T - batch.pad(row)
        with torch.no_grad():
            expected = torch.softmax(hf.continue_from_state(built.plain, ids, at, layer, value[row : row + 1])[0], -1)
        torch.testing.assert_close(probs[row], expected, rtol=1e-4, atol=1e-6, msg=f"row {row}: token {at} of {ids.shape[1]}")
