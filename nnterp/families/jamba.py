"""Jamba: Mamba-1 and softmax attention blocks, a mixture of experts in every other block."""

import transformers.models.jamba.modeling_jamba as MODELING
from transformers.models.jamba.configuration_jamba import JambaConfig

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.selective_scan import SelectiveScan
from .base import RealCheckpoint
from .qwen3_5_text import Qwen3_5Text


class JambaLayer(Layer):
    """A Jamba block: its feed-forward part is HF's ``feed_forward`` (a dense MLP or the whole sparse block)."""

    MLP = "feed_forward"


class Jamba(Qwen3_5Text):
    """Jamba: Mamba-1 and softmax attention blocks, a mixture of experts in every other block.

    Features of the architecture, as the difference from `qwen3_5_text`: the
    recurrent mixer is Mamba-1's selective scan (HF's ``JambaMambaMixer`` at the
    block's ``mamba``, served by `SelectiveScan` as ``linear_attn``); the softmax
    blocks (``self_attn``) have no positional encoding. The two kinds of block
    are two HF classes (``JambaMambaDecoderLayer``, ``JambaAttentionDecoderLayer``),
    placed by ``config.attn_layer_period`` / ``attn_layer_offset`` (block ``i`` is
    attention where ``i % period == offset``: ``config.layers_block_type``, which
    the config also gives as ``layer_types``; one attention block in every 8 at
    offset 4 on Jamba-v0.1). Every block's feed-forward part is HF's
    ``feed_forward``, exposed as ``mlp``: the whole sparse block (router and
    experts, ``JambaSparseMoeBlock``) where ``config.expert_layer_period`` /
    ``expert_layer_offset`` place experts (``config.layers_num_experts`` > 1),
    a dense MLP elsewhere.

    As in Falcon-Mamba, the mixer RMS-normalizes the low-rank time step, B and C
    after ``x_proj`` and before the kernel call, here with learned scales
    (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``); the kernel arguments
    nnterp serves (``attention_keys``, ``attention_queries``, ``dt``) are the
    normalized ones, and a write to them is not renormalized.
    """

    MODELING = MODELING
    CONFIG = JambaConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("jamba",)

    LN_FINAL = "model.final_layernorm"

    LAYER = JambaLayer
    #: The two block classes, both served by `JambaLayer`.
    DECODER_LAYERS = (MODELING.JambaMambaDecoderLayer, MODELING.JambaAttentionDecoderLayer)
    COMPONENTS = {MODELING.JambaAttention: Attention, MODELING.JambaMambaMixer: SelectiveScan}
    MIXER = SelectiveScan
    CHUNKS_DIFFER = (
        "transformers' Mamba-1 forward starts a prompt of several tokens from a zero state even with a cache (its "
        "convolution window continues; only a one-token step continues the state), its prompt kernel taking none"
    )
    #: Under `fast_states` (which `long_context_profile` turns on) a prompt's ``state_input`` is written: the fast
    #: path runs the kernel from zeros and adds what the written state contributes.
    CHUNK_STATE_INPUT = True

    REAL_CHECKPOINTS = {
        "ai21labs/Jamba-v0.1": RealCheckpoint(
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                attn_layer_period=8,
                attn_layer_offset=4,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=16,
                num_experts_per_tok=2,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
            ),
            "transformers' JambaConfig defaults, which its docstring documents as ai21labs/Jamba-v0.1's (32 layers, "
            "hidden 4096, one attention block in every 8 at offset 4, 16 experts (top 2) in every other block, "
            "Mamba state 16, expansion 2, width-4 convolution)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Three Mamba blocks then an attention block (Jamba-v0.1's period 8, offset 4, a run of
        # Mamba blocks before each attention block, shrunk to period 4, offset 3, the hybrids'
        # tiny layout); experts in every other block from block 1, as released, so here the
        # attention block's feed-forward part is a sparse block too.
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=3,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            max_position_embeddings=2048,
            use_mambapy=False,
        )
