"""Plots of recurrent state, for looking rather than reading (matplotlib, the ``plot`` extra).

Mental model: every function takes tensors you have already saved from a
trace (nothing here runs the model) and returns a matplotlib ``Figure``; save
it with ``fig.savefig("x.png")`` or show it in a notebook. The norm of a state
is its Frobenius norm over everything but batch and token: a DeltaNet state
``[mixer_heads, key_dim, value_dim]`` is one number per token, so a layer's
``states`` ``[batch, seq, mixer_heads, key_dim, value_dim]`` becomes a row.

* `state_norms`: a heatmap, layers × tokens, of the state norm after each token.
* `head_norms`: the norm of each head's state, one state (one token).
* `effective_attention`: heatmaps, output token × value token, of a mixer's
  exact effective attention (``linear_attn.effective_attention``), one per head.
* `patch_effect`: what a patch did to the next-token distribution, per layer
  (bars), or per layer × position (a heatmap, e.g. a `patch_sweep` result).
* `attribution`: a `state_attribution` estimate, layers × positions, beside
  the `patch_sweep` it estimates (and a scatter of one against the other).

matplotlib is imported when a function is called, so ``import nnterp.plot``
works without it; calling one without it raises an ImportError naming
``pip install "nnterp[plot]"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .attribution import rank_correlation
from .core.errors import InvalidArgument, ShapeError
from .core.indices import layer_indices

__all__ = ["state_norms", "head_norms", "effective_attention", "patch_effect", "attribution", "logit_lens", "token_label"]

INSTALL = 'pip install "nnterp[plot]"'


def figure_class(what: str = "nnterp.plot") -> Any:
    """matplotlib's ``Figure`` class (figures are built off-screen), or ``ImportError`` naming ``what`` and the extra."""
    try:
        import matplotlib
    except ImportError as error:  # the optional extra is missing
        raise ImportError(f"{what} needs matplotlib: {INSTALL}") from error
    # A figure is built off-screen and returned; never pop a window from a library.
    from matplotlib.figure import Figure

    del matplotlib
    return Figure


def _layers(data: Any) -> tuple[list, list]:
    """``(labels, values)`` from a mapping ``{layer: value}`` or a sequence (labelled 0, 1, ...)."""
    if isinstance(data, Mapping):
        return list(data.keys()), list(data.values())
    values = list(data)
    return list(range(len(values))), values


def token_label(token: str) -> str:
    """A tokenizer's token (``convert_ids_to_tokens``) as an axis label: byte-level BPE's ``Ġ`` (a leading space) as ``␣``, ``Ċ`` as ``\\n``."""
    return str(token).replace("Ġ", "␣").replace("Ċ", "\\n")


def _token_labels(tokens: Sequence[str] | None, n: int) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    if len(tokens) != n:
        raise InvalidArgument(f"got {len(tokens)} token labels for {n} positions")
    return [token_label(token) for token in tokens]


def _norm_per_token(states: torch.Tensor, row: int) -> torch.Tensor:
    """``[batch, seq, ...]`` -> ``[seq]`` norms of batch row ``row``; a 1-D tensor is taken as norms already."""
    states = torch.as_tensor(states).detach()
    if states.ndim == 1:
        return states.float().cpu()
    if states.ndim < 3:
        raise ShapeError(f"expected states [batch, seq, ...] (or norms [seq]), got shape {tuple(states.shape)}")
    return states[row].flatten(1).float().norm(dim=-1).cpu()


def state_norms(
    states_by_layer: Any,
    tokens: Sequence[str] | None = None,
    *,
    row: int = 0,
    title: str = "Recurrent state norm after each token",
) -> Any:
    """A heatmap of the state norm per token (x) and layer (y).

    Args:
        states_by_layer: ``{layer_index: states}`` (or a list), each a layer's
            ``linear_attn.states`` ``[batch, seq, ...]``, or already the norms
            ``[seq]``. Every layer must cover the same tokens.
        tokens: the token strings, for the x axis (``tokenizer.convert_ids_to_tokens``).
        row: the batch row to plot.
        title: the figure title.

    Returns:
        a matplotlib ``Figure``.
    """
    Figure = figure_class()
    labels, values = _layers(states_by_layer)
    if not values:
        raise InvalidArgument("state_norms needs at least one layer's states")
    norms = [_norm_per_token(value, row) for value in values]
    lengths = {len(n) for n in norms}
    if len(lengths) != 1:
        raise InvalidArgument(f"every layer must cover the same tokens, got lengths {sorted(lengths)}")
    grid = torch.stack(norms).numpy()
    names = _token_labels(tokens, grid.shape[1])
    fig = Figure(figsize=(max(5.0, 0.55 * len(names) + 2.5), max(2.6, 0.4 * len(labels) + 1.6)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), [str(label) for label in labels], fontsize=8)
    ax.set_xlabel("token (state after it)")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="‖S‖ (Frobenius)")
    return fig


def head_norms(state: torch.Tensor, *, row: int = 0, title: str = "State norm per head", unit: str = "head") -> Any:
    """Bars: the norm of each head's state, for one state.

    Args:
        state: one state, ``[batch, mixer_heads, ...]`` (``state_output``,
            ``state_after(t)``, ``states[:, t]``), or ``[mixer_heads, ...]``
            with ``row=None``. Each head's state (``[key_dim, value_dim]`` on a
            DeltaNet) is reduced to its Frobenius norm.
        row: the batch row to plot; ``None`` when ``state`` has no batch axis.
        title: the figure title.
        unit: what axis 1 of the state is (``"channel"`` on Mamba-1, whose state is ``[channels, state_size]``).

    Returns:
        a matplotlib ``Figure``.
    """
    Figure = figure_class()
    from matplotlib.ticker import MaxNLocator

    state = torch.as_tensor(state).detach()
    heads = state if row is None else state[row]
    if heads.ndim < 2:
        raise ShapeError(f"expected a state [batch, mixer_heads, ...], got shape {tuple(state.shape)}")
    norms = heads.flatten(1).float().norm(dim=-1).cpu().numpy()
    fig = Figure(figsize=(min(10.0, max(4.0, 0.3 * len(norms) + 2.0)), 3.0), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(norms)), norms, color="tab:blue", width=0.8 if len(norms) <= 64 else 1.0)
    if len(norms) <= 32:
        ax.set_xticks(range(len(norms)))  # every head while the labels fit
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_xlim(-0.6, len(norms) - 0.4)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel(unit)
    ax.set_ylabel("‖S‖ (Frobenius)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return fig


def effective_attention(
    pattern: torch.Tensor,
    tokens: Sequence[str] | None = None,
    *,
    heads: Sequence[int] | None = None,
    row: int = 0,
    title: str = "Effective attention",
    unit: str = "head",
) -> Any:
    """Heatmaps of a recurrent mixer's effective attention: output token (y) × value token (x), one panel per head.

    Args:
        pattern: ``linear_attn.effective_attention`` ``[batch, heads, seq, seq]``
            (Mamba-1: ``[batch, channels, seq, seq]``), or ``[heads, seq, seq]``
            with ``row=None``.
        tokens: the token strings, for both axes.
        heads: which heads (channels) to draw, 4 at most is readable (default: the first 4).
        row: the batch row; ``None`` when ``pattern`` has no batch axis.
        title: the figure title.
        unit: what axis 1 is (``"channel"`` on Mamba-1).

    The colour scale is symmetric around 0: unlike softmax attention, the
    coefficients of a delta rule (and Mamba's skip and gate) can be negative.

    Returns:
        a matplotlib ``Figure``.
    """
    Figure = figure_class()
    pattern = torch.as_tensor(pattern).detach()
    panels = pattern if row is None else pattern[row]
    if panels.ndim != 3 or panels.shape[-1] != panels.shape[-2]:
        raise ShapeError(f"expected [batch, heads, seq, seq], got shape {tuple(pattern.shape)}")
    chosen = list(range(min(4, panels.shape[0]))) if heads is None else list(heads)
    names = _token_labels(tokens, panels.shape[-1])
    size = max(2.8, 0.32 * len(names) + 1.4)
    fig = Figure(figsize=(size * len(chosen) + 0.8, size + 0.4), layout="constrained")
    axes = fig.subplots(1, len(chosen), squeeze=False)[0]
    scale = float(panels[chosen].abs().max()) or 1.0
    image = None
    for ax, head in zip(axes, chosen):
        image = ax.imshow(panels[head].float().cpu().numpy(), cmap="RdBu_r", vmin=-scale, vmax=scale, interpolation="nearest")
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{unit} {head}", fontsize=9)
        ax.set_xlabel("value token s")
    axes[0].set_ylabel("output token t")
    fig.suptitle(title)
    fig.colorbar(image, ax=list(axes), label="A[t, s]", shrink=0.8)
    return fig


def patch_effect(
    effects: Any,
    tokens: Sequence[str] | None = None,
    *,
    label: str = "Δ p(target)",
    title: str = "Effect of a state patch on the next token",
    xlabel: str = "patched position (state after this token)",
) -> Any:
    """The effect of a patch on the next-token distribution, across layers.

    Args:
        effects: one of
            ``{layer: float}`` (or a list): one number per patched layer, drawn as bars;
            ``{layer: [float per position]}`` (or a 2-D tensor ``[layers, positions]``):
            a heatmap, layers × positions;
            a `nnterp.sweep.SweepResult`: its ``effect`` grid (cells not run are blank).
        tokens: labels of the positions (heatmap) or ignored (bars).
        label: what the number is (colorbar / y axis), e.g. ``"Δ p(' Paris')"``.
        title: the figure title.
        xlabel: what a column is (a knockout sweep's: the source position).

    Returns:
        a matplotlib ``Figure``. Heatmaps use a diverging colormap centred on 0:
        red raised the target, blue lowered it.
    """
    Figure = figure_class()
    if hasattr(effects, "effect") and hasattr(effects, "layers"):  # a SweepResult
        labels, grid = list(effects.layers), effects.effect
        positions = list(effects.positions)
        if tokens is None and getattr(effects, "tokens", None) is not None:
            tokens = [effects.tokens[p] for p in positions]
        if not getattr(effects, "complete", True):
            title = f"{title}\ninterrupted: {effects.done} of {grid.numel()} cells run (grey: not run)"
    elif isinstance(effects, torch.Tensor) and effects.ndim == 2:
        labels, grid, positions = list(range(effects.shape[0])), effects, None
    else:
        labels, values = _layers(effects)
        rows = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values]
        if all(len(r) == 1 for r in rows):
            return _bars(Figure, labels, torch.cat(rows).numpy() if rows else [], label, title)
        grid, positions = torch.stack(rows), None
    grid = torch.as_tensor(grid, dtype=torch.float32).detach().cpu()
    if positions is None:
        positions = list(range(grid.shape[1]))
    names = _token_labels(tokens, grid.shape[1]) if tokens is not None else [str(p) for p in positions]
    finite = grid[torch.isfinite(grid)]
    bound = float(finite.abs().max()) if finite.numel() else 1.0
    bound = bound or 1.0  # an all-zero grid still gets a colorbar
    fig = Figure(figsize=(max(5.0, 0.55 * len(names) + 2.5), max(2.6, 0.4 * len(labels) + 1.6)), layout="constrained")
    ax = fig.add_subplot()
    from matplotlib import colormaps

    cmap = colormaps["RdBu_r"].with_extremes(bad="0.8")  # a cell not run (NaN) is grey, not "no effect" white
    image = ax.imshow(grid.numpy(), aspect="auto", cmap=cmap, vmin=-bound, vmax=bound, interpolation="nearest")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), [str(layer) for layer in labels], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label)
    return fig


def attribution(result: Any, sweep: Any = None, *, label: str = "Δ metric", title: str = "Which state matters") -> Any:
    """A `nnterp.attribution.AttributionResult`'s estimate as a heatmap, beside a `patch_sweep`'s effects.

    Args:
        result: what `nnterp.attribution.state_attribution` returned.
        sweep: optionally the `nnterp.sweep.SweepResult` of the same prompts
            (same layers and positions): drawn beside the estimate on the same
            colour scale, with a scatter of estimate against effect and their
            rank correlation in its title.
        label: what the number is (colorbar), e.g. ``"Δ p(' Paris')"``.
        title: the figure title.

    Returns:
        a matplotlib ``Figure``.
    """
    Figure = figure_class()
    grids = [("attribution estimate", torch.as_tensor(result.estimate, dtype=torch.float32).detach().cpu())]
    if sweep is not None:
        grids.append(("patching effect", torch.as_tensor(sweep.effect, dtype=torch.float32).detach().cpu()))
    positions = list(result.positions)
    names = _token_labels([result.tokens[p] for p in positions], len(positions)) if result.tokens else [str(p) for p in positions]
    finite = torch.cat([g[torch.isfinite(g)] for _, g in grids])
    bound = float(finite.abs().max()) if finite.numel() else 1.0
    bound = bound or 1.0
    columns = len(grids) + (1 if sweep is not None else 0)
    fig = Figure(figsize=(columns * max(4.0, 0.45 * len(names) + 2.0), max(2.8, 0.4 * len(result.layers) + 1.8)), layout="constrained")
    axes = fig.subplots(1, columns, squeeze=False)[0]
    from matplotlib import colormaps

    cmap = colormaps["RdBu_r"].with_extremes(bad="0.8")
    for ax, (name, grid) in zip(axes, grids):
        image = ax.imshow(grid.numpy(), aspect="auto", cmap=cmap, vmin=-bound, vmax=bound, interpolation="nearest")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(result.layers)), [str(layer) for layer in result.layers], fontsize=8)
        ax.set_xlabel("position (state after this token)")
        ax.set_ylabel("layer")
        ax.set_title(name)
    fig.colorbar(image, ax=list(axes[: len(grids)]), label=label)
    if sweep is not None:
        estimate, effect = grids[0][1].flatten(), grids[1][1].flatten()
        keep = torch.isfinite(estimate) & torch.isfinite(effect)
        ax = axes[-1]
        ax.scatter(effect[keep].numpy(), estimate[keep].numpy(), s=12)
        ax.axline((0, 0), slope=1, color="black", linewidth=0.8)
        ax.set_xlabel("patching effect")
        ax.set_ylabel("estimate")
        ax.set_title(f"rank correlation {rank_correlation(estimate[keep], effect[keep]):.2f}")
    fig.suptitle(title)
    return fig


def _bars(Figure: Any, labels: list, values: Any, label: str, title: str) -> Any:
    fig = Figure(figsize=(max(4.0, 0.45 * len(labels) + 2.0), 3.0), layout="constrained")
    ax = fig.add_subplot()
    colors = ["tab:red" if v > 0 else "tab:blue" for v in values]
    bars = ax.bar(range(len(labels)), values, color=colors)
    # A zero bar is invisible; its number is not.
    ax.bar_label(bars, fmt=lambda v: f"{v:+.4f}" if abs(v) >= 5e-5 else "0", fontsize=7, padding=2)
    ax.margins(y=0.15)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [str(layer) for layer in labels], fontsize=8)
    ax.set_xlabel("patched layer")
    ax.set_ylabel(label)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return fig


@torch.no_grad()
def logit_lens(model: Any, prompt: str, *, layers: Sequence[int] | None = None, title: str = "Logit lens") -> Any:
    """The logit lens of one prompt, layers × positions: each cell the top token and its probability.

    Each layer's output at each position goes through the family's final norm
    and unembedding (``model.project_on_vocab``); the cell is coloured by the
    top token's probability and labelled with the token. Works on every
    family: on a hybrid, the recurrent blocks' rows read the residual stream
    after the recurrent mixer and the MLP as the attention blocks' rows do.

    Args:
        model: a `StandardizedTransformer`.
        prompt: one prompt.
        layers: the layers to show (all by default).
        title: the figure title.

    Returns:
        a matplotlib ``Figure`` (rows: layers, first at the bottom; columns: positions).
    """
    Figure = figure_class()
    layers = list(range(model.num_layers)) if layers is None else layer_indices(layers, model.num_layers, "plot.logit_lens(layers=...)")
    rows: list = []
    with model.trace(prompt):
        for layer in sorted(layers):
            rows.append(model.project_on_vocab(model.layers_output[layer][0]).float().softmax(-1).cpu().save())
    top = torch.stack(rows).max(-1)  # [layers, seq]
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids[0]
    names = _token_labels(model.tokenizer.convert_ids_to_tokens(ids), len(ids))
    fig = Figure(figsize=(max(5.0, 0.9 * len(names) + 2.5), max(2.6, 0.45 * len(layers) + 1.6)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(top.values.numpy(), aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0, origin="lower", interpolation="nearest")
    for row in range(top.values.shape[0]):
        for column in range(top.values.shape[1]):
            word = token_label(model.tokenizer.convert_ids_to_tokens(int(top.indices[row, column])))
            ax.text(column, row, word[:8], ha="center", va="center", fontsize=7,
                    color="white" if float(top.values[row, column]) > 0.6 else "black")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), [str(layer) for layer in sorted(layers)], fontsize=8)
    ax.set_xlabel("position (input token)")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="probability of the top token")
    return fig
