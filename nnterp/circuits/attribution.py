"""Edge attribution patching (EAP) and its integrated-gradients variant (EAP-IG) over mixed components.

Mental model. Patching the edge ``u -> v`` adds ``u_corrupt − u_clean`` to ``v``'s input
(`nnterp.circuits.patching`). To first order its effect on the metric is

    score(u -> v) = Σ_t (u_corrupt[t] − u_clean[t]) · ∂metric/∂input_v[t]

with the gradient taken in the clean run (``method="eap"``: Syed et al. 2023, arXiv:2310.10348): one corrupt
forward, and one clean forward and backward, give every edge's score. ``method="eap-ig"`` averages the gradient
over ``steps`` runs whose ``"embed"`` source (the residual stream as it starts, after RWKV-4's embedding norm)
is ``corrupt + (k / steps) · (clean − corrupt)``, ``k = 0 .. steps − 1`` (Hanna et al. 2024's EAP-IG-inputs,
arXiv:2403.17806, as their code does: the corrupt end included, the clean end not), which follows the metric
along the way from the corrupt prompt to the clean one rather than at the clean end alone; it costs ``steps``
forward and backward passes. ``method="eap-ig-activations"`` integrates along each destination's own input instead:
the gradient by ``input_v`` averaged over ``steps`` runs in which ``v`` alone reads
``input_v + ((k + ½) / steps) · (corrupt_v − input_v)`` (every edge into ``v`` patched by that fraction, the rest
clean), the path a single edge's patch moves along. It is integrated gradients on the activations
(Marks et al. 2024, arXiv:2403.19647; Hanna et al. 2024's EAP-IG-activations) with each destination
interpolated apart from the others, and costs ``steps`` forward and backward passes per destination.

``metric(logits, pairs)`` takes the logits of a batch ``[batch, seq, vocab]`` and the indices of its prompt
pairs ``[batch]`` (a LongTensor: which pairs of the call's lists these rows are) and returns one value per row
``[batch]``; the gradient is that of their sum. A score is per prompt pair, averaged over the pairs (pairs of
different lengths run one batch per length: `nnterp.circuits.pairs`).
`logit_difference(good, bad)` builds the usual one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import InvalidArgument, Unavailable, WrongType
from ..recurrent.no_cache import run_kwargs
from .graph import EdgeGraph
from .nodes import embedding_output, node_map
from .pairs import group_pairs, one_length
from .patching import trace_nodes
from .positional import check_positional

__all__ = ["edge_attribution", "logit_difference"]


def logit_difference(good: Any, bad: Any, position: int = -1) -> Callable:
    """``metric(logits, pairs)``: ``logits[pair, position, good[pair]] − logits[pair, position, bad[pair]]``.

    ``good`` and ``bad``: one token id per prompt pair (a list or a LongTensor ``[pairs]``), or one id for all.
    """
    good, bad = torch.as_tensor(good).reshape(-1), torch.as_tensor(bad).reshape(-1)

    def metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0])
        at = logits[:, position]
        return at[rows, _per_row(good, pairs)] - at[rows, _per_row(bad, pairs)]

    return metric


def _per_row(ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return ids[pairs] if ids.numel() > 1 else ids.expand(len(pairs))


METHODS = ("eap", "eap-ig", "eap-ig-activations")


def _check(model: Any, metric: Any, method: str, steps: int, batch_size: Any) -> None:
    if torch.is_inference_mode_enabled():
        raise Unavailable("edge_attribution", "it takes the metric's gradient, which torch.inference_mode() disables: call it outside that block")
    if not callable(metric):
        raise WrongType(f"edge_attribution takes metric(logits, pairs) -> [batch], got {type(metric).__name__}")
    if method not in METHODS:
        raise InvalidArgument(f"method is one of {METHODS}, got {method!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgument(f"steps is a positive int, got {steps!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidArgument(f"batch_size is a positive int or None, got {batch_size!r}")


def _embeddings(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), model.trace(ids, **run_kwargs(model), **model.family.BACKWARD_KWARGS):
        saved = embedding_output(model).output.save()
    return saved


def _destination_paths(model: Any, graph: Any, ids: torch.Tensor, donor: Any, metric: Callable, pairs: torch.Tensor, steps: int) -> dict:
    """``{destination: [batch, seq, hidden]}``: the metric's gradient by each destination's input, averaged along
    the path of that input alone from clean toward corrupt (midpoints; ``method="eap-ig-activations"``)."""
    gradients = {}
    for v in graph.destinations:
        every = graph.weights([(graph.sources[i], v) for i in graph.inputs(v)])[v]
        runs = [
            trace_nodes(model, graph, ids, patch={v: every * ((k + 0.5) / steps)}, corrupt=donor, metric=metric, pairs=pairs, grad=True)
            for k in range(steps)
        ]
        gradients[v] = sum(run.grads[v] for run in runs) / steps
    return gradients


def edge_attribution(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Callable,
    nodes: Any = ("attention_heads", "mixer_heads", "mlp"),
    positional: bool = False,
    method: str = "eap",
    steps: int = 5,
    batch_size: int | None = None,
    progress: bool = True,
) -> EdgeGraph:
    """Score every edge of ``model``'s graph for the metric's change when that edge alone is patched clean -> corrupt.

    Args:
        model: a `StandardizedTransformer` (see ``nnterp.circuits.support(model)`` for the node kinds it has).
        clean, corrupt: prompt pairs (`nnterp.circuits.pairs`): two lists of prompts or token ids, pair ``i`` of one
            length, pairs of any lengths (each length runs as its own batches; ``positional=True``: one length).
        metric: ``metric(logits, pairs) -> [batch]`` (module docstring; `logit_difference`).
        nodes: the node kinds of the graph (`nnterp.circuits.nodes.NODE_KINDS`); a kind not listed is in no edge.
        positional: split every edge out of a head by source position (`nnterp.circuits.positional`): its edges
            are ``(source, destination, s)``, ``s`` ``None`` for the embeddings and an MLP.
        method: ``"eap"``, ``"eap-ig"`` or ``"eap-ig-activations"`` (not positional); ``steps``: the integrated
            gradients' steps.
        batch_size: prompt pairs per run (``None``: all at once); ``progress``: a tqdm bar over the batches.

    Returns:
        an `EdgeGraph`, ``scores`` ``[edges]`` in ``graph.edges`` order.
    """
    graph = node_map(model, nodes)
    if positional:
        check_positional(model, graph)
        if method == "eap-ig-activations":
            raise InvalidArgument("method='eap-ig-activations' scores whole edges: use 'eap' or 'eap-ig' with positional=True")
    _check(model, metric, method, steps, batch_size)
    groups = group_pairs(model, clean, corrupt)
    seq = one_length(groups, "positional=True") if positional else None
    from tqdm.auto import tqdm

    sources, count = len(graph.sources), sum(len(group.pairs) for group in groups)
    total = torch.zeros(sources, len(graph.destinations))
    by_position: dict = {}  # {(part, destination): [seq, heads]}
    clean_total = corrupt_total = 0.0
    batches = [batch for group in groups for batch in group.batches(batch_size)]
    for pairs, ids, donor_ids in tqdm(batches, desc="edge_attribution", unit="batch", disable=not progress, leave=False):
        donor = trace_nodes(model, graph, donor_ids, metric=metric, pairs=pairs, positional=positional)
        corrupt_total += float(donor.values.sum())
        if method == "eap" and not positional:
            runs = [trace_nodes(model, graph, ids, metric=metric, pairs=pairs, grad=True)]
            base = runs[0]
        else:
            base = trace_nodes(model, graph, ids, metric=metric, pairs=pairs, positional=positional)
            if method == "eap":
                runs = [trace_nodes(model, graph, ids, metric=metric, pairs=pairs, grad=True)]
            elif method == "eap-ig-activations":
                paths = _destination_paths(model, graph, ids, donor, metric, pairs, steps)
            else:
                given = _embeddings(model, donor_ids)
                runs = [trace_nodes(model, graph, ids, metric=metric, pairs=pairs, grad=True, embeddings=(given, k / steps)) for k in range(steps)]
        clean_total += float(base.values.sum())
        for column, v in enumerate(graph.destinations):
            gradient = paths[v] if method == "eap-ig-activations" else sum(run.grads[v] for run in runs) / len(runs)
            difference = donor.at(graph, v) - base.at(graph, v)  # [batch, seq, upstream, hidden], as v reads them
            total[graph.inputs(v), column] += torch.einsum("btnd,btd->n", difference, gradient)
            for part in graph.parts:
                if part.name in base.terms and graph.sources.index(part.sources[0]) in graph.inputs(v):
                    change = donor.terms_at(graph, part.name, v) - base.terms_at(graph, part.name, v)  # [batch, t, s, heads, hidden]
                    grid = torch.einsum("btshd,btd->sh", change, gradient)
                    by_position[part.name, v] = by_position.get((part.name, v), 0) + grid
    index, heads = {name: i for i, name in enumerate(graph.sources)}, graph.heads_of()
    edges = graph.positional_edges(seq) if positional else graph.edges
    scores = []
    for edge in edges:
        u, v = edge[:2]
        if positional and edge[2] is not None:
            part, h = heads[u]
            value = float(by_position[part, v][edge[2], h])
        else:
            value = float(total[index[u], graph.destinations.index(v)])
        scores.append(value * graph.factor(u, v) / count)
    return EdgeGraph(graph, torch.tensor(scores), method=method, clean=clean_total / count, corrupt=corrupt_total / count, seq=seq)
