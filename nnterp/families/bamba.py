"""Bamba: Mamba-2 blocks with a few softmax attention blocks, an MLP in every block."""

import transformers.models.bamba.modeling_bamba as MODELING
from transformers.models.bamba.configuration_bamba import BambaConfig

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.state_space import StateSpace
from .mamba2 import Mamba2


class FeedForwardLayer(Layer):
    """A block whose MLP HF keeps at ``feed_forward``."""

    MLP = "feed_forward"


class Bamba(Mamba2):
    """Bamba: Mamba-2 blocks with a few softmax attention blocks, an MLP in every block.

    Features of the architecture, as the difference from `mamba2`: each block
    holds either a Mamba-2 mixer (HF's ``mamba``, exposed as ``linear_attn``) or
    softmax attention (``self_attn``), as ``config.layers_block_type`` says
    (derived from ``config.attn_layer_indices``: the attention blocks' indices,
    all other blocks Mamba-2), then a gated MLP (HF's ``feed_forward``, exposed
    as ``mlp``). The parts live under ``model`` like Llama's (``model.embed_tokens``,
    ``model.final_layernorm``).
    """

    MODELING = MODELING
    CONFIG = BambaConfig
    MODEL_TYPES = ("bamba",)

    LAYERS = "model.layers"
    EMBED_TOKENS = "model.embed_tokens"
    LN_FINAL = "model.final_layernorm"

    LAYER = FeedForwardLayer
    DECODER_LAYERS = (MODELING.BambaDecoderLayer,)
    COMPONENTS = {MODELING.BambaAttention: Attention, MODELING.BambaMixer: StateSpace}
    MIXER = StateSpace
    CHUNKS_DIFFER = None  # its forward continues a prompt from the cache, given the prompt's position_ids

    #: ``config.layers_block_type`` entry -> the standard part of that block's mixer.
    BLOCK_TYPES = {"linear_attention": "linear_attn", "full_attention": "self_attn"}

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{cls.BLOCK_TYPES[kind], "mlp"} for kind in cls.text_config(config).layers_block_type]

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            attn_layer_indices=[2],  # Mamba-2 first, attention in between, as the released models (9, 18, 27 of 32)
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,  # small, so ordinary prompts span several chunks
            max_position_embeddings=2048,
        )
