"""Positional edges: a head's output split by the source position its value came from.

Mental model. A head's core output at target ``t`` is ``o[t] = Σ_s A[t, s] v_s``: ``A`` is the attention
pattern of a softmax head (``self_attn.attention_probabilities``, eager attention, with ``v`` its values, the
value projection of the part's input repeated to the query heads) or the exact effective attention of a
recurrent head (``linear_attn.effective_attention`` with ``linear_attn.attention_values``). What reaches the
output projection is ``z[t] = o[t] ⊙ f[t]``, with ``f`` the head's output gate and norm factors of the same run
(an RMS norm and a gate act elementwise), so the head's share splits into one term per source position:

    term[t, s] = W_o,h (A[t, s] v_s ⊙ f[t]),        Σ_s term[t, s] = W_o,h z[t]  (the head's share)

and a positional edge ``(u, v, s)`` is the edge ``u -> v`` through the term of source ``s``: the positional
edges of a head sum to its edge. ``f = z / o`` elementwise (0 where ``o`` is 0).

Served on attention heads (eager, a ``v_proj``) and on the recurrent kinds whose kernel output on a prompt is
exactly ``Σ_s A[t, s] v_s``: the gated DeltaNet and Kimi's delta attention (no skip term, no state entering).
The other kinds (Mamba-1/2 with their ``D`` skip, the mLSTM's normalizer, RWKV-4's bonus, the RG-LRU and the
short convolution, which have no heads) raise `Unavailable` with that reason.
"""

from __future__ import annotations

from typing import Any

import torch

from ..components.gated_deltanet import LinearAttention
from ..core.errors import Unavailable

__all__ = ["positional_reason", "check_positional", "read_core", "head_terms"]


def positional_reason(part: Any, envoy: Any) -> str | None:
    """Why ``part``'s edges cannot be split by source position, or ``None``."""
    if part.kind == "mlp":
        return None
    if part.kind == "attention":
        if "v_proj" not in envoy._child_map:
            return "its attention has no v_proj to read the values from"
        return type(envoy).values()["attention_probabilities"].reason(envoy)
    if not isinstance(envoy, LinearAttention):
        return (
            f"the kernel output of a {type(envoy).__name__} is not Σ_s A[t, s] v_s alone (a skip term, a normalizer, "
            "or no heads): its positional split is not served yet"
        )
    return None


def check_positional(model: Any, nodes: Any) -> None:
    """Raise `Unavailable` where a part of ``nodes`` has no positional split."""
    for part in nodes.parts:
        block = model.layers[part.layer]
        envoy = {"attention": block.self_attn, "mixer": block.linear_attn, "mlp": block.mlp}[part.kind]
        reason = positional_reason(part, envoy)
        if reason is not None:
            raise Unavailable(f"positional edges of layer {part.layer}'s {part.kind}", reason)


def read_core(envoy: Any, kind: str) -> tuple:
    """Inside a trace, before the part's output projection: ``(A [batch, heads, seq, seq], v [batch, seq, heads, dim])``."""
    if kind == "attention":
        args, kwargs = envoy.inputs
        x = args[0] if args else kwargs["hidden_states"]
        pattern = envoy.attention_probabilities
        projection = envoy._child_map["v_proj"]._module
        values = projection(x.to(projection.weight.dtype))
        config = envoy._module.config
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        values = values.reshape(*values.shape[:2], -1, dim)
        # Grouped-query attention: query head h reads key/value head h // (heads / kv_heads), as repeat_kv does.
        return pattern, values.repeat_interleave(pattern.shape[1] // values.shape[2], dim=2)
    values = envoy.attention_values
    return envoy.effective_attention, values


def head_terms(pattern: torch.Tensor, values: torch.Tensor, projected: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, seq, heads, hidden]``: term ``[t, s]`` of each head (module docstring), float32.

    ``projected``: the output projection's input ``[batch, seq, heads · dim]``; ``weight``: its weight ``[hidden, heads · dim]``.
    """
    pattern, values = pattern.float(), values.float()
    batch, seq, heads, dim = values.shape
    z = projected.float().reshape(batch, projected.shape[1], heads, dim)
    core = torch.einsum("bhts,bshe->bthe", pattern, values)
    factor = torch.where(core == 0, torch.zeros_like(core), z / torch.where(core == 0, torch.ones_like(core), core))
    w = weight.float().reshape(weight.shape[0], heads, dim)
    return torch.einsum("bhts,bshe,bthe,dhe->btshd", pattern, values, factor, w)
