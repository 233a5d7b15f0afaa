"""KimiDeltaAttention: Kimi-Linear's delta attention (KDA), a gated DeltaNet with a decay per key channel.

Mental model: the same state and the same delta rule as `LinearAttention`,
``[key_dim, value_dim]`` per head, but the decay is a vector, one factor per
key channel (per row of the state), rather than one scalar per head:

    S_t = diag(exp(g_t)) S_{t-1}            (g_t: [key_dim], the log decay)
    S_t = S_t + k_t ⊗ β_t (v_t − S_tᵀ k_t)
    o_t = S_tᵀ q_t

One head count serves queries, keys and values (``key_heads ==
mixer_heads``), and ``key_dim == value_dim``. Every value `LinearAttention`
serves is served here with the same shape, except

* ``decays`` ``[batch, seq, mixer_heads, key_dim]``: g, the log decay (≤ 0) of
  each key channel, exactly as the kernel takes it (transformers'
  ``KimiLinearForgetGate`` output).

transformers keeps this mixer at the decoder block's ``self_attn``; the block
component classifies it by kind, so it is ``layer.linear_attn`` in nnterp and
``layer.self_attn`` is ``None`` on its blocks. Its kernels are
``chunk_kimi_delta_attention`` (a prompt) and
``recurrent_kimi_delta_attention`` (a decode step, and a prompt after
``route_kernels(family, "torch")``); their arguments are laid out as the gated
delta rule's (``query, key, value`` positional; ``g``, ``beta``,
``initial_state`` by keyword), and the state is ``[batch, heads, key_dim,
value_dim]``, float32.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from ..core.dims import BATCH, KEY_DIM, MIXER_HEADS, SEQ
from ..fast.gated_deltanet import KIMI_EFFECTIVE as KIMI_DELTA_ATTENTION
from ..fast.gated_deltanet import KIMI_FAST as KIMI_DELTA
from .gated_deltanet import LinearAttention
from .recurrent import kernel_argument

#: ``[batch, seq, mixer_heads, key_dim]``: one log decay per key channel.
ChannelGates = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {KEY_DIM}"]


class KimiDeltaAttention(LinearAttention):
    """Kimi-Linear's delta attention (``layer.linear_attn``): see the module docstring for what differs."""

    REFERENCE = "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention"
    FAST = KIMI_DELTA
    EFFECTIVE = KIMI_DELTA_ATTENTION
    CHUNK_FUNCTION = "chunk_kimi_delta_attention"
    RECURRENT_FUNCTION = "recurrent_kimi_delta_attention"
    #: Inside the token loop, the variable holding a token's per-channel decay factors.
    DECAY_VARIABLE = "g_i"
    #: One head count for queries, keys and values: nothing repeats heads.
    GROUPED_HEADS = False

    decays = kernel_argument(
        "g",
        "the log decay g ≤ 0 of each key channel (row i of the state is multiplied by exp(g[..., i])), "
        "[batch, seq, mixer_heads, key_dim]",
        ChannelGates,
    )

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "key_heads": module.num_heads,
            "mixer_heads": module.num_heads,
            "key_dim": module.head_dim,
            "value_dim": module.head_dim,
            "conv_channels": module.conv_dim,
            "conv_width": module.conv_kernel_size,
        }
