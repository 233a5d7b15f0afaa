"""state_attribution: the first-order estimate agrees with the effect set_state_after measures, on every recurrent kind.

Oracle: with the corrupt state the clean one scaled by 1 + ε, each cell's
actual effect is one trace with ``set_state_after(t, (1 + ε) · clean)``; the
estimate must agree to a few percent (of the grid's norm) for a small ε (one
of two: float32 noise grows as ε shrinks, curvature as it grows). Against
``patch_sweep`` on two real prompts the rank correlation is reported, held only
to a loose bound (a first-order estimate of a large patch can be off).
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import StandardizedTransformer
from nnterp.attribution import AttributionResult, rank_correlation, state_attribution
from nnterp.core.errors import Unavailable
from nnterp.families import families
from nnterp.sweep import patch_sweep, per_token_states
from nnterp.testing import toy_checkpoint, toy_task

KINDS = tuple(sorted({family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}.values()))
CLEAN = "The quick brown fox jumps over"
CORRUPT = "A lazy dog sleeps under the"


def metric(model):
    return model.logits[0, -1].log_softmax(-1)[5]


@pytest.fixture(scope="module", params=KINDS)
def model(request, load):
    return load(request.param)


def _clean(model, layers, prompt=CLEAN, **run):
    states, values = [], []
    with per_token_states(model):
        with torch.no_grad(), model.trace(prompt, **run):
            for layer in layers:
                states.append(model.layers[layer].linear_attn.states.save())
            values.append(metric(model).save())
    return dict(zip(layers, states)), float(values[0])


def _actual(model, layers, positions, states, base, eps, prompt=CLEAN, **run):
    grid = torch.zeros(len(layers), len(positions))
    with per_token_states(model):
        for row, layer in enumerate(layers):
            for column, t in enumerate(positions):
                values = []
                with torch.no_grad(), model.trace(prompt, **run):
                    model.layers[layer].linear_attn.set_state_after(t, states[layer][:, t] * (1 + eps))
                    values.append(metric(model).save())
                grid[row, column] = float(values[0]) - base
    return grid


def test_estimate_agrees_with_set_state_after_for_a_small_change(model):
    layers = [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    states, base = _clean(model, layers)
    positions = list(range(0, states[layers[0]].shape[1], 2))
    errors = []
    for eps in (5e-2, 2e-3):
        result = state_attribution(model, CLEAN, {i: s * (1 + eps) for i, s in states.items()}, metric, positions=positions)
        assert isinstance(result, AttributionResult) and result.estimate.shape == (len(layers), len(positions))
        assert result.clean == pytest.approx(base, abs=1e-5)
        actual = _actual(model, layers, positions, states, base, eps)
        errors.append(float((result.estimate - actual).norm() / actual.norm()))
    assert min(errors) < 0.05, errors


def test_a_model_without_an_attention_layer_is_traced_without_a_cache():
    """transformers cannot run the all-linear ``deltanet`` toy with a cache (`nnterp.recurrent.no_cache`); the estimate
    is made without one and agrees with set_state_after's effects, measured with ``use_cache=False``."""
    model = StandardizedTransformer(str(toy_checkpoint("deltanet")), dispatch=True, device="cpu")
    assert model.family.cache_refused(model._module.config)
    prompt = next(toy_task("deltanet").samples(1, seed=5, n_pairs=5)).prompt
    states, base = _clean(model, [0, 1], prompt, use_cache=False)
    positions = list(range(0, states[0].shape[1] - 1, 2))
    errors = []
    for eps in (5e-2, 2e-3):
        corrupt = {i: s * (1 + eps) for i, s in states.items()}
        result = state_attribution(model, prompt, corrupt, metric, positions=positions)
        assert result.clean == pytest.approx(base, abs=1e-5)
        actual = _actual(model, [0, 1], positions, states, base, eps, prompt, use_cache=False)
        errors.append(float((result.estimate - actual).norm() / actual.norm()))
    assert min(errors) < 0.05, errors
    # A corrupt prompt is run the same way: the prompt itself changes no state.
    assert state_attribution(model, prompt, prompt, metric).estimate.abs().max() == 0


def test_no_parameter_gradient_is_left_behind(load):
    model = load("qwen3_5_text")
    state_attribution(model, CLEAN, CORRUPT, metric)
    assert all(p.grad is None for p in model._module.parameters())


def test_rank_correlation_with_patch_sweep_is_reported(model, capsys):
    target = int(torch.tensor(5))
    result = state_attribution(model, CLEAN, CORRUPT, target)
    sweep = patch_sweep(model, CLEAN, CORRUPT, target, progress=False)
    assert sweep.layers == result.layers and sweep.positions == result.positions
    rho = rank_correlation(result.estimate.flatten(), sweep.effect.flatten())
    with capsys.disabled():
        print(f"\n{model.family.NAME}: rank correlation of attribution with patch_sweep: {rho:.2f}")
    assert rho > 0.0
    pytest.importorskip("matplotlib")
    from nnterp import plot

    fig = plot.attribution(result, sweep)
    assert len(fig.axes) == 4  # estimate, effect, colorbar, scatter


def test_refused_with_support_reason_on_the_fast_path(load):
    # The fast path's states carry no gradient of the model's outputs: refused before any run, with support()'s reason.
    model = load("qwen3_5_text")
    with nnterp.fast_states(model):
        layer = next(i for i, block in enumerate(model.layers) if getattr(block, "linear_attn", None) is not None)
        reason = model.support()["linear_attn.states.grad"][layer]
        assert reason is not None and "fast path" in reason
        with pytest.raises(Unavailable, match="fast path"):
            state_attribution(model, CLEAN, CORRUPT, metric)
