"""Mistral: Llama's block with sliding-window attention."""

import transformers.models.mistral.modeling_mistral as MODELING
from transformers.models.mistral.configuration_mistral import MistralConfig

from ..components.attention import Attention
from .base import RealCheckpoint
from .llama import Llama


class Mistral(Llama):
    """Mistral: Llama's block with sliding-window attention.

    Features of the architecture, as the difference from `llama`: every block's
    attention sees only the last ``config.sliding_window`` tokens (4096 on
    Mistral-7B-v0.1; ``None``, full attention, on later releases), with grouped
    key/value heads. Blocks are ``self_attn`` then a gated ``mlp``; no
    recurrent state.
    """

    MODELING = MODELING
    CONFIG = MistralConfig
    MODEL_TYPES = ("mistral",)

    DECODER_LAYERS = (MODELING.MistralDecoderLayer,)
    COMPONENTS = {MODELING.MistralAttention: Attention}

    REAL_CHECKPOINTS = {
        "mistralai/Mistral-7B-v0.1": RealCheckpoint(
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                sliding_window=4096,
            ),
            "transformers' MistralConfig defaults, which its docstring names as that checkpoint's",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # A window shorter than the test prompts, so the window is exercised.
        return dict(super(Mistral, cls).tiny_sizes(), sliding_window=4)
