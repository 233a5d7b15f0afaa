"""Identity writes: writing back every value read, unchanged, leaves the logits bit-identical.

The reference is the same trace with the same reads and no writes, under the
same strategy (reading the per-token states may change how a call runs, e.g.
Mamba-2's chunk size under ``chunk_per_token``, so the reference reads them too).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nnterp
from tests.properties.models import CASES, MODEL_TYPES, build, recurrent_layers, serving, strategies
from tests.properties.strategies import layers, prompts, variants

PROMPT = "The Eiffel Tower is in the city of"

#: Kernel arguments, in no particular order (served from the call's record, written before the kernel starts).
ARGUMENTS = ("attention_queries", "attention_keys", "attention_values", "dt", "betas", "decays")


def writable(mix) -> list[str]:
    values = type(mix).values()
    return [name for name in ARGUMENTS if name in values and values[name].assign is not None]


def run(model, mix, inputs, plan: dict, write: bool, read: torch.Tensor | None = None) -> torch.Tensor:
    """One trace reading what ``plan`` names and, when ``write``, assigning each back unchanged.

    ``read``: the state after ``T`` as an earlier trace read it, written instead of this trace's own read.
    """
    T = plan["T"]
    with torch.no_grad(), model.trace(inputs) as tracer:
        for name in plan["arguments"]:
            value = getattr(mix, name)
            if write:
                setattr(mix, name, value)
        if plan["per_token"] == "set_state_after":
            value = mix.state_after(T) if read is None else read
            if write:
                mix.set_state_after(T, value)
        elif plan["per_token"] == "state":  # before any later read: a loop asked for a token already passed never runs
            for _ in tracer.iter[T]:
                state = mix.state.save()
                if write:
                    mix.state = state
        if plan["state_output"]:
            final = mix.state_output
            if write:
                mix.state_output = final
        if plan["conv"]:  # at the mixer's output, after its kernel
            window = mix.conv_state_output
            if write:
                mix.conv_state_output = window
        logits = model.logits.save()
    if plan["per_token"] == "state":
        assert state.shape[0] == inputs["input_ids"].shape[0], "the write under tracer.iter ran"
    return logits


@pytest.mark.parametrize(("model_type", "strategy"), CASES)
@given(data=st.data())
def test_identity_writes_leave_logits_bit_identical(model_type, strategy, data):
    variant = data.draw(variants(model_type), label="variant")
    batch = data.draw(prompts(model_type, variant), label="prompts")
    layer = data.draw(layers(model_type, variant), label="layer")
    built = build(model_type, variant)
    mix = built.model.layers[layer].linear_attn
    support = mix.support()
    # `state` has no fast path, nor a per-token location on lightning attention; the latter has no convolution.
    per_token = ["set_state_after"] + ([] if strategy == "fast" or support["state"] is not None else ["state"])
    plan = {
        "conv": data.draw(st.booleans(), label="conv_state_output") and support.get("conv_state_output") is None,
        "arguments": data.draw(st.lists(st.sampled_from(writable(mix)), unique=True), label="arguments"),
        "per_token": data.draw(st.sampled_from([None, *per_token]), label="per_token"),
        "state_output": data.draw(st.booleans(), label="state_output"),
        "T": data.draw(st.integers(0, batch.width - 1), label="T"),
    }
    with serving(built.model, strategy):
        reference = run(built.model, mix, batch.inputs, plan, write=False)
        read = None
        if strategy == "fast" and plan["per_token"] == "set_state_after":
            with torch.no_grad(), built.model.trace(batch.inputs):
                read = mix.state_after(plan["T"]).save()
        written = run(built.model, mix, batch.inputs, plan, write=True, read=read)
    if read is not None:
        # Read in another trace, the value is written by splitting the kernel call at T: equal within float32
        # rounding only (in the same trace it is bit-identical: test_fast_identity_set_state_after_is_bit_identical).
        scale = reference.abs().max()
        torch.testing.assert_close(written / scale, reference / scale, rtol=0, atol=1e-5)
    else:
        assert torch.equal(written, reference), f"max difference {(written - reference).abs().max():.3g}"


@pytest.mark.parametrize("model_type", [m for m in MODEL_TYPES if "fast" in strategies(m)])
def test_fast_identity_set_state_after_is_bit_identical(model_type):
    """Writing back, in the same trace, the state `state_after` served leaves the call whole: bit-identical logits.

    (Across traces the fast path splits the call at t for any value, so an identity write there equals the
    unwritten run within float32 rounding only, as test_identity_writes_leave_logits_bit_identical allows.)
    """
    built = build(model_type)
    mix = built.model.layers[recurrent_layers(built.model)[0]].linear_attn
    ids = built.model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with nnterp.fast_states(built.model):
        with torch.no_grad(), built.model.trace(ids):
            reference = built.model.logits.save()
        with torch.no_grad(), built.model.trace(ids):
            mix.set_state_after(3, mix.state_after(3))
            written = built.model.logits.save()
    assert torch.equal(written, reference), f"max difference {(written - reference).abs().max():.3g}"


@pytest.mark.parametrize(
    ("model_type", "strategy"),
    [
        pytest.param(model_type, strategy)
        for model_type, strategy in CASES
    ],
)
def test_read_then_write_at_one_position(model_type, strategy):
    """``set_state_after(t, f(state_after(t)))`` in one trace: served by every strategy, and equal to writing a value read before."""
    built = build(model_type)
    mix = built.model.layers[recurrent_layers(built.model)[0]].linear_attn
    ids = built.model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with serving(built.model, strategy):
        for T in (0, 3, ids.shape[1] - 1):
            with torch.no_grad(), built.model.trace(ids):
                read = mix.state_after(T).save()
            with torch.no_grad(), built.model.trace(ids):
                mix.set_state_after(T, 2 * mix.state_after(T))
                together = built.model.logits.save()
            with torch.no_grad(), built.model.trace(ids):
                mix.set_state_after(T, 2 * read)
                apart = built.model.logits.save()
            assert torch.equal(together, apart), f"T={T}"
