"""Pictures of a circuit (matplotlib, the ``plot`` extra): the layered graph of its strongest edges, and a
faithfulness curve. Nothing here runs the model; each function returns a matplotlib ``Figure``.

The graph is drawn in forward order, left to right: a column per stage (the embeddings, then each layer's
attention or mixer heads, its MLP, and the logits), a source node per head or part, and a destination marker
where a part reads the residual. An edge is a line from its source to its destination, as wide as its score's
size relative to the largest drawn, blue where patching it raises the metric, red where it lowers it; a
positional edge is labelled with its source position.
"""

from __future__ import annotations

from typing import Any

from ..plot import figure_class

__all__ = ["plot_graph", "plot_curve"]


def _stages(nodes: Any) -> dict:
    """``{name: (column, row)}`` for every source and destination: a column per part, in forward order."""
    where = {"embed": (0, 0.0)}
    column = 0
    for part in nodes.parts:
        column += 1
        where[part.name] = (column - 0.35, -1.0)  # the destination: where the part reads
        for row, source in enumerate(part.sources):
            where[source] = (column, float(row))
    where["logits"] = (column + 1, 0.0)
    return where


def plot_graph(graph: Any, k: int = 30, ax: Any = None) -> Any:
    """The ``k`` strongest edges of an `EdgeGraph` as a layered graph (module docstring); returns the Figure."""
    Figure = figure_class("nnterp.circuits' plots")
    figure = ax.figure if ax is not None else Figure(figsize=(max(6, len(graph.nodes.parts) * 1.2), 4.5))
    ax = ax if ax is not None else figure.add_subplot()
    where = _stages(graph.nodes)
    top = graph.top(k=min(k, len(graph.edges)))
    largest = max((abs(edge[-1]) for edge in top), default=1.0) or 1.0
    for edge in top:
        source, destination, score = edge[0], edge[1], edge[-1]
        (x0, y0), (x1, y1) = where[source], where[destination]
        ax.plot([x0, x1], [y0, y1], color="tab:blue" if score > 0 else "tab:red", linewidth=0.5 + 4 * abs(score) / largest, alpha=0.7)
        if len(edge) == 4 and edge[2] is not None:
            ax.annotate(str(edge[2]), ((x0 + x1) / 2, (y0 + y1) / 2), fontsize=7)
    for name in graph.nodes.sources:
        x, y = where[name]
        ax.scatter([x], [y], color="black", s=18, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for name in graph.nodes.destinations:
        x, y = where[name]
        ax.scatter([x], [y], marker="s", color="grey", s=18, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(3, -9), fontsize=7, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"{graph.method}: the {len(top)} strongest of {len(graph.edges)} edges (blue: patching raises the metric)")
    return figure


def plot_curve(curve: Any, ax: Any = None) -> Any:
    """A `FaithfulnessCurve`: the recovered fraction against the share of edges kept; returns the Figure."""
    Figure = figure_class("nnterp.circuits' plots")
    figure = ax.figure if ax is not None else Figure(figsize=(5, 3.5))
    ax = ax if ax is not None else figure.add_subplot()
    shares = [size / curve.total for size in curve.sizes]
    ax.plot(shares, curve.recovered, marker="o")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("share of the edges in the circuit")
    ax.set_ylabel("recovered fraction of the metric")
    ax.set_title(f"Faithfulness ({curve.total} edges)")
    return figure
