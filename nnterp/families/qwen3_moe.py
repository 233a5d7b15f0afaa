"""Qwen3-MoE: Qwen3 with a sparse mixture of experts in place of the MLP."""

import transformers.models.qwen3_moe.modeling_qwen3_moe as MODELING
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from ..components.attention import Attention
from .base import RealCheckpoint
from .qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    """Qwen3-MoE: Qwen3 with a sparse mixture of experts in place of the MLP.

    Features of the architecture, as the difference from `qwen3`: each block's
    feed-forward part is a sparse block (a top-k router over the routed experts,
    HF's ``Qwen3MoeSparseMoeBlock``, no shared expert), exposed whole as ``mlp``.
    A block listed in ``config.mlp_only_layers`` (or off ``decoder_sparse_step``)
    keeps a dense MLP there instead; the released checkpoints have none. The
    attention is Qwen3's. The baseline the Qwen3.5-MoE hybrids are compared with.
    """

    MODELING = MODELING
    CONFIG = Qwen3MoeConfig
    MODEL_TYPES = ("qwen3_moe",)

    DECODER_LAYERS = (MODELING.Qwen3MoeDecoderLayer,)
    COMPONENTS = {MODELING.Qwen3MoeAttention: Attention}

    REAL_CHECKPOINTS = {
        "Qwen/Qwen3-30B-A3B": RealCheckpoint(
            dict(num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
            "the model card (48 layers, 32 query and 4 key/value heads, 128 experts of which 8 are activated)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Every block sparse, as released; four experts, two per token.
        return dict(super(Qwen3Moe, cls).tiny_sizes(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
