"""LFM2-MoE: LFM2 with a sparse mixture of experts after the first dense blocks."""

import transformers.models.lfm2_moe.modeling_lfm2_moe as MODELING
from transformers.models.lfm2_moe.configuration_lfm2_moe import Lfm2MoeConfig

from ..components.attention import Attention
from ..components.short_convolution import ShortConvolution
from .base import RealCheckpoint
from .lfm2 import Lfm2, layer_types


class Lfm2Moe(Lfm2):
    """LFM2-MoE: LFM2 with a sparse mixture of experts after the first dense blocks.

    Features of the architecture, as the difference from `lfm2`: the
    feed-forward part (``mlp``) of the first ``config.num_dense_layers`` blocks
    is a dense MLP, and of every later block a sparse block (HF's
    ``Lfm2MoeSparseMoeBlock``: a sigmoid top-k router with an expert bias used
    for the choice only, normalized weights, no shared expert). The mixers are
    LFM2's; ``config.layer_types`` is given explicitly.
    """

    MODELING = MODELING
    CONFIG = Lfm2MoeConfig
    MODEL_TYPES = ("lfm2_moe",)

    DECODER_LAYERS = (MODELING.Lfm2MoeDecoderLayer,)
    COMPONENTS = {MODELING.Lfm2MoeAttention: Attention, MODELING.Lfm2MoeShortConv: ShortConvolution}

    REAL_CHECKPOINTS = {
        "LiquidAI/LFM2-8B-A1B": RealCheckpoint(
            dict(
                hidden_size=2048,
                intermediate_size=7168,
                moe_intermediate_size=1792,
                num_hidden_layers=24,
                layer_types=layer_types(24, [2, 6, 10, 14, 18, 21]),
                num_attention_heads=32,
                num_key_value_heads=8,
                num_dense_layers=2,
                num_experts=32,
                num_experts_per_tok=4,
                conv_L_cache=3,
            ),
            "the checkpoint's config.json (hidden 2048, 24 blocks, attention at 2, 6, 10, 14, 18, 21, two dense "
            "blocks then 32 experts of which 4 are active, expert width 1792, conv_L_cache 3); transformers' "
            "Lfm2MoeConfig defaults are documented as this checkpoint's",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # LFM2's tiny blocks; the first dense, the rest sparse (two dense blocks on the release).
        sizes = dict(super(Lfm2Moe, cls).tiny_sizes(), num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        sizes.pop("block_auto_adjust_ff_dim")
        return sizes
