"""Faithfulness: how much of the metric a circuit keeps when every other edge is patched away.

Mental model. A circuit is a set of edges (`nnterp.circuits.graph.Circuit`). The model runs on the clean
prompts with every edge *outside* the circuit patched (`nnterp.circuits.patching`) to its corrupt value
(``ablation="corrupt"``: the pair's own corrupt prompt) or to its mean over the corrupt prompts of the clean
prompt's length, per position (``"mean"``; pairs of different lengths: `nnterp.circuits.pairs`). The recovered
fraction is

    (m(circuit) − m(empty)) / (m(clean) − m(empty))

with ``m`` the metric averaged over the pairs and ``m(empty)`` the run with every edge patched: with
``ablation="corrupt"`` that is the corrupt forward itself, so the fraction is Hanna et al.'s
``(m(circuit) − m(corrupt)) / (m(clean) − m(corrupt))``. The full graph recovers 1 and the empty circuit 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import InvalidArgument, ShapeError
from .graph import Circuit, EdgeGraph
from .pairs import group_pairs, one_length
from .patching import NodeRun, trace_nodes
from .plot import plot_curve

__all__ = ["Faithfulness", "FaithfulnessCurve", "faithfulness", "faithfulness_curve"]


@dataclass
class Faithfulness:
    """What `faithfulness` measured: the metric (averaged over the pairs) on the clean run, with every edge
    patched (``empty``), with the circuit's complement patched (``circuit``), and ``recovered``, the fraction."""

    clean: float
    empty: float
    circuit: float
    edges: int

    @property
    def recovered(self) -> float:
        span = self.clean - self.empty
        return (self.circuit - self.empty) / span if span else float("nan")


@dataclass
class FaithfulnessCurve:
    """``recovered[i]``: the fraction recovered by the top ``sizes[i]`` edges (``fractions[i]`` of ``total``)."""

    sizes: list
    fractions: list
    recovered: list
    total: int

    def plot(self, ax: Any = None) -> Any:
        """Recovered fraction against the share of edges kept (matplotlib, the ``plot`` extra); returns the Figure."""
        return plot_curve(self, ax=ax)


def _groups(model: Any, clean: Any, corrupt: Any, ablation: str, seq: int | None) -> list:
    groups = group_pairs(model, clean, corrupt, ablation)
    if seq is not None and one_length(groups, "a positional circuit") != seq:
        raise ShapeError(f"the circuit's positional edges are of prompts {seq} tokens long, these are {groups[0].seq}: pass prompts of {seq} tokens")
    return groups


def _metric_of(
    model: Any, nodes: Any, groups: list, metric: Callable, circuits: list, ablation: str, batch_size: Any, progress: bool = False
) -> tuple:
    """``(m(clean), [m(each circuit's complement patched)])``, each averaged over the pairs of every length (each
    length its own batches, its own mean donor); a tqdm bar over the runs."""
    from tqdm.auto import tqdm

    count = sum(len(group.pairs) for group in groups)
    positional = circuits[0].seq is not None
    patches = [circuit.patches(circuit.complement()) for circuit in circuits]
    clean_total, totals = 0.0, [0.0] * len(circuits)
    batches = [(group, batch) for group in groups for batch in group.batches(batch_size)]
    bar = tqdm(total=len(batches) * len(circuits), desc="faithfulness", disable=not progress, leave=False)
    mean, meant = None, None
    for group, (pairs, ids, donor_ids) in batches:
        if ablation == "mean" and meant is not group:
            step = batch_size or group.corrupt.shape[0]
            runs = [trace_nodes(model, nodes, group.corrupt[start : start + step], positional=positional) for start in range(0, group.corrupt.shape[0], step)]
            terms = {name: torch.cat([run.terms[name] for run in runs]) for name in runs[0].terms}
            factors = torch.cat([run.factors for run in runs]) if runs[0].factors is not None else None
            mean, meant = NodeRun(torch.cat([run.outputs for run in runs]), None, None, {}, terms, factors, mean=True), group
        base = trace_nodes(model, nodes, ids, metric=metric, pairs=pairs, positional=positional)
        clean_total += float(base.values.sum())
        donor = mean if mean is not None else trace_nodes(model, nodes, donor_ids, positional=positional)
        for i, (whole, terms) in enumerate(patches):
            run = base
            if whole or terms:
                run = trace_nodes(model, nodes, ids, patch=whole, patch_terms=terms, corrupt=donor, metric=metric, pairs=pairs, positional=positional)
            totals[i] += float(run.values.sum())
            bar.update(1)
    bar.close()
    return clean_total / count, [total / count for total in totals]


def faithfulness(
    model: Any, circuit: Circuit, clean: Any, corrupt: Any, metric: Callable, ablation: str = "corrupt", batch_size: int | None = None
) -> Faithfulness:
    """The fraction of the metric ``circuit`` recovers (module docstring); ``metric(logits, pairs) -> [batch]`` as
    `nnterp.circuits.edge_attribution` takes it, and the prompts as there."""
    if not isinstance(circuit, Circuit):
        raise InvalidArgument(f"faithfulness takes a Circuit (graph.circuit(fraction)), got {type(circuit).__name__}")
    groups = _groups(model, clean, corrupt, ablation, circuit.seq)
    empty = Circuit(circuit.nodes, [], circuit.seq)
    clean_value, (inside, outside) = _metric_of(model, circuit.nodes, groups, metric, [circuit, empty], ablation, batch_size)
    return Faithfulness(clean_value, outside, inside, len(circuit))


def faithfulness_curve(
    model: Any,
    graph: EdgeGraph,
    clean: Any,
    corrupt: Any,
    metric: Callable,
    fractions: Sequence[float] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
    ablation: str = "corrupt",
    batch_size: int | None = None,
    progress: bool = True,
) -> FaithfulnessCurve:
    """`faithfulness` of ``graph.circuit(fraction)`` for each of ``fractions`` (one clean, one corrupt and one
    patched run per circuit and batch), with a tqdm bar over the circuits."""
    groups = _groups(model, clean, corrupt, ablation, graph.seq)
    circuits = [graph.circuit(fraction=f) for f in fractions] + [Circuit(graph.nodes, [], graph.seq)]
    clean_value, values = _metric_of(model, graph.nodes, groups, metric, circuits, ablation, batch_size, progress)
    recovered = [Faithfulness(clean_value, values[-1], value, len(c)).recovered for c, value in zip(circuits[:-1], values)]
    return FaithfulnessCurve([len(c) for c in circuits[:-1]], list(fractions), recovered, len(graph.edges))
