"""Per-model settings live on nnterp's envoys: per model, nested in order, kept across loading the weights."""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import NnterpError, RoutingError, StandardizedTransformer
from nnterp.recurrent.per_token import ChunkBoundaries, FromArguments, TokenLoop, strategy_for

PROMPT = "The Eiffel Tower is in the city of"


def _strategies(model) -> set:
    return {type(strategy_for(layer.linear_attn)) for layer in model.layers if layer.linear_attn is not None}


def test_each_component_has_its_own_strategy_until_a_setting_says_otherwise(load):
    assert _strategies(load("qwen3_5_text")) == {TokenLoop}
    assert _strategies(load("mamba")) == {TokenLoop}
    assert _strategies(load("mamba2")) == {ChunkBoundaries}
    with nnterp.fast_states(load("mamba2")):
        assert _strategies(load("mamba2")) == {FromArguments}
    assert _strategies(load("mamba2")) == {ChunkBoundaries}


def test_a_setting_is_per_model_and_leaves_transformers_modules_alone(load, checkpoint):
    model = load("qwen3_5_text")
    other = StandardizedTransformer(str(checkpoint("qwen3_5_text")), dispatch=True)
    modules_before = [dict(layer.linear_attn._module.__dict__) for layer in model.layers if layer.linear_attn is not None]
    with nnterp.fast_states(model):
        assert model.support()["linear_attn.states"] is None
        assert other.support()["linear_attn.states"] is not None, "two models never share a setting"
        assert [dict(layer.linear_attn._module.__dict__) for layer in model.layers if layer.linear_attn is not None] == modules_before


def test_nested_blocks_unwind_in_order(load):
    model = load("mamba2")
    with nnterp.chunk_per_token(model):
        with nnterp.chunk_per_token(model):
            assert model.support()["linear_attn.states"] is None
        assert model.support()["linear_attn.states"] is None, "the inner exit keeps the outer block's setting"
        with nnterp.fast_states(model):
            assert _strategies(model) == {FromArguments}
        assert _strategies(model) == {ChunkBoundaries} and model.support()["linear_attn.states"] is None
    assert model.support()["linear_attn.states"] is not None


def test_enabled_false_turns_off_only_its_own_setting(load):
    model = load("mamba2")
    nnterp.fast_states(model)
    nnterp.chunk_per_token(model, enabled=False)
    assert _strategies(model) == {FromArguments}
    nnterp.fast_states(model, enabled=False)
    assert _strategies(model) == {ChunkBoundaries}


def test_a_setting_made_before_the_weights_load_is_kept(checkpoint, load):
    lazy = StandardizedTransformer(str(checkpoint("qwen3_5_text")))
    assert not lazy.dispatched
    with nnterp.fast_states(lazy):
        assert lazy.support()["linear_attn.states"] is None
        with torch.no_grad(), lazy.trace(PROMPT):
            states = lazy.layers[0].linear_attn.states.save()
            out = lazy.layers[0].linear_attn.state_output.save()
        assert lazy.dispatched
    torch.testing.assert_close(states[:, -1], out, rtol=1e-4, atol=1e-5)


def test_settings_refuse_a_running_trace_and_what_is_not_a_model(load):
    model = load("qwen3_5_text")
    with pytest.raises(RoutingError, match="before"), model.trace(PROMPT):
        nnterp.fast_states(model)
    with pytest.raises(NnterpError, match="takes a StandardizedTransformer"):
        nnterp.fast_states(object())
    with pytest.raises(NnterpError, match="no mixer with a fast path"):
        nnterp.fast_states(load("llama"))  # no recurrent mixer (every recurrent kind has a fast path)
