"""Mamba-1: a stack of selective state-space mixers, no attention, no MLP."""

import transformers.models.mamba.modeling_mamba as MODELING
from transformers.models.mamba.configuration_mamba import MambaConfig

from ..components.layer import Layer
from ..components.selective_scan import SelectiveScan
from .base import RealCheckpoint
from .llama import Llama


class MambaLayer(Layer):
    """A Mamba block: a mixer and nothing else."""

    MLP = None


class Mamba(Llama):
    """Mamba-1: a stack of selective state-space mixers, no attention, no MLP.

    Features of the architecture, as the difference from `llama`: each block is a
    norm and a `SelectiveScan` mixer (HF's ``mixer``, exposed as ``linear_attn``);
    there is no ``self_attn`` and no ``mlp``. The parts live under ``backbone``.
    """

    MODELING = MODELING
    CONFIG = MambaConfig
    MODEL_TYPES = ("mamba",)

    LAYERS = "backbone.layers"
    EMBED_TOKENS = "backbone.embeddings"
    LN_FINAL = "backbone.norm_f"

    LAYER = MambaLayer
    DECODER_LAYERS = (MODELING.MambaBlock,)
    COMPONENTS = {MODELING.MambaMixer: SelectiveScan}
    MIXER = SelectiveScan
    CHUNKS_DIFFER = (
        "transformers' Mamba-1 forward starts a prompt of several tokens from a zero state even with a cache (its "
        "convolution window continues; only a one-token step continues the state), its prompt kernel taking none"
    )
    #: Under `fast_states` (which `long_context_profile` turns on) a prompt's ``state_input`` is written: the fast
    #: path runs the kernel from zeros and adds what the written state contributes.
    CHUNK_STATE_INPUT = True

    REAL_CHECKPOINTS = {
        "state-spaces/mamba-2.8b-hf": RealCheckpoint(
            dict(hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4),
            "the Mamba paper's 2.8B model (64 layers, d_model 2560, N 16, expansion 2, width-4 convolution)",
        ),
        "state-spaces/mamba-130m-hf": RealCheckpoint(
            dict(hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4),
            "the checkpoint's config.json (hidden 768, 24 layers, state 16, expansion 2, width-4 convolution)",
        ),
    }

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{"linear_attn"} for _ in range(cls.text_config(config).num_hidden_layers)]

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, use_mambapy=False)
