"""An oracle for `nnterp.circuits` written with nothing but torch hooks on a plain transformers model.

It knows nothing of nnsight or nnterp: it rebuilds the definitions of docs' circuits page from a llama-like
decoder (``model.model.embed_tokens``, ``layers[l].input_layernorm`` / ``self_attn.o_proj`` /
``post_attention_layernorm`` / ``mlp``, ``model.model.norm``):

* a source's output is what it writes into the residual stream: the embeddings' output; head ``h``'s share of
  the attention output, ``o_proj`` applied to its slice of ``o_proj``'s input (its columns of the weight; a bias
  belongs to no head); the MLP's output;
* a destination's input is the residual where the part reads it, before its input norm: editing it there (a
  forward pre-hook on the norm) changes what that part reads and nothing else, since the decoder layer keeps its
  own reference to the residual for the skip connection;
* patching a set of edges: each destination ``v`` reads its input minus, for every patched edge ``u -> v``, ``u``'s
  output in this run minus its output in the corrupt run. The residual carries what each part output in *this*
  run (a part that read a patched input wrote a changed output), so a patch is relative to the run, not to the
  clean one; for a single edge the two are the same, since ``u`` is upstream of the only part that changed.
  Every edge patched is the corrupt forward; none, the clean one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class PlainEdges:
    """Sources, destinations and single-edge patches of a plain llama-like ``transformers`` causal LM."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.model = hf_model
        self.decoder = hf_model.model
        self.layers = list(self.decoder.layers)
        attention = self.layers[0].self_attn
        self.heads = hf_model.config.num_attention_heads
        self.head_dim = attention.head_dim

    def sources(self) -> list[str]:
        names = ["embed"]
        for index in range(len(self.layers)):
            names += [f"a{index}.h{h}" for h in range(self.heads)] + [f"mlp{index}"]
        return names

    def destinations(self) -> list[str]:
        names = []
        for index in range(len(self.layers)):
            names += [f"a{index}", f"mlp{index}"]
        return names + ["logits"]

    @staticmethod
    def upstream(source: str, destination: str) -> bool:
        """Whether ``source`` writes into the residual before ``destination`` reads it."""
        def order(name: str, reading: bool) -> float:
            if name == "embed":
                return -1.0
            if name == "logits":
                return float("inf")
            layer = int(name.split(".")[0].lstrip("amlp"))
            part = 0.0 if name.startswith("a") else 0.5
            return layer + part + (0.0 if reading else 0.25)
        return order(source, False) < order(destination, True)

    def outputs(self, ids: torch.Tensor, patched: Mapping[str, set] | None = None,
                corrupt: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The logits and every source's output, ``[batch, seq, hidden]``, of a forward on ``ids``, with the edges
        ``patched[destination] = {source, ...}`` patched to the ``corrupt`` sources' outputs (module docstring)."""
        found: dict[str, torch.Tensor] = {}
        handles = [self.decoder.embed_tokens.register_forward_hook(lambda m, a, out: found.__setitem__("embed", out))]
        for index, layer in enumerate(self.layers):
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(self._split_heads(index, found)))
            handles.append(layer.mlp.register_forward_hook(lambda m, a, out, i=index: found.__setitem__(f"mlp{i}", out)))
        norms = {"logits": self.decoder.norm}
        for index, layer in enumerate(self.layers):
            norms[f"a{index}"] = layer.input_layernorm
            norms[f"mlp{index}"] = layer.post_attention_layernorm

        def patch(name: str) -> Callable:
            def hook(module: torch.nn.Module, args: tuple) -> tuple:
                moved = sum(found[u] - corrupt[u] for u in patched[name])
                return (args[0] - moved, *args[1:])
            return hook

        handles += [norms[name].register_forward_pre_hook(patch(name)) for name in (patched or {}) if patched[name]]
        try:
            logits = self.model(ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        return logits, found

    def _split_heads(self, index: int, found: dict) -> Callable:
        weight = self.layers[index].self_attn.o_proj.weight

        def hook(module: torch.nn.Module, args: tuple) -> None:
            heads = args[0].unflatten(-1, (self.heads, self.head_dim))
            for h in range(self.heads):
                columns = weight[:, h * self.head_dim:(h + 1) * self.head_dim]
                found[f"a{index}.h{h}"] = heads[..., h, :] @ columns.T
        return hook

    def edge_effects(
        self, clean: torch.Tensor, corrupt: torch.Tensor, metric: Callable[[torch.Tensor], torch.Tensor],
        edges: list[tuple[str, str]],
    ) -> list[float]:
        """``metric(patched) - metric(clean)``, summed over the batch, for each single edge ``(source, destination)``."""
        with torch.no_grad():
            clean_logits, _ = self.outputs(clean)
            _, corrupt_out = self.outputs(corrupt)
            base = float(metric(clean_logits).sum())
            return [float(metric(self.outputs(clean, {v: {u}}, corrupt_out)[0]).sum()) - base for u, v in edges]
