"""Mamba-1: a stack of selective state-space mixers, no attention, no MLP.

Features of the architecture, as the difference from `llama`: each block is a
norm and a `SelectiveScan` mixer (HF's ``mixer``, exposed as ``linear_attn``);
there is no ``self_attn`` and no ``mlp``. The parts live under ``backbone``.
"""

import transformers.models.mamba.modeling_mamba as MODELING

from ..components.layer import Layer
from ..components.selective_scan import SelectiveScan

MODEL_TYPES = ("mamba",)
LAYERS = "backbone.layers"
EMBED_TOKENS = "backbone.embeddings"
LN_FINAL = "backbone.norm_f"
LM_HEAD = "lm_head"


class MambaLayer(Layer):
    """A Mamba block: a mixer and nothing else."""

    MLP = None


LAYER = MambaLayer
DECODER_LAYER = MODELING.MambaBlock
COMPONENTS = {MODELING.MambaMixer: SelectiveScan}
MIXER = SelectiveScan


def text_config(config):
    return config


def layer_parts(config) -> list[set[str]]:
    return [{"linear_attn"} for _ in range(config.num_hidden_layers)]
