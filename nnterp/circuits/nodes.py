"""The nodes of a model's computational graph, read from the standardized model: which parts write into the
residual stream, which read it, and where.

Mental model. The model is a stack of residual parts. A *source node* writes into the residual stream:

* ``"embed"``: the residual stream as the first part reads it (the embeddings, with any scale, position
  embedding or pre-norm the family applies before the first part);
* ``"a{l}.h{h}"``: attention head ``h`` of layer ``l``; ``"m{l}.h{h}"``: recurrent mixer head ``h`` (a mixer
  kind without heads, Mamba-1, the RG-LRU, RWKV-4 and the short convolution, is one node ``"m{l}"``); a head's
  output is its share of what its part adds to the residual: the part's output projection applied to that
  head's slice of the projection's input, so the shares of a part's heads (plus the projection's bias, the
  same in every run and no node's) sum to the part's residual addition; where the family normalizes the part's
  output before adding it (a post-norm, gemma3), the shares are scaled by that norm's factor of the same run;
* ``"mlp{l}"``: the feed-forward block (a mixture of experts' experts together).

A *destination* is where a part reads the residual: ``"a{l}"``, ``"m{l}"``, ``"mlp{l}"``, ``"logits"`` (the
final norm). The heads of one part share its input: an edge starts at a head and ends at a part's input. A
destination's input is the residual before the part's input norm (the norm's input), and editing it edits
what that part alone reads; the residual later parts read is unchanged. An *edge* ``u -> v`` is every source
``u`` upstream of destination ``v``. MiniMax's blocks carry the normalized stream (``alpha · norm(x) + beta ·
part(norm(x))``): there a source reaches a later destination scaled by every block norm's ``alpha · norm(x) / x``
between them, factors of the run (`NodeMap.carries`, `NodeMap.carried`). falcon_h1 runs its mixer and its
attention in parallel on one norm's output: they share one destination, ``"m{l}"``, and each head's share is
scaled by its part's output multiplier (`Part.beta`).

zamba2's hybrid blocks run a shared transformer block beside the residual stream: its attention reads
``norm([x, e])``, the residual ``x`` concatenated with the embeddings ``e``, its MLP reads the attention's output,
and a linear map of the MLP's output is added to the block's Mamba-2 input, ``norm(x + linear(mlp))``, never to
the stream. So the sources reaching a destination are no prefix of the sources (`NodeMap.reach`): ``"a{l}"`` (the
concatenation, ``[2 · hidden]``) is reached by the stream's sources, the embeddings' edge moving both halves and a
mixer head's the first (`NodeMap.concatenated`); ``"mlp{l}"`` by that attention's heads alone; the Mamba-2 block's
``"m{l}"`` by the stream's sources and ``"mlp{l}"`` (whose output is ``linear(mlp)``, `Part.writer`); later
destinations by the stream's sources alone.

`NodeMap` is the map for one model; `node_map(model)` builds it or raises `Unavailable` where a part reads the
residual through no norm nnterp knows; `support(model)` says per node kind which the model has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import InvalidArgument, Unavailable
from .positional import positional_reason

__all__ = ["Part", "NodeMap", "node_map", "embedding_output", "support", "NODE_KINDS"]

#: The node kinds ``nodes=`` takes: a part split into heads, or one node per part.
NODE_KINDS = ("attention_heads", "attention", "mixer_heads", "mixers", "mlp")
#: The HF child of a block that normalizes the residual before its mixer or attention reads it, by family.
MIXER_NORMS = ("input_layernorm", "temporal_pre_norm", "operator_norm", "norm_mlstm", "ln1", "ln_1", "norm")
#: ... before its feed-forward block reads it (gemma3's ``post_attention_layernorm`` is a post-norm: checked first).
MLP_NORMS = ("pre_feedforward_layernorm", "pre_ff_layernorm", "post_attention_layernorm", "channel_pre_norm", "ffn_norm", "norm_ffn", "ln2", "ln_2")
#: The output projection of an attention layer or mixer, whose input is split into heads.
PROJECTIONS = ("o_proj", "out_proj", "output", "linear_out", "c_proj")
#: The block attribute scaling a part's output before it is added (falcon_h1's μP multipliers).
OUT_MULTIPLIERS = {"attention": "attn_out_multiplier", "mixer": "ssm_out_multiplier"}
#: Post-norms (the part's output normalized before it is added): ``{mixer post-norm, mlp post-norm}``.
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
#: zamba2's hybrid block: the child running the shared transformer block, each part's input norm (a path from the
#: block) and the child whose output is what the shared MLP adds to the Mamba-2 block's input.
SHARED_BLOCK = "shared_transformer"
SHARED_NORMS = {"attention": "shared_transformer.input_layernorm", "mlp": "shared_transformer.pre_ff_layernorm", "mixer": "mamba_decoder.input_layernorm"}
SHARED_WRITER = "linear"
#: A norm the first block applies to the embeddings before its parts read them (RWKV-4's ``pre_ln``).
EMBEDDING_NORMS = ("pre_ln",)


@dataclass(frozen=True)
class Part:
    """One residual part: a destination (its input) and the source nodes it writes.

    Attributes:
        layer: its layer index.
        kind: ``"attention"``, ``"mixer"`` or ``"mlp"``.
        name: its destination name (``"a3"``, ``"m3"``, ``"mlp3"``).
        norm: the HF child of the block (a path, `child_at`) whose input is the part's input (its input norm); ``None`` where the part
            reads the residual itself (a post-norm family, olmo3: the part's own input).
        projection: the output projection (a child of the part) whose input splits into heads; ``None`` on an MLP.
        heads: how many source nodes the part is (1: the part is one node).
        post_norm: the HF child of the block normalizing the part's output before it is added, or ``None``.
        sources: the source node names it writes, in head order.
        beta: the factor the block multiplies the part's output by before adding it (MiniMax's ``*_beta_factor``).
        writer: the child of the block (a path, `child_at`) whose output is what the part adds, where it is not the
            part's own output (zamba2's shared MLP: ``linear``), or ``None``.
    """

    layer: int
    kind: str
    name: str
    norm: str | None
    projection: str | None
    heads: int
    post_norm: str | None
    sources: tuple = ()
    beta: float = 1.0
    writer: str | None = None


@dataclass
class NodeMap:
    """The graph's nodes for one model and node selection.

    Attributes:
        parts: the parts in forward order (`Part`).
        sources: every source node name, ``"embed"`` first, in forward order.
        destinations: every destination name, in forward order, ``"logits"`` last.
        upstream: ``{destination: number of sources upstream of it}``: where ``reach`` has no entry, the sources
            upstream of a destination are a prefix of ``sources``.
        reach: ``{destination: [source index, ...]}``, the sources reaching it where they are no prefix (zamba2's
            shared blocks, module docstring; `inputs`); ``concatenated``: the destinations that read ``[residual,
            embeddings]`` (``[2 · hidden]``: the embeddings reach both halves, every other source the first).
        scale: the factor the family multiplies each part's output by before adding it (1.0 on most).
        layers: ``{source or destination: its layer}`` (``embed``: 0; ``logits``: the number of layers).
        halve_every: RWKV-4 in eval halves the residual after every ``halve_every``-th block (0: never), so a
            source reaches a later destination scaled by ``2 ** -(halvings between)`` (`factor`).
        carries: MiniMax's blocks carry the normalized stream (``alpha · norm(x) + beta · part(norm(x))``): each
            input norm scales the whole stream by ``alpha · norm(x) / x``, elementwise, a factor of the run.
            ``{source: how many such norms come before it writes}`` (empty elsewhere); ``reads``, ``{destination:
            how many come before it reads}``: a source ``u`` reaches ``v`` scaled by the product of the factors
            of norms ``carries[u] .. reads[v] − 1`` (`carried`).
    """

    parts: list
    sources: list
    destinations: list
    upstream: dict
    scale: float = 1.0
    #: Layer 0's first part (kind, norm): where the embeddings are read, as that part reads the residual.
    embed_at: tuple = field(default=("", None))
    layers: dict = field(default_factory=dict)
    halve_every: int = 0
    carries: dict = field(default_factory=dict)
    #: ``[(layer, norm, alpha)]``: the norms the carried stream passes, in forward order (empty but on MiniMax).
    carry_norms: list = field(default_factory=list)
    reads: dict = field(default_factory=dict)
    reach: dict = field(default_factory=dict)
    concatenated: set = field(default_factory=set)

    def inputs(self, destination: str) -> list:
        """The indices (in ``sources``) of the sources reaching ``destination``, in forward order."""
        return self.reach[destination] if destination in self.reach else list(range(self.upstream[destination]))

    def carried(self, outputs: torch.Tensor, factors: torch.Tensor | None, destination: str) -> torch.Tensor:
        """``[batch, seq, upstream, hidden]``: what each source upstream of ``destination`` adds to its input, from
        ``outputs`` ``[batch, seq, sources, hidden]`` and the run's norm factors ``[batch, seq, norms, hidden]``
        (``[..., 2 · hidden]`` where the destination reads ``[residual, embeddings]``)."""
        count = self.upstream[destination]
        stop = self.reads.get(destination, 0)
        if destination in self.reach:
            index = self.inputs(destination)
            picked = outputs[:, :, index]
            if destination not in self.concatenated:
                return picked
            # The embeddings (source 0) are both halves' own: the original embeddings are the second half.
            embeddings = torch.tensor([float(i == 0) for i in index], device=outputs.device)[:, None]
            return torch.cat([picked, picked * embeddings], -1)
        if not stop:  # no norm before it: every source reaches it as written
            return outputs[:, :, :count]
        chosen = factors[:, :, :stop].to(outputs.device)
        # after[k]: the product of factors k .. stop − 1 (the norms between a source written after k of them and v).
        after = torch.cat([chosen.flip(2).cumprod(2).flip(2), torch.ones_like(outputs[:, :, :1])], 2)
        index = torch.tensor([self.carries[u] for u in self.sources[:count]], device=outputs.device)
        return outputs[:, :, :count] * after[:, :, index]

    def widen(self, terms: torch.Tensor, destination: str) -> torch.Tensor:
        """A head's terms ``[..., hidden]`` as ``destination`` reads them: zeros appended where it reads ``[residual,
        embeddings]`` (a head writes the residual half alone)."""
        return torch.cat([terms, torch.zeros_like(terms)], -1) if destination in self.concatenated else terms

    def carry(self, factors: torch.Tensor | None, part: str, destination: str) -> torch.Tensor | float:
        """``[batch, seq, 1, 1, hidden]``: how a head of ``part`` reaches ``destination`` (1.0 but on MiniMax)."""
        if not self.reads.get(destination, 0):
            return 1.0
        start = self.carries[next(p.sources[0] for p in self.parts if p.name == part)]
        return factors[:, :, start : self.reads[destination]].prod(2)[:, :, None, None]

    def heads_of(self) -> dict:
        """``{source: (part name, head index)}`` for every head of an attention layer or mixer (the sources a
        positional edge splits)."""
        return {u: (part.name, h) for part in self.parts if part.kind != "mlp" for h, u in enumerate(part.sources)}

    def positional_edges(self, seq: int) -> list:
        """Every edge split by source position: ``(source, destination, s)`` for a head (``s`` in ``0 .. seq − 1``),
        ``(source, destination, None)`` for the embeddings and an MLP; destinations in forward order."""
        heads = self.heads_of()
        return [(u, v, s) for u, v in self.edges for s in (range(seq) if u in heads else [None])]

    def positional_weights(self, edges: Any, seq: int) -> tuple:
        """``(whole, terms)``: `weights` of the edges with no position, and ``{destination: {part: [seq, heads]}}``
        for the positional ones, each its `factor`."""
        heads, whole, terms = self.heads_of(), [], {}
        for edge in edges:
            u, v, s = edge
            if s is None:
                whole.append((u, v))
                continue
            if u not in heads or not 0 <= s < seq:
                raise InvalidArgument(f"{edge!r} is not a positional edge: a head of this graph and a source position in 0..{seq - 1}")
            self.edge_mask([(u, v)])
            part, h = heads[u]
            count = next(p.heads for p in self.parts if p.name == part)
            grid = terms.setdefault(v, {}).setdefault(part, torch.zeros(seq, count))
            grid[s, h] = self.factor(u, v)
        return self.weights(whole), terms

    def factor(self, source: str, destination: str) -> float:
        """How much of ``source``'s output reaches ``destination``'s input (1.0 but where the stream is halved)."""
        if not self.halve_every:
            return 1.0
        start, stop = self.layers[source], self.layers[destination]
        return 0.5 ** sum(1 for index in range(start, stop) if (index + 1) % self.halve_every == 0)

    def weights(self, edges: Any) -> dict:
        """``{destination: [upstream sources] float tensor}``: each edge of ``edges`` its `factor`, 0 elsewhere."""
        mask = self.edge_mask(edges)
        return {
            v: torch.tensor([self.factor(self.sources[i], v) if mask[v][i] else 0.0 for i in self.inputs(v)])
            for v in self.destinations if any(mask[v])
        }

    @property
    def edges(self) -> list:
        """Every edge ``(source, destination)``, destinations in forward order."""
        return [(self.sources[i], v) for v in self.destinations for i in self.inputs(v)]

    def edge_mask(self, edges: Any) -> dict:
        """``{destination: [bool per source]}``, true where ``(source, destination)`` is in ``edges``; unknown ones raise."""
        index = {name: i for i, name in enumerate(self.sources)}
        mask = {v: [False] * len(self.sources) for v in self.destinations}
        for edge in edges:
            u, v = edge
            if v not in mask or u not in index or index[u] not in self.inputs(v):
                raise InvalidArgument(
                    f"({u!r}, {v!r}) is not an edge of this graph: a source of {self.sources[:3]}... upstream of a "
                    f"destination of {self.destinations}"
                )
            mask[v][index[u]] = True
        return mask


def child_at(envoy: Any, path: str) -> Any:
    """The envoy at ``path`` (dotted child names, ``""``: ``envoy`` itself) below ``envoy``."""
    for name in filter(None, path.split(".")):
        envoy = envoy._child_map[name]
    return envoy


def _child(envoy: Any, names: tuple) -> str | None:
    children = dict(envoy._module.named_children())
    return next((name for name in names if name in children), None)


def embedding_output(model: Any) -> Any:
    """The envoy whose output is the ``"embed"`` source, the residual stream as it starts: layer 0's embedding
    norm where the family has one (`EMBEDDING_NORMS`), else the embeddings."""
    norm = _child(model.layers[0], EMBEDDING_NORMS)
    return child_at(model.layers[0], norm) if norm is not None else model.embed_tokens


def _heads(kind: str, envoy: Any, split: bool) -> int:
    if not split:
        return 1
    if kind == "attention":
        return int(envoy._module.config.num_attention_heads)
    return int(envoy.dims().get("mixer_heads", 1))


def node_map(model: Any, nodes: Any = ("attention_heads", "mixer_heads", "mlp")) -> NodeMap:
    """The `NodeMap` of ``model`` for the node kinds ``nodes`` (of `NODE_KINDS`; a kind not listed is in no edge).

    Raises `Unavailable` where a part reads the residual through no norm nnterp knows.
    """
    nodes = (nodes,) if isinstance(nodes, str) else tuple(nodes)
    unknown = [kind for kind in nodes if kind not in NODE_KINDS]
    if unknown:
        raise InvalidArgument(f"nodes={unknown} are not node kinds; the kinds are {NODE_KINDS}")
    parts: list = []
    sources, destinations, upstream = ["embed"], [], {}
    layers = {"embed": 0, "logits": len(model.layers)}
    embed_at = None
    carries: dict = {}
    reads: dict = {}
    carry_norms: list = []  # (layer, norm, alpha) of each norm that scales the carried stream, in forward order
    # zamba2: every destination lists its sources (`NodeMap.reach`): those of the stream, and the shared block's chain.
    sided = any(_child(layer, (SHARED_BLOCK,)) for layer in model.layers)
    reach: dict = {}
    concatenated: set = set()
    stream: list = [0]  # the indices of the sources written into the residual stream so far
    for index, layer in enumerate(model.layers):
        carry = hasattr(layer._module, "mlp_alpha_factor")  # MiniMax's block: alpha · norm(x) + beta · part(norm(x))
        children = dict(layer._module.named_children())
        post = all(name in children for name in POST_NORMS)
        alone = layer.self_attn is None and layer.linear_attn is None
        shared = SHARED_BLOCK in children
        side: list = []  # the shared block's chain: the sources the next part of it reads
        owner: dict = {}  # {norm: the destination of this layer that reads it}: falcon_h1's parallel parts share one
        # Forward order: falcon_h1 runs its mixer, then its attention, on one norm's output; zamba2's hybrid block
        # its shared attention, MLP, then its Mamba-2 block.
        order = ("attention", "mlp", "mixer") if shared else ("mixer", "attention", "mlp")
        envoys = {"mixer": layer.linear_attn, "attention": layer.self_attn, "mlp": layer.mlp}
        for kind, envoy in ((kind, envoys[kind]) for kind in order):
            if envoy is None:
                continue
            names_ = (MLP_NORMS[:2] + MLP_NORMS[3:] if post else MLP_NORMS) + (MIXER_NORMS if alone else ()) if kind == "mlp" else MIXER_NORMS
            norm = SHARED_NORMS[kind] if shared else _child(layer, names_)
            if norm is None and not post:
                raise Unavailable("circuits", f"layer {index}'s {kind} reads the residual through no input norm nnterp knows")
            # The embeddings as the first part reads the stream (zamba2's shared block: the block's own input).
            embed_at = embed_at or (("block", "") if shared else (kind, norm))
            reads_from = {"attention": stream, "mlp": side, "mixer": stream + side}[kind] if shared else stream
            side = []
            prefix = "mlp" if kind == "mlp" else "attn"
            if carry:
                reads[{"attention": f"a{index}", "mixer": f"m{index}", "mlp": f"mlp{index}"}[kind]] = len(carry_norms)
                carry_norms.append((index, norm, float(getattr(layer._module, f"{prefix}_alpha_factor"))))
            wanted = {"attention": ("attention_heads", "attention"), "mixer": ("mixer_heads", "mixers"), "mlp": ("mlp",)}[kind]
            if not any(kind_ in nodes for kind_ in wanted):
                continue
            projection = None if kind == "mlp" else _child(envoy, PROJECTIONS)
            if kind != "mlp" and projection is None:
                raise Unavailable("circuits", f"layer {index}'s {kind} has no output projection nnterp knows ({PROJECTIONS})")
            heads = _heads(kind, envoy, wanted[0] in nodes) if kind != "mlp" else 1
            name = {"attention": f"a{index}", "mixer": f"m{index}", "mlp": f"mlp{index}"}[kind]
            names = tuple(f"{name}.h{h}" for h in range(heads)) if heads > 1 else (name,)
            post_norm = (POST_NORMS[1] if kind == "mlp" else POST_NORMS[0]) if post else None
            layers.update(dict.fromkeys((name, *names), index))
            if norm is None or norm not in owner:
                owner[norm] = name
                upstream[name] = len(sources)
                destinations.append(name)
                if sided:
                    reach[name] = list(reads_from)
                    if shared and kind == "attention":
                        concatenated.add(name)
            written = list(range(len(sources), len(sources) + len(names)))
            if shared and kind != "mixer":
                side = written
            else:
                stream.extend(written)
            sources.extend(names)
            # MiniMax's beta factors; falcon_h1's output multipliers.
            beta = getattr(layer._module, f"{prefix}_beta_factor", None)
            beta = float(getattr(layer._module, OUT_MULTIPLIERS.get(kind, ""), 1.0) if beta is None else beta)
            if carry:
                carries.update(dict.fromkeys(names, len(carry_norms)))
            writer = SHARED_WRITER if shared and kind == "mlp" else None
            parts.append(Part(index, kind, name, norm, projection, len(names), post_norm, names, beta, writer))
    if carry_norms:
        carries["embed"], reads["logits"] = 0, len(carry_norms)
    destinations.append("logits")
    upstream["logits"] = len(sources)
    if sided:
        reach["logits"] = stream
    scale = float(getattr(model.config, "residual_multiplier", 1.0) or 1.0)
    # RWKV-4 in eval halves the residual after every `rescale_every`-th block (its weights are rescaled to match).
    halve = int(getattr(model.config, "rescale_every", 0) or 0) if model.family.NAME == "rwkv" and not model._model.training else 0
    return NodeMap(parts, sources, destinations, upstream, scale, embed_at, layers, halve, carries, carry_norms, reads, reach, concatenated)


def support(model: Any) -> dict:
    """``{"circuits.<kind>": None | reason}``: which node kinds ``model`` has, and why one is unavailable;
    ``"circuits.positional"``: whether every head's edges split by source position (`nnterp.circuits.positional`)."""
    has = {
        "attention_heads": any(layer.self_attn is not None for layer in model.layers),
        "mixer_heads": any(layer.linear_attn is not None and "mixer_heads" in layer.linear_attn.dims() for layer in model.layers),
        "mixers": any(layer.linear_attn is not None for layer in model.layers),
        "mlp": any(layer.mlp is not None for layer in model.layers),
    }
    missing = {
        "attention_heads": "this model has no attention layer",
        "mixer_heads": "this model's recurrent mixers have no heads (each is one node, 'm{l}': nodes=('mixers',))",
        "mixers": "this model has no recurrent mixer",
        "mlp": "this model has no feed-forward block",
    }
    rows = {"circuits.embed": None, "circuits.logits": None}
    for kind, present in has.items():
        rows[f"circuits.{kind}"] = None if present else missing[kind]
    rows["circuits.positional"] = _positional_row(model)
    return rows


def _positional_row(model: Any) -> str | None:
    """Why some part's edges cannot be split by source position (the first such part), or ``None``."""
    for part in node_map(model).parts:
        block = model.layers[part.layer]
        envoy = {"attention": block.self_attn, "mixer": block.linear_attn, "mlp": block.mlp}[part.kind]
        why = positional_reason(part, envoy)
        if why is not None:
            return f"layer {part.layer}'s {part.kind}: {why}"
    return None
