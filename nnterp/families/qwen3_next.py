"""Qwen3-Next: the hybrid Qwen3.5-MoE descends from, with a fused input projection."""

import transformers.models.qwen3_next.modeling_qwen3_next as MODELING
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from ..components.attention import Attention
from ..components.gated_deltanet import LinearAttention
from .base import RealCheckpoint
from .qwen3_5_moe import Qwen3_5Moe
from .qwen3_5_text import every_fourth_full


class Qwen3Next(Qwen3_5Moe):
    """Qwen3-Next: the hybrid Qwen3.5-MoE descends from, with a fused input projection.

    Features of the architecture, as the difference from `qwen3_5_moe`: the gated
    DeltaNet projects q, k, v, z and β, a in two fused matrices (``in_proj_qkvz``,
    ``in_proj_ba``) grouped by key head, then reorders them, so it reaches the
    same kernel with the same arguments and serves the same values. A block's
    ``mlp`` is the sparse block (HF's ``Qwen3NextSparseMoeBlock``), or a dense MLP
    on the layers ``config.mlp_only_layers`` and ``decoder_sparse_step`` make
    dense. Text only: there is no composite config.
    """

    MODELING = MODELING
    CONFIG = Qwen3NextConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("qwen3_next",)

    DECODER_LAYERS = (MODELING.Qwen3NextDecoderLayer,)
    COMPONENTS = {MODELING.Qwen3NextAttention: Attention, MODELING.Qwen3NextGatedDeltaNet: LinearAttention}

    REAL_CHECKPOINTS = {
        "Qwen/Qwen3-Next-80B-A3B-Instruct": RealCheckpoint(
            dict(
                hidden_size=2048,
                num_hidden_layers=48,
                layer_types=every_fourth_full(48),
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
            ),
            "the model card (hidden 2048, 48 layers as 12 × (3 DeltaNet, 1 attention), DeltaNet 16 QK and 32 V heads "
            "of dim 128), as in transformers' Qwen3NextConfig defaults, which name that checkpoint",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Every layer sparse; the dense width is kept for the layers mlp_only_layers would name.
        return dict(super(Qwen3Next, cls).tiny_sizes(), intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[])
