"""nnterp.plot renders each figure to a PNG (Agg, off-screen) from tensors shaped as the values are."""

from __future__ import annotations

import builtins
import importlib

import pytest
import torch

pytest.importorskip("matplotlib")
from nnterp import plot  # noqa: E402
from nnterp.sweep import SweepResult  # noqa: E402

TOKENS = ["The", "ĠEiff", "el", "ĠTower", "Ġis"]


def _render(fig, path) -> int:
    fig.savefig(path, dpi=80)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return len(data)


def _states(seq=5, heads=4, key=16, value=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, seq, heads, key, value, generator=g).cumsum(1)  # growing, like a memory


def test_state_norms_heatmap(tmp_path):
    fig = plot.state_norms({0: _states(seed=0), 1: _states(seed=1), 2: _states(seed=2)}, TOKENS)
    (ax, bar) = fig.axes
    assert ax.get_xlabel().startswith("token") and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", "␣Eiff", "el", "␣Tower", "␣is"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    assert "‖S‖" in bar.get_ylabel() and ax.get_title()
    image = ax.get_images()[0].get_array()
    assert image.shape == (3, 5)
    expected = _states(seed=1)[0].flatten(1).norm(dim=-1)
    assert torch.allclose(torch.as_tensor(image[1]).float(), expected, atol=1e-4)
    assert _render(fig, tmp_path / "state_norms.png") > 5_000


def test_state_norms_rejects_layers_of_different_lengths():
    with pytest.raises(ValueError, match="same tokens"):
        plot.state_norms([_states(seq=5), _states(seq=4)])


def test_head_norms_bars(tmp_path):
    state = _states()[:, -1]  # [batch, heads, key, value]
    fig = plot.head_norms(state)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 4
    assert torch.allclose(torch.tensor(heights, dtype=torch.float32), state[0].flatten(1).norm(dim=-1), atol=1e-4)
    assert ax.get_xlabel() == "head" and "‖S‖" in ax.get_ylabel()
    assert _render(fig, tmp_path / "head_norms.png") > 3_000


def test_patch_effect_bars_and_heatmap(tmp_path):
    bars = plot.patch_effect({0: 0.01, 1: -0.2, 2: 0.0}, label="Δ p(' Paris')")
    ax = bars.axes[0]
    assert len(ax.patches) == 3 and ax.get_xlabel() == "patched layer" and ax.get_ylabel() == "Δ p(' Paris')"
    assert _render(bars, tmp_path / "bars.png") > 3_000
    probs = torch.tensor([[0.5, 0.4, float("nan")], [0.2, 0.6, float("nan")]])
    result = SweepResult([0, 2], [0, 1, 2], TOKENS, 7, 0.5, probs, complete=False)
    heat = plot.patch_effect(result)
    ax, bar = heat.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", "␣Eiff", "el"]
    low, high = ax.get_images()[0].get_clim()
    assert low == -high == pytest.approx(-0.3)  # centred on no effect
    assert _render(heat, tmp_path / "sweep.png") > 5_000
    grid = plot.patch_effect(torch.randn(3, 4))
    assert grid.axes[0].get_images()[0].get_array().shape == (3, 4)


def test_without_matplotlib_the_error_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    module = importlib.reload(plot)  # importing nnterp.plot itself needs no matplotlib
    with pytest.raises(ImportError, match=r'pip install "nnterp\[plot\]"'):
        module.head_norms(torch.ones(1, 2, 3, 3))


def test_logit_lens_plot_is_the_projection_of_every_layer_at_every_position(load, tmp_path):
    from nnterp.plot import logit_lens

    model = load("qwen3_5_text")
    prompt = "The Eiffel Tower is in"
    fig = logit_lens(model, prompt)
    ax = fig.axes[0]
    grid = ax.images[0].get_array()
    n = len(model.tokenizer(prompt).input_ids)
    assert grid.shape == (model.num_layers, n) and len(ax.texts) == model.num_layers * n
    with torch.no_grad(), model.trace(prompt):
        probs = model.next_token_probs.save()
    assert abs(float(grid[-1, -1]) - float(probs[0].max())) < 1e-5  # the last layer's last position: the model's prediction
    fig.savefig(tmp_path / "lens.png")


def test_effective_attention_draws_one_panel_per_head(tmp_path):
    pattern = torch.randn(1, 6, 5, 5).tril()
    fig = plot.effective_attention(pattern, ["a", "b", "c", "d", "e"], heads=[0, 3])
    assert len([ax for ax in fig.axes if ax.get_images()]) == 2
    fig.savefig(tmp_path / "effective.png")
    with pytest.raises(ValueError, match="seq, seq"):
        plot.effective_attention(torch.randn(1, 2, 5, 4))
