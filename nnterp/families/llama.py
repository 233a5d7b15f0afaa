"""Llama: the plain transformer, and the sibling the other families differ from.

Features of the architecture: every block is softmax attention (``self_attn``)
then a gated MLP (``mlp``); no recurrent state. A family file names the
transformers modeling module it wraps, where the standard parts live, and
which component serves each module class; a sibling imports this file and
overrides what differs.
"""

import transformers.models.llama.modeling_llama as MODELING

from ..components.attention import Attention
from ..components.layer import Layer

#: The ``config.model_type`` values this family wraps.
MODEL_TYPES = ("llama",)

#: Where the standard parts live, as attribute paths from the causal LM.
LAYERS = "model.layers"
EMBED_TOKENS = "model.embed_tokens"
LN_FINAL = "model.norm"
LM_HEAD = "lm_head"

#: The component of a decoder block.
LAYER = Layer
DECODER_LAYER = MODELING.LlamaDecoderLayer

#: HF module class -> the component that serves it.
COMPONENTS = {MODELING.LlamaAttention: Attention}

#: The family's recurrent mixer component, for `route_kernels`; ``None`` here.
MIXER = None


def text_config(config):
    """The config of the text model (the composite's ``text_config`` where there is one)."""
    return config


def layer_parts(config) -> list[set[str]]:
    """The standard parts each block has, from the config alone."""
    return [{"self_attn", "mlp"} for _ in range(text_config(config).num_hidden_layers)]
