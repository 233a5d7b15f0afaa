"""Faithfulness: how much of the metric a circuit keeps when every other edge is patched away.

Mental model. A circuit is a set of edges (`nnterp.circuits.graph.Circuit`). The model runs on the clean
prompts with every edge *outside* the circuit patched (`nnterp.circuits.patching`) to its corrupt value
(``ablation="corrupt"``: the pair's own corrupt prompt) or to its mean over the corrupt prompts, per position
(``"mean"``). The recovered fraction is

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
from .patching import NodeRun, prompt_ids, trace_nodes
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


def _pairs(model: Any, clean: Any, corrupt: Any, ablation: str) -> tuple:
    if ablation not in ("corrupt", "mean"):
        raise InvalidArgument(f"ablation is 'corrupt' or 'mean', got {ablation!r}")
    clean_ids, corrupt_ids = prompt_ids(model, clean, "clean"), prompt_ids(model, corrupt, "corrupt")
    if clean_ids.shape[1] != corrupt_ids.shape[1] or (ablation == "corrupt" and clean_ids.shape[0] != corrupt_ids.shape[0]):
        raise ShapeError(f"clean {tuple(clean_ids.shape)} and corrupt {tuple(corrupt_ids.shape)} must be pairs of prompts of one length")
    return clean_ids, corrupt_ids


def _metric_of(
    model: Any, nodes: Any, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Callable, circuits: list, ablation: str,
    batch_size: Any, progress: bool = False,
) -> tuple:
    """``(m(clean), [m(each circuit's complement patched)])``, each averaged over the pairs; a tqdm bar over the runs."""
    from tqdm.auto import tqdm

    count = clean_ids.shape[0]
    step = batch_size or count
    mean, positional = None, circuits[0].seq is not None
    if ablation == "mean":
        runs = [trace_nodes(model, nodes, corrupt_ids[start : start + step], positional=positional) for start in range(0, corrupt_ids.shape[0], step)]
        terms = {name: torch.cat([run.terms[name] for run in runs]) for name in runs[0].terms}
        factors = torch.cat([run.factors for run in runs]) if runs[0].factors is not None else None
        mean = NodeRun(torch.cat([run.outputs for run in runs]), None, None, {}, terms, factors, mean=True)
    patches = [circuit.patches(circuit.complement()) for circuit in circuits]
    clean_total, totals = 0.0, [0.0] * len(circuits)
    bar = tqdm(total=len(range(0, count, step)) * len(circuits), desc="faithfulness", disable=not progress, leave=False)
    for start in range(0, count, step):
        pairs = torch.arange(start, min(start + step, count))
        base = trace_nodes(model, nodes, clean_ids[pairs], metric=metric, pairs=pairs, positional=positional)
        clean_total += float(base.values.sum())
        donor = mean if mean is not None else trace_nodes(model, nodes, corrupt_ids[pairs], positional=positional)
        for i, (whole, terms) in enumerate(patches):
            run = base
            if whole or terms:
                run = trace_nodes(
                    model, nodes, clean_ids[pairs], patch=whole, patch_terms=terms, corrupt=donor, metric=metric, pairs=pairs, positional=positional
                )
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
    clean_ids, corrupt_ids = _pairs(model, clean, corrupt, ablation)
    empty = Circuit(circuit.nodes, [], circuit.seq)
    clean_value, (inside, outside) = _metric_of(model, circuit.nodes, clean_ids, corrupt_ids, metric, [circuit, empty], ablation, batch_size)
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
    clean_ids, corrupt_ids = _pairs(model, clean, corrupt, ablation)
    circuits = [graph.circuit(fraction=f) for f in fractions] + [Circuit(graph.nodes, [], graph.seq)]
    clean_value, values = _metric_of(model, graph.nodes, clean_ids, corrupt_ids, metric, circuits, ablation, batch_size, progress)
    recovered = [Faithfulness(clean_value, values[-1], value, len(c)).recovered for c, value in zip(circuits[:-1], values)]
    return FaithfulnessCurve([len(c) for c in circuits[:-1]], list(fractions), recovered, len(graph.edges))
