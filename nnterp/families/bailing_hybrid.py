"""Bailing-Hybrid (Ling 3): Kimi delta attention and multi-head latent attention blocks, with a bounded forget gate."""

import transformers.models.bailing_hybrid.modeling_bailing_hybrid as MODELING
from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig

from ..components.attention import Attention
from ..components.kimi_delta_attention import KimiDeltaAttention
from .base import RealCheckpoint
from .kimi_linear import KimiLinear


class BailingHybrid(KimiLinear):
    """Bailing-Hybrid (Ling 3): Kimi delta attention and multi-head latent attention blocks, with a bounded forget gate.

    Features of the architecture, as the difference from `kimi_linear`: the
    linear blocks' mixer is HF's ``BailingHybridDeltaAttention``, Kimi delta
    attention served by `KimiDeltaAttention` unchanged. In transformers 5.24 it
    calls ``chunk_kimi_delta_attention`` on a prompt and
    ``recurrent_kimi_delta_attention`` on a decode step, this module's own
    copies, whose bodies are Kimi-Linear's line for line (as are the
    short-convolution kernels), with the same arguments (``query, key, value``
    positional; ``g``, ``beta``, ``initial_state``, ``use_qk_l2norm_in_kernel=True``
    by keyword) and the same ``[batch, heads, key_dim, value_dim]`` float32
    state. What differs is outside the kernels:

    * the forget gate (``BailingHybridForgetGate``) projects at full rank
      (``f_proj``, not Kimi's low-rank ``f_a_proj``/``f_b_proj``) and, with
      ``config.kda_safe_gate`` (the default), is bounded:
      g = ``kda_lower_bound`` · sigmoid(exp(A_log) · (f + dt_bias)), so
      ``decays`` lie in (``kda_lower_bound``, 0) (−5 by default); without it,
      Kimi's −exp(A_log) · softplus(f + dt_bias). ``decays`` is g as the
      kernel takes it either way;
    * the output gate is one full-rank ``g_proj``; the short convolution's
      weights are float32;
    * the blocks are placed by ``config.layer_group_size`` (the last block of
      every group is MLA, the others delta attention: 5 of every 6 on the
      released model) and the MLPs by ``config.first_k_dense_replace`` (dense
      first, then the whole sparse block, ``BailingHybridMoE``), which the
      config turns into ``layer_types`` and ``mlp_layer_types``. As in
      Kimi-Linear, HF keeps both mixers at the block's ``self_attn``.
    """

    MODELING = MODELING
    CONFIG = BailingHybridConfig
    MODEL_TYPES = ("bailing_hybrid",)

    DECODER_LAYERS = (MODELING.BailingHybridDecoderLayer,)
    COMPONENTS = {MODELING.BailingHybridAttention: Attention, MODELING.BailingHybridDeltaAttention: KimiDeltaAttention}
    MIXER = KimiDeltaAttention

    REAL_CHECKPOINTS = {
        "inclusionAI/Ling-3.0-Flash": RealCheckpoint(
            dict(
                hidden_size=2560,
                num_hidden_layers=42,
                num_attention_heads=32,
                linear_num_heads=32,
                linear_head_dim=128,  # the config's `head_dim` (128), which it then resets to qk_rope_head_dim
                layer_group_size=6,
                short_conv_kernel_size=4,
                first_k_dense_replace=2,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
            ),
            "transformers' BailingHybridConfig defaults, which its docstring documents as inclusionAI/Ling-3.0-Flash's "
            "(42 layers, hidden 2560, 32 delta-attention heads of dim 128, MLA every 6th block, width-4 convolution, "
            "the first 2 MLPs dense); not checked against the checkpoint's own config",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            # Three delta-attention blocks then MLA, the released groups of 6 shrunk to 4;
            # the first MLP dense, the others sparse, as the config derives them.
            layer_group_size=4,
            first_k_dense_replace=1,
            num_attention_heads=4,  # also the delta attention's head count
            num_key_value_heads=4,
            head_dim=16,  # the delta attention's head dim (the config then sets head_dim to qk_rope_head_dim)
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            short_conv_kernel_size=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            max_position_embeddings=2048,
        )
