"""LFM2: gated short convolutions and softmax attention blocks."""

import transformers.models.lfm2.modeling_lfm2 as MODELING
from transformers.models.lfm2.configuration_lfm2 import Lfm2Config

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.short_convolution import ShortConvolution
from .base import RealCheckpoint
from .qwen3_5_text import Qwen3_5Text

#: LFM2-350M / 1.2B's ``full_attn_idxs``: six attention blocks among 16 (the others short convolutions).
LFM2_ATTENTION = [2, 5, 8, 10, 12, 14]


def layer_types(layers: int, attention: list[int]) -> list[str]:
    """``config.layer_types``: ``"full_attention"`` at the ``attention`` indices, ``"conv"`` elsewhere."""
    return ["full_attention" if i in attention else "conv" for i in range(layers)]


class Lfm2Layer(Layer):
    """An LFM2 block: its feed-forward part is HF's ``feed_forward``."""

    MLP = "feed_forward"


class Lfm2(Qwen3_5Text):
    """LFM2: gated short convolutions and softmax attention blocks.

    Features of the architecture, as the difference from `qwen3_5_text`: the
    recurrent mixer is a gated short convolution (HF's ``Lfm2ShortConv`` at the
    block's ``conv``, served by `ShortConvolution` as ``linear_attn``), whose only
    state is the window of its last ``conv_L_cache`` (3) gated inputs; the
    softmax blocks (``self_attn``, RMS-normed queries and keys, rotary) are
    placed by ``config.layer_types`` (``"conv"`` / ``"full_attention"``, derived
    from ``full_attn_idxs`` on the released checkpoints: blocks 2, 5, 8, 10, 12
    and 14 of 16). The feed-forward part is HF's ``feed_forward`` (a SwiGLU MLP),
    exposed as ``mlp``; the final norm is HF's ``embedding_norm``.
    """

    MODELING = MODELING
    CONFIG = Lfm2Config
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("lfm2",)

    LN_FINAL = "model.embedding_norm"

    LAYER = Lfm2Layer
    DECODER_LAYERS = (MODELING.Lfm2DecoderLayer,)
    COMPONENTS = {MODELING.Lfm2Attention: Attention, MODELING.Lfm2ShortConv: ShortConvolution}
    MIXER = ShortConvolution

    LAYER_TYPES = {"conv": "linear_attn", "full_attention": "self_attn"}

    REAL_CHECKPOINTS = {
        "LiquidAI/LFM2-350M": RealCheckpoint(
            dict(
                hidden_size=1024,
                num_hidden_layers=16,
                layer_types=layer_types(16, LFM2_ATTENTION),
                num_attention_heads=16,
                num_key_value_heads=8,
                intermediate_size=6656,
                conv_L_cache=3,
            ),
            "the checkpoint's config.json (hidden 1024, 16 blocks, attention at full_attn_idxs [2, 5, 8, 10, 12, 14], "
            "16 query and 8 key/value heads, block_ff_dim 6656 auto-adjusted, conv_L_cache 3, no conv bias)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Two short convolutions, an attention block, a short convolution: the released
        # models' first blocks (attention first at block 2). Width 3 as released.
        return dict(
            hidden_size=64,
            intermediate_size=128,
            block_auto_adjust_ff_dim=False,
            num_hidden_layers=4,
            layer_types=layer_types(4, [2]),
            num_attention_heads=4,
            num_key_value_heads=2,
            conv_L_cache=3,
            max_position_embeddings=2048,
        )
