"""Qwen3: the plain Qwen transformer, attention with per-head query/key norms."""

import transformers.models.qwen3.modeling_qwen3 as MODELING
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from ..components.attention import Attention
from .base import RealCheckpoint
from .llama import Llama


class Qwen3(Llama):
    """Qwen3: the plain Qwen transformer, attention with per-head query/key norms.

    Features of the architecture, as the difference from `llama`: the attention
    normalises queries and keys per head (``q_norm`` / ``k_norm``, inside
    ``self_attn``) and its head width is ``config.head_dim``, not
    ``hidden_size / num_attention_heads``. Every block is ``self_attn`` then a
    gated ``mlp``; no recurrent state. The baseline the Qwen3.5 hybrids are
    compared with.
    """

    MODELING = MODELING
    CONFIG = Qwen3Config
    MODEL_TYPES = ("qwen3",)

    DECODER_LAYERS = (MODELING.Qwen3DecoderLayer,)
    COMPONENTS = {MODELING.Qwen3Attention: Attention}

    REAL_CHECKPOINTS = {
        "Qwen/Qwen3-0.6B": RealCheckpoint(
            dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
            "the model card (28 layers, 16 query and 8 key/value heads)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # head_dim 16 = 64 / 4 here; it is its own field in Qwen3's config.
        return dict(super(Qwen3, cls).tiny_sizes(), head_dim=16)
