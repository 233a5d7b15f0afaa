"""`EdgeGraph`: the scored edges of a model's graph, and the circuits taken from it.

``graph.edges[i]`` is ``(source, destination)`` (names of `nnterp.circuits.nodes`) and ``graph.scores[i]``
its score: the estimated change of the metric when that edge alone is patched from the clean run to the
corrupt one, averaged over the prompt pairs (negative: the patch lowers the metric). Edges rank by the size
of their score. A circuit is a set of edges (`Circuit`): the rest is what `nnterp.circuits.faithfulness`
patches away.

``to_json()`` schema (a dict, JSON-serializable)::

    {
      "method": "eap" | "eap-ig",
      "clean": float, "corrupt": float,      # the metric, averaged over the pairs, on each prompt
      "nodes": [{"name": "a3.h1", "kind": "attention_head", "layer": 3}, ...],   # sources, forward order
      "destinations": [{"name": "a3", "kind": "attention", "layer": 3}, ..., {"name": "logits", ...}],
      "positional": bool,
      "edges": [{"source": "a3.h1", "destination": "mlp3", "score": float}, ...]  # graph.edges order
    }

in a positional graph each edge has ``"position"`` too: the source position ``s`` of a head's term, ``null``
for the embeddings and an MLP.

node kinds: ``"embed"``, ``"attention_head"``, ``"attention"``, ``"mixer_head"``, ``"mixer"``, ``"mlp"``;
destination kinds: ``"attention"``, ``"mixer"``, ``"mlp"``, ``"logits"``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..core.errors import InvalidArgument
from .nodes import NodeMap
from .plot import plot_graph

__all__ = ["EdgeGraph", "Circuit"]


def _count(total: int, k: Any, fraction: Any) -> int:
    if (k is None) == (fraction is None):
        raise InvalidArgument("give one of k= (a number of edges) or fraction= (a share of the edges, 0..1)")
    if fraction is not None:
        if not 0 <= fraction <= 1:
            raise InvalidArgument(f"fraction is a share of the edges in [0, 1], got {fraction!r}")
        return round(fraction * total)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidArgument(f"k is a number of edges (an int ≥ 0), got {k!r}")
    return min(k, total)


class Circuit:
    """A set of edges of a graph (``edges``: ``[(source, destination), ...]``, or ``(source, destination, s)`` in a
    positional graph of prompts ``seq`` tokens long) and the graph's `NodeMap` (``nodes``)."""

    def __init__(self, nodes: NodeMap, edges: list, seq: int | None = None) -> None:
        self.nodes, self.edges, self.seq = nodes, [tuple(edge) for edge in edges], seq
        self.patches(self.edges)  # every edge must be one of the graph's

    def all_edges(self) -> list:
        """Every edge of the circuit's graph."""
        return self.nodes.edges if self.seq is None else self.nodes.positional_edges(self.seq)

    def patches(self, edges: list) -> tuple:
        """``(whole, terms)``: the weights `nnterp.circuits.patching.trace_nodes` patches ``edges`` with."""
        if self.seq is None:
            return self.nodes.weights(edges), {}
        return self.nodes.positional_weights(edges, self.seq)

    def __len__(self) -> int:
        return len(self.edges)

    def __contains__(self, edge: Any) -> bool:
        return tuple(edge) in set(self.edges)

    def complement(self) -> list:
        """The graph's edges not in the circuit, in graph order."""
        inside = set(self.edges)
        return [edge for edge in self.all_edges() if edge not in inside]

    def __repr__(self) -> str:
        return f"Circuit({len(self.edges)} of {len(self.all_edges())} edges)"


class EdgeGraph:
    """Scores of every edge (module docstring). Attributes: ``nodes`` (`NodeMap`), ``edges``, ``scores`` ``[edges]``,
    ``method``, ``clean`` / ``corrupt`` (the metric on each prompt, averaged over the pairs)."""

    def __init__(self, nodes: NodeMap, scores: torch.Tensor, method: str, clean: float, corrupt: float, seq: int | None = None) -> None:
        self.nodes, self.seq, self.scores = nodes, seq, scores
        self.edges = nodes.edges if seq is None else nodes.positional_edges(seq)
        self.method, self.clean, self.corrupt = method, clean, corrupt

    def order(self) -> list:
        """Edge indices by decreasing size of score (ties in graph order)."""
        return sorted(range(len(self.edges)), key=lambda i: -abs(float(self.scores[i])))

    def top(self, k: int | None = None, fraction: float | None = None) -> list:
        """The ``k`` edges (or ``fraction`` of them) of largest score in size: ``[(source, destination, score), ...]``."""
        chosen = self.order()[: _count(len(self.edges), k, fraction)]
        return [(*self.edges[i], float(self.scores[i])) for i in chosen]

    def circuit(self, fraction: float | None = None, k: int | None = None) -> Circuit:
        """The `Circuit` of the top ``fraction`` (or ``k``) of the edges by size of score."""
        if fraction is None and k is None:
            raise InvalidArgument("graph.circuit takes fraction= (a share of the edges, 0..1) or k= (a number of edges)")
        return Circuit(self.nodes, [edge[:-1] for edge in self.top(k=k, fraction=fraction)], self.seq)

    def score(self, *edge: Any) -> float:
        """The score of one edge: ``graph.score(source, destination)`` (``, s`` in a positional graph)."""
        return float(self.scores[self.edges.index(tuple(edge))])

    def to_json(self) -> dict:
        """The graph as a JSON-serializable dict (schema in the module docstring)."""
        kinds = {part.name: part for part in self.nodes.parts}

        def source_kind(name: str) -> str:
            if name == "embed":
                return "embed"
            part = kinds[name.split(".")[0]]
            return {"mlp": "mlp"}.get(part.kind) or part.kind + ("_head" if "." in name else "")

        return {
            "method": self.method,
            "clean": self.clean,
            "corrupt": self.corrupt,
            "nodes": [{"name": u, "kind": source_kind(u), "layer": self.nodes.layers[u]} for u in self.nodes.sources],
            "destinations": [
                {"name": v, "kind": kinds[v].kind if v in kinds else "logits", "layer": self.nodes.layers[v]} for v in self.nodes.destinations
            ],
            "positional": self.seq is not None,
            "edges": [
                {"source": edge[0], "destination": edge[1], **({"position": edge[2]} if self.seq is not None else {}), "score": float(s)}
                for edge, s in zip(self.edges, self.scores)
            ],
        }

    def dumps(self) -> str:
        """`to_json` as a string."""
        return json.dumps(self.to_json())

    def plot(self, k: int = 30, ax: Any = None) -> Any:
        """A layered picture of the ``k`` strongest edges (matplotlib, the ``plot`` extra): `plot.plot_graph`; a Figure."""
        return plot_graph(self, k=k, ax=ax)

    def __repr__(self) -> str:
        return f"EdgeGraph({len(self.nodes.sources)} sources, {len(self.edges)} edges, method={self.method!r})"
