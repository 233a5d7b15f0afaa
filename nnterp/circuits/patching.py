"""Edge patching through one nnsight trace: every node's output read, chosen destinations' inputs edited.

Mental model. `trace_nodes` runs the model once over a batch and, in forward order, reads every source node's
output (`nnterp.circuits.nodes`) and edits destinations' inputs. Patching a set of edges ``P`` sets each
destination ``v``'s input to

    input_v + Σ_{u: (u, v) ∈ P} (u_corrupt − u_now)

where ``input_v`` and ``u_now`` are of this run (the residual ``v`` would read, ``u``'s output as this run
computed it) and ``u_corrupt`` is ``u``'s output in the corrupt run (or its mean over the corrupt batch).
One edge patched: nothing upstream of ``v`` changed, so ``u_now`` is ``u``'s clean output, and ``v``'s
input is the clean input plus ``u``'s corrupt − clean difference. Every edge patched: every destination
reads the corrupt residual (the sum of the corrupt outputs, plus the biases every run shares), which is the
corrupt forward. Only the part ``v`` reads the edited value: the residual the later parts read is unchanged.
On MiniMax, whose block norm's output is also the stream carried on, ``u_corrupt`` and ``u_now`` are what ``u``
adds to ``v``'s input in each run (`NodeMap.carried`, the norm factors of that run), and the part alone reads
the norm of the edited input.

Outputs are ``[batch, seq, sources, hidden]`` in the node map's source order, float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import InvalidArgument, ShapeError
from ..recurrent.no_cache import run_kwargs
from .nodes import NodeMap, child_at, embedding_output, node_map
from .pairs import group_pairs, one_length
from .positional import check_positional, head_terms, read_core

__all__ = ["patch_edges", "trace_nodes", "NodeRun"]


class NodeRun:
    """What one `trace_nodes` run read.

    Attributes:
        outputs: ``[batch, seq, sources, hidden]``, every source node's output (float32, detached).
        logits: ``[batch, seq, vocab]``, float32, detached.
        values: ``[batch]``, the metric of each row (``None`` without a metric).
        grads: ``{destination: [batch, seq, hidden]}``, the metric's gradient by the destination's input (with ``grad=True``).
        terms: ``{part: [batch, seq, seq, heads, hidden]}``, each head's term of target ``t``, source ``s``
            (with ``positional=True``; `nnterp.circuits.positional`).
        factors: ``[batch, seq, norms, hidden]``, the factor of each norm the carried stream passes (MiniMax:
            `NodeMap.carries`), or ``None``.
        mean: the run stands for its mean over the batch (a mean ablation's donor).
    """

    def __init__(
        self, outputs: torch.Tensor, logits: Any, values: Any, grads: dict, terms: dict | None = None, factors: Any = None, mean: bool = False
    ) -> None:
        self.outputs, self.logits, self.values, self.grads = outputs, logits, values, grads
        self.terms, self.factors, self.mean = terms or {}, factors, mean

    def at(self, nodes: NodeMap, destination: str) -> torch.Tensor:
        """``[batch or 1, seq, upstream, hidden]``: what each source adds to ``destination``'s input in this run
        (`NodeMap.carried`); its mean over the batch where the run stands for a mean ablation."""
        carried = nodes.carried(self.outputs, self.factors, destination)
        return carried.mean(0, keepdim=True) if self.mean else carried

    def terms_at(self, nodes: NodeMap, part: str, destination: str) -> torch.Tensor:
        """``[batch or 1, seq, seq, heads, hidden]``: ``part``'s per-source terms as they reach ``destination``."""
        carried = nodes.widen(self.terms[part] * nodes.carry(self.factors, part, destination), destination)
        return carried.mean(0, keepdim=True) if self.mean else carried

    def averaged(self) -> NodeRun:
        """This run standing for its mean over the batch (``ablation="mean"``)."""
        return NodeRun(self.outputs, None, None, {}, self.terms, self.factors, mean=True)


def _head_shares(projection: Any, value: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, seq, heads, hidden]``: the projection applied to each head's slice of its input (no bias)."""
    # transformers' Conv1D (gpt2) keeps its weight as [in, out].
    weight = projection.weight.T if type(projection).__name__ == "Conv1D" else projection.weight
    batch, seq, width = value.shape
    if width % heads:
        raise ShapeError(f"an output projection's input of width {width} does not split into {heads} heads")
    split = value.reshape(batch, seq, heads, width // heads).to(weight.dtype)
    return torch.einsum("bthd,ohd->btho", split, weight.reshape(weight.shape[0], heads, width // heads))


_PARTS = {"attention": lambda block: block.self_attn, "mixer": lambda block: block.linear_attn, "mlp": lambda block: block.mlp}


def _reader(block: Any, kind: str, norm: str | None) -> Any:
    """The envoy whose input is what a part of ``kind`` reads: its input norm (a path from the block), or the part itself."""
    return child_at(block, norm) if norm is not None else _PARTS[kind](block)


def _norm_factor(norm: Any, alpha: float) -> torch.Tensor:
    """``[batch, seq, 1, hidden]``: ``alpha · norm(x) / x`` of this run, elementwise, so the stream's terms scaled
    by it sum to ``alpha · norm(x)``, the stream the block carries on."""
    before = norm.input
    safe = torch.where(before == 0, torch.ones_like(before), before)
    factor = torch.where(before == 0, torch.zeros_like(before), norm.output / safe)
    return (alpha * factor).detach().float().unsqueeze(2)


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """MiniMax's RMSNorm of ``x`` (``weight · x / rms(x)``, in float32), applied outside the module so that the
    module's own output, the carried stream, stays as the run computed it."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _unwrap(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


def trace_nodes(
    model: Any,
    nodes: NodeMap,
    ids: torch.Tensor,
    *,
    patch: dict | None = None,
    corrupt: torch.Tensor | None = None,
    metric: Callable | None = None,
    pairs: torch.Tensor | None = None,
    grad: bool = False,
    embeddings: tuple | None = None,
    positional: bool = False,
    patch_terms: dict | None = None,
) -> NodeRun:
    """One run of ``ids`` reading every node's output, with ``patch`` (``{destination: weight per upstream
    source}``, `NodeMap.weights`) patched to ``corrupt`` (``[batch or 1, seq, sources, hidden]``).

    ``grad=True``: the metric's gradient by every destination's input (``metric`` required). ``embeddings``:
    ``(corrupt_embeddings, alpha)``, the ``"embed"`` source as written (`embedding_output`) replaced by
    ``corrupt + alpha · (own − corrupt)``.
    ``positional=True``: every head's per-source terms read too (`nnterp.circuits.positional`), in ``terms``;
    ``patch_terms`` (``{destination: {part: weight [seq, heads]}}``) patches positional edges, with ``corrupt``
    then a `NodeRun` with terms.
    """
    masks, positional_masks = patch or {}, patch_terms or {}
    if isinstance(corrupt, torch.Tensor):
        if nodes.reads:
            raise InvalidArgument("trace_nodes: on a model that carries the normalized stream (MiniMax), pass the corrupt NodeRun (its norm factors), not its outputs")
        corrupt = NodeRun(corrupt, None, None, {})
    if (masks or positional_masks) and corrupt is None:
        raise InvalidArgument("trace_nodes: a patch needs the corrupt outputs")
    run = dict(run_kwargs(model), **(model.family.BACKWARD_KWARGS if grad else {}))
    found: list = []
    terms: dict = {}
    leaves: dict = {}
    saved: dict = {}
    factors: list = []  # [batch, seq, 1, hidden] per carry norm read (`NodeMap.carries`)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context, model.trace(ids, **run):
        if embeddings is not None:
            given, alpha = embeddings
            start = embedding_output(model)
            own = start.output
            start.output = given.to(own.dtype) + alpha * (own - given.to(own.dtype))

        # The embeddings as the first part reads them: its norm's (or its own) input, before any edit.
        found.append(_reader(model.layers[0], *nodes.embed_at).input.detach().float().unsqueeze(2))

        def carried_norms(stop: int) -> Any:
            # The carry norms up to ``stop`` no selected part reads (their parts are in no edge), each read once.
            while len(factors) < stop:
                layer, norm, alpha = nodes.carry_norms[len(factors)]
                factors.append(_norm_factor(model.layers[layer]._child_map[norm], alpha))
            return torch.cat(factors, 2) if factors else None

        def read(v: str, envoy: Any, carried: Any = None) -> None:
            now_factors = carried_norms(nodes.reads[v]) if nodes.reads else None
            x = envoy.input
            edited = x
            if v in masks:
                now = nodes.carried(torch.cat(found, 2), now_factors, v)
                weight = masks[v].to(x.device)
                edited = edited + torch.einsum("btnd,n->btd", corrupt.at(nodes, v).to(x.device) - now, weight).to(x.dtype)
            for name, weight in positional_masks.get(v, {}).items():
                difference = corrupt.terms_at(nodes, name, v).to(x.device) - nodes.widen(terms[name] * nodes.carry(now_factors, name, v), v)
                edited = edited + torch.einsum("btshd,sh->btd", difference, weight.to(x.device)).to(x.dtype)
            if grad:
                leaf = torch.zeros_like(x, requires_grad=True)
                leaves[v] = leaf
                edited = edited + leaf
            if carried is not None:
                # The norm's output is the stream carried on: the part alone reads the norm of the edited input.
                norm, alpha = envoy, carried
                factors.append(_norm_factor(norm, alpha))
                if edited is not x:
                    target.input = _rms(norm._module, edited).to(x.dtype)
            elif edited is not x:
                envoy.input = edited

        for part in nodes.parts:
            block = model.layers[part.layer]
            target = _PARTS[part.kind](block)
            alpha = nodes.carry_norms[nodes.reads[part.name]][2] if nodes.reads else None
            if part.name in nodes.upstream:  # falcon_h1's attention reads its mixer's destination
                read(part.name, _reader(block, part.kind, part.norm), alpha)
            envoy = _PARTS[part.kind](block)
            if part.kind == "mlp":
                out = _unwrap((envoy if part.writer is None else child_at(block, part.writer)).output).unsqueeze(2)
                if part.post_norm is not None:
                    out = block._child_map[part.post_norm].output.unsqueeze(2)
            else:
                core = read_core(envoy, part.kind) if positional else None
                projection = envoy._child_map[part.projection]
                projected = projection.input
                out = _head_shares(projection._module, projected, part.heads)
                if core is not None:
                    weight = projection._module.weight
                    terms[part.name] = head_terms(*core, projected, weight, part.heads) * (nodes.scale * part.beta)
                if part.post_norm is not None:
                    post = block._child_map[part.post_norm]
                    before, after = post.input, post.output
                    # The norm's factor of this run, per element: the shares scale by it and still sum to its output.
                    safe = torch.where(before == 0, torch.ones_like(before), before)
                    factor = torch.where(before == 0, torch.zeros_like(before), after / safe).float()
                    out = out * factor.unsqueeze(2)
                    if core is not None:
                        terms[part.name] = terms[part.name] * factor[:, :, None, None]
            found.append((out * (nodes.scale * part.beta)).detach().float())
        read("logits", model.ln_final)
        logits = model.logits
        saved["logits"] = logits.detach().float().save()
        if metric is not None:
            values = metric(logits, pairs)
            if not isinstance(values, torch.Tensor) or values.shape != (ids.shape[0],):
                got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
                raise ShapeError(f"metric(logits, pairs) must return one value per prompt, [{ids.shape[0]}], got {got}")
            saved["values"] = values.detach().float().save()
            if grad:
                values.sum().backward(inputs=list(leaves.values()))
        saved["outputs"] = torch.cat(found, 2).save()
        saved["terms"] = {name: value.detach() for name, value in terms.items()}
        saved["factors"] = torch.cat(factors, 2).detach().save() if factors else None
    grads = {v: leaf.grad.float() for v, leaf in leaves.items()} if grad else {}
    return NodeRun(saved["outputs"], saved["logits"], saved.get("values"), grads, saved["terms"], saved["factors"])


def patch_edges(
    model: Any,
    clean: Any,
    corrupt: Any,
    edges: Any,
    nodes: Any = ("attention_heads", "mixer_heads", "mlp"),
    ablation: str = "corrupt",
) -> Any:
    """The clean prompts' logits ``[n, seq, vocab]`` (float32) with ``edges`` (``[(source, destination), ...]``;
    ``(source, destination, s)`` for a head's positional edge, `nnterp.circuits.positional`) patched to their
    corrupt value (``ablation="corrupt"``: each pair's corrupt prompt; ``"mean"``: the mean over the corrupt
    prompts of the clean prompt's length, per position).

    ``clean`` and ``corrupt``: prompt pairs as `nnterp.circuits.pairs` takes them; the two prompts of a pair have
    one length, and pairs of different lengths run as one batch per length, so the logits are then a list, one
    ``[seq_i, vocab]`` per clean prompt, in order. Positional edges take prompts of one length.
    """
    graph = nodes if isinstance(nodes, NodeMap) else node_map(model, nodes)
    groups = group_pairs(model, clean, corrupt, ablation)
    edges = [tuple(edge) for edge in edges]
    positional = any(len(edge) == 3 for edge in edges)
    if positional:
        check_positional(model, graph)
        seq = one_length(groups, "a positional edge (source, destination, s)")
        whole, terms = graph.positional_weights([edge if len(edge) == 3 else (*edge, None) for edge in edges], seq)
    else:
        whole, terms = graph.weights(edges), {}
    rows: list = [None] * sum(len(group.pairs) for group in groups)
    for group in groups:
        donor = trace_nodes(model, graph, group.corrupt, positional=positional)
        if ablation == "mean":
            donor = donor.averaged()
        logits = trace_nodes(model, graph, group.clean, patch=whole, patch_terms=terms, corrupt=donor, positional=positional).logits
        for i, row in zip(group.pairs.tolist(), logits):
            rows[i] = row
    return torch.stack(rows) if len(groups) == 1 else rows
