"""Qwen3.5-MoE (text): Qwen3.5 with a sparse mixture of experts in place of every MLP."""

import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as MODELING
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

from ..components.attention import Attention
from ..components.gated_deltanet import LinearAttention
from .base import RealCheckpoint
from .qwen3_5_text import Qwen3_5Text, every_fourth_full


class Qwen3_5Moe(Qwen3_5Text):
    """Qwen3.5-MoE (text): Qwen3.5 with a sparse mixture of experts in place of every MLP.

    Features of the architecture, as the difference from `qwen3_5_text`: each
    block's feed-forward part is a sparse block (a router, the routed experts and
    a shared expert, HF's ``Qwen3_5MoeSparseMoeBlock``), exposed whole as
    ``mlp``. The mixers, ``linear_attn`` (gated DeltaNet) or ``self_attn`` as
    ``config.layer_types`` says, are Qwen3.5's. As with Qwen3.5, the hub's
    checkpoints are vision-language composites (``model_type`` ``qwen3_5_moe``
    with a ``text_config``) that ``AutoModelForCausalLM`` loads as this text
    model.
    """

    MODELING = MODELING
    CONFIG = Qwen3_5MoeTextConfig
    COMPOSITE_CONFIG = Qwen3_5MoeConfig
    MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")

    DECODER_LAYERS = (MODELING.Qwen3_5MoeDecoderLayer,)
    COMPONENTS = {MODELING.Qwen3_5MoeAttention: Attention, MODELING.Qwen3_5MoeGatedDeltaNet: LinearAttention}

    REAL_CHECKPOINTS = {
        "Qwen/Qwen3.5-35B-A3B": RealCheckpoint(
            dict(
                hidden_size=2048,
                num_hidden_layers=40,
                layer_types=every_fourth_full(40),
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
            ),
            "the model card (hidden 2048, 40 layers as 10 × (3 DeltaNet, 1 attention), DeltaNet 16 QK and 32 V heads "
            "of dim 128), as in transformers' Qwen3_5MoeTextConfig defaults, which name that checkpoint",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        sizes = super(Qwen3_5Moe, cls).tiny_sizes()
        del sizes["intermediate_size"]  # no dense MLP: experts of their own width
        return dict(sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
