"""Llama: the plain transformer, and the sibling the other families differ from."""

import transformers.models.llama.modeling_llama as MODELING
from transformers.models.llama.configuration_llama import LlamaConfig

from ..components.attention import Attention
from ..components.layer import Layer
from .base import Family, RealCheckpoint


class Llama(Family):
    """Llama: the plain transformer, and the sibling the other families differ from.

    Features of the architecture: every block is softmax attention (``self_attn``)
    then a gated MLP (``mlp``); no recurrent state. A family class names the
    transformers modeling module it wraps, where the standard parts live, and
    which component serves each module class; a sibling subclasses this one and
    overrides what differs.
    """

    MODELING = MODELING
    CONFIG = LlamaConfig
    MODEL_TYPES = ("llama",)

    LAYERS = "model.layers"
    EMBED_TOKENS = "model.embed_tokens"
    LN_FINAL = "model.norm"
    LM_HEAD = "lm_head"

    LAYER = Layer
    DECODER_LAYERS = (MODELING.LlamaDecoderLayer,)
    COMPONENTS = {MODELING.LlamaAttention: Attention}
    MIXER = None

    REAL_CHECKPOINTS = {
        "meta-llama/Llama-3.2-1B": RealCheckpoint(
            dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
            "the model card",
        ),
    }

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{"self_attn", "mlp"} for _ in range(cls.text_config(config).num_hidden_layers)]

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
