"""OLMo 3: post-norm blocks, sliding-window and full attention layers."""

import transformers.models.olmo3.modeling_olmo3 as MODELING
from transformers.models.olmo3.configuration_olmo3 import Olmo3Config

from ..components.attention import Attention
from .base import RealCheckpoint
from .llama import Llama


class Olmo3(Llama):
    """OLMo 3: post-norm blocks, sliding-window and full attention layers.

    Features of the architecture, as the difference from `llama`: a block
    normalises the *outputs* of its attention and MLP before adding them to the
    residual stream (``post_attention_layernorm`` / ``post_feedforward_layernorm``;
    no norm on the way in), the attention normalises queries and keys over all
    heads, and ``config.layer_types`` makes three blocks in every four attend
    within a sliding window and the fourth to the whole prefix. Blocks are
    ``self_attn`` then a gated ``mlp``; no recurrent state. The baseline the
    OLMo hybrid (`olmo_hybrid`) is compared with.
    """

    MODELING = MODELING
    CONFIG = Olmo3Config
    MODEL_TYPES = ("olmo3",)

    DECODER_LAYERS = (MODELING.Olmo3DecoderLayer,)
    COMPONENTS = {MODELING.Olmo3Attention: Attention}

    REAL_CHECKPOINTS = {
        "allenai/Olmo-3-7B-Instruct": RealCheckpoint(
            dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, sliding_window=4096),
            "transformers' Olmo3Config defaults, which its docstring names as that checkpoint's",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Four blocks, the config's own 3:1 pattern (three sliding, then one full), with a
        # window shorter than the test prompts so that the sliding layers differ from the full one.
        return dict(super(Olmo3, cls).tiny_sizes(), num_hidden_layers=4, sliding_window=4)
