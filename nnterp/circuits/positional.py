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

Served on attention heads (eager, a ``v_proj``; zamba2's shared attention with its depth's value adapter) and on the recurrent kinds whose effective attention reproduces
the kernel's output on a prompt exactly, ``Σ_s A[t, s] v_s``: the gated DeltaNet and Kimi's delta attention,
lightning attention (its RMS norm over all heads and its gate in ``f``), Mamba-2 (its skip ``D x_t`` on the diagonal, the term of ``s = t``), the mLSTM (given each token's normalizer),
and, with a pattern per channel summed into their one node, Mamba-1 (skip and gate included), RWKV-4 and the
RG-LRU. The short convolution raises `Unavailable`: its kernel's output has a part of no source position.
"""

from __future__ import annotations

from typing import Any

import torch

from ..components.gated_deltanet import LinearAttention
from ..components.lightning_attention import LightningAttention
from ..components.mlstm import MLSTM
from ..components.rg_lru import RGLRU
from ..components.selective_scan import SelectiveScan
from ..components.state_space import StateSpace
from ..components.wkv import WKV
from ..core.errors import Unavailable

__all__ = ["positional_reason", "check_positional", "read_core", "head_terms", "EXACT"]

#: The mixers whose kernel output on a prompt is exactly ``Σ_s A[t, s] v_s`` (the skip ``D`` on the diagonal).
EXACT = (LinearAttention, LightningAttention, StateSpace, SelectiveScan, MLSTM, RGLRU, WKV)


def positional_reason(part: Any, envoy: Any) -> str | None:
    """Why ``part``'s edges cannot be split by source position, or ``None``."""
    if part.kind == "mlp":
        return None
    if part.kind == "attention":
        if "v_proj" not in envoy._child_map:
            return "its attention has no v_proj to read the values from"
        return type(envoy).values()["attention_probabilities"].reason(envoy)
    if not isinstance(envoy, EXACT):
        return (
            f"the positional split of a {type(envoy).__name__} is not served yet: its kernel's output on a prompt is "
            "Σ_s A[t, s] v_s plus a part of no source position (the short convolution's bias and entering window)"
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
        if "linear_v_adapter_list" in envoy._child_map:
            # zamba2's shared attention: its depth's low-rank adapter adds to the values (as its forward selects it).
            module = envoy._module
            depth = module.layer_dic[args[1] if len(args) > 1 else kwargs["layer_idx"]]
            values = values + module.linear_v_adapter_list[depth](x.to(projection.weight.dtype))
        config = envoy._module.config
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        values = values.reshape(*values.shape[:2], -1, dim)
        # Grouped-query attention: query head h reads key/value head h // (heads / kv_heads), as repeat_kv does.
        return pattern, values.repeat_interleave(pattern.shape[1] // values.shape[2], dim=2)
    values = envoy.attention_values
    # Mamba-1: one pattern per channel, values [batch, seq, channels]: each channel a head of width 1.
    return envoy.effective_attention, values.unsqueeze(-1) if values.dim() == 3 else values


def head_terms(pattern: torch.Tensor, values: torch.Tensor, projected: torch.Tensor, weight: torch.Tensor, nodes: int) -> torch.Tensor:
    """``[batch, seq, seq, nodes, hidden]``: term ``[t, s]`` of each of the part's ``nodes`` (module docstring), float32.

    ``pattern`` ``[batch, heads, seq, seq]``, ``values`` ``[batch, seq, heads, dim]`` (a mixer without heads: a head
    per channel, summed into its one node); ``projected``: the output projection's input ``[batch, seq, heads · dim]``;
    ``weight``: its weight ``[hidden, heads · dim]``.
    """
    pattern, values = pattern.float(), values.float()
    batch, seq, heads, dim = values.shape
    z = projected.float().reshape(batch, projected.shape[1], heads, dim)
    core = torch.einsum("bhts,bshe->bthe", pattern, values)
    factor = torch.where(core == 0, torch.zeros_like(core), z / torch.where(core == 0, torch.ones_like(core), core))
    w = weight.float().reshape(weight.shape[0], heads, dim)
    if nodes == heads:
        return torch.einsum("bhts,bshe,bthe,dhe->btshd", pattern, values, factor, w)
    # Channels summed into nodes: each (t, s) term through its channels, then projected.
    weighted = torch.einsum("bhts,bshe,bthe->btshe", pattern, values, factor)
    return torch.einsum("btshe,dhe->btsd", weighted, w).unsqueeze(3) if nodes == 1 else torch.einsum(
        "btsnge,dnge->btsnd", weighted.reshape(batch, -1, seq, nodes, heads // nodes, dim), w.reshape(w.shape[0], nodes, heads // nodes, dim)
    )
