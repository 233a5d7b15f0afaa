"""nnterp 1.x's ``nnterp.display``: a Plotly heatmap of the top tokens per layer, and prompts as a pandas table.

Both need the ``display`` extra (``pip install nnterp[display]``: plotly
and pandas), imported when a function is called, so ``import nnterp.display``
works without them. nnterp's own matplotlib plots are `nnterp.plot`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch as th

from .prompt_utils import Prompt

__all__ = ["plot_topk_tokens", "prompts_to_df"]

INSTALL = "pip install 'nnterp[display]' (plotly and pandas)"


def _needs(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"nnterp.display needs {module.partition('.')[0]}: {INSTALL}") from error


def plot_topk_tokens(
    next_token_probs: th.Tensor,
    tokenizer: Any,
    k: int = 4,
    title: str | None = None,
    use_token_ids: bool = False,
    file: str | Path | None = None,
    save_html: bool = True,
    height: int = 300,
    width: int = 400,
) -> Any:
    """A heatmap per prompt of the ``k`` most probable tokens (columns) at each layer (rows); shown, and returned as a ``plotly`` ``Figure``.

    ``next_token_probs``: ``[batch, layers, vocab]``, ``[layers, vocab]`` or
    ``[vocab]`` (``logit_lens``'s output). Three prompts a row. ``file``: an
    ``.html`` path, or an image path (written with kaleido) with an HTML copy
    beside it when ``save_html``.
    """
    go = _needs("plotly.graph_objects")
    subplots = _needs("plotly.subplots")
    if next_token_probs.dim() == 1:
        next_token_probs = next_token_probs.unsqueeze(0).unsqueeze(0)
    elif next_token_probs.dim() == 2:
        next_token_probs = next_token_probs.unsqueeze(0)
    batch_size, num_layers, _ = next_token_probs.shape
    n_cols = min(3, batch_size)
    n_rows = math.ceil(batch_size / n_cols)
    fig = subplots.make_subplots(rows=n_rows, cols=n_cols, vertical_spacing=0.1, horizontal_spacing=0.05)
    for batch_idx, probs in enumerate(next_token_probs):
        top = th.topk(probs, k=k, dim=-1)
        ids = [[str(t.item()) for t in layer] for layer in top.indices]
        strings = [["'" + tokenizer.convert_ids_to_tokens(t.item()) + "'" for t in layer] for layer in top.indices]
        hover = [[f"ID: {i}<br>Token: {s}" for i, s in zip(layer_ids, layer_strings)] for layer_ids, layer_strings in zip(ids, strings)]
        row, col = batch_idx // n_cols + 1, batch_idx % n_cols + 1
        fig.add_trace(
            go.Heatmap(
                z=top.values.tolist(), x=list(range(k)), y=list(range(num_layers)), text=ids if use_token_ids else strings,
                texttemplate="%{text}", colorscale="RdBu_r", colorbar=dict(title="Probability", thickness=15, len=0.9),
                hovertext=hover, hovertemplate="Layer: %{y}<br>%{hovertext}<br>Probability: %{z}<extra></extra>",
            ),
            row=row, col=col,
        )
        fig.update_traces(zmin=0, zmax=1)
        fig.update_xaxes(title_text="Tokens", row=row, col=col)
        fig.update_yaxes(title_text="Layers", row=row, col=col)
    fig.update_layout(title=title or f"Top {k} Tokens Heatmap", height=height * n_rows, width=width * n_cols, showlegend=False)
    if file:
        file = Path(file)
        if file.suffix != ".html":
            fig.write_image(file, scale=3)
        if save_html or file.suffix == ".html":
            fig.write_html(file if file.suffix == ".html" else file.with_suffix(".html"))
    fig.show()
    return fig


def prompts_to_df(prompts: list[Prompt], tokenizer: Any = None) -> Any:
    """A pandas ``DataFrame`` with one column per prompt: its text, each target's strings and (with ``tokenizer``) tokens."""
    pd = _needs("pandas")
    table: dict = {}
    for i, prompt in enumerate(prompts):
        table[i] = {"prompt": prompt.prompt}
        for target, string in (prompt.target_strings or {}).items():
            table[i][target + "_string"] = string
        if tokenizer is not None:
            for target, tokens in prompt.target_tokens.items():
                table[i][target + "_tokens"] = tokenizer.convert_ids_to_tokens(tokens)
    return pd.DataFrame.from_dict(table)
