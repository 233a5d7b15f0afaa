"""MiniMax: lightning attention blocks with a softmax attention block in every eight, a mixture of experts in each."""

import transformers.models.minimax.modeling_minimax as MODELING
from transformers.models.minimax.configuration_minimax import MiniMaxConfig

from ..components.attention import Attention
from ..components.lightning_attention import LightningAttention
from .base import RealCheckpoint
from .qwen3_5_text import Qwen3_5Text


def seven_lightning_then_softmax(layers: int, period: int = 8) -> list[str]:
    """``config.layer_types`` of MiniMax-Text-01: ``period - 1`` lightning blocks, then one softmax block."""
    return ["full_attention" if i % period == period - 1 else "linear_attention" for i in range(layers)]


class MiniMax(Qwen3_5Text):
    """MiniMax: lightning attention blocks with a softmax attention block in every eight, a mixture of experts in each.

    Features of the architecture, as the difference from `qwen3_5_text`: the
    recurrent mixer is lightning attention (HF's ``MiniMaxLightningAttention``,
    kept at the block's ``self_attn`` and served by `LightningAttention` as
    ``linear_attn``): linear attention whose state decays by a fixed rate per
    head and layer, computed in the mixer's own forward (blocks of
    ``config.block_size`` tokens on a prompt, a token loop on a decode step).
    ``config.layer_types`` places the softmax blocks (``self_attn``, grouped
    queries, rotary positions): one after every seven lightning blocks on
    MiniMax-Text-01. Every block's feed-forward part is a sparse block (a top-k
    router over the experts, ``MiniMaxSparseMoeBlock``), exposed as ``mlp``. The
    block normalizes its input first and adds the mixer's output to the
    *normalized* input, each term scaled (``residual * alpha + output * beta``,
    the config's ``*_alpha_factor`` / ``*_beta_factor``, 3.56 and 1 on the
    released model), and likewise around the MLP; ``layer_input`` /
    ``layer_output`` are the block's own input and output all the same.
    """

    MODELING = MODELING
    CONFIG = MiniMaxConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("minimax",)

    DECODER_LAYERS = (MODELING.MiniMaxDecoderLayer,)
    COMPONENTS = {MODELING.MiniMaxAttention: Attention, MODELING.MiniMaxLightningAttention: LightningAttention}
    MIXER = LightningAttention
    CHUNKS_DIFFER = (
        "transformers' MiniMax forward builds a continued prompt's causal mask from block 0's cache, a lightning block "
        "that keeps no keys, so its softmax blocks mask the cached keys as if the cache were empty (the lightning "
        "states continue exactly)"
    )
    CHUNK_MASK = True  # each softmax block given the mask transformers builds at its own index mends it
    PADDING_DIFFERS = (
        "transformers' MiniMax cache reports its length from block 0, a lightning block that keeps no keys, so the "
        "attention mask of a decode step is built as for an empty cache and a softmax block no longer masks a "
        "left-padded row's padding keys as the prompt's forward did: from the second generated token, a padded row "
        "of generate differs from its prompt alone (a trace, one forward, is exact); generate one prompt per "
        "generate, or batch prompts of one length"
    )

    REAL_CHECKPOINTS = {
        "MiniMaxAI/MiniMax-Text-01-hf": RealCheckpoint(
            dict(
                hidden_size=6144,
                intermediate_size=9216,
                num_hidden_layers=80,
                layer_types=seven_lightning_then_softmax(80),
                num_attention_heads=64,
                head_dim=128,
                full_attn_alpha_factor=3.5565588200778455,
                linear_attn_alpha_factor=3.5565588200778455,
                mlp_alpha_factor=3.5565588200778455,
            ),
            "MiniMaxAI/MiniMax-Text-01's config.json on the hub (80 blocks, a softmax block after every 7 lightning "
            "blocks, 64 heads of dimension 128, hidden 6144, expert width 9216, residual alphas 3.5566)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Three lightning blocks then a softmax block (the released 7:1 order shrunk to 3:1, the hybrids'
        # tiny layout); blocks of 4 tokens, so a prompt spans several blocks and ends inside one; four
        # experts, two per token, in every block as released; residual scales that are not 1.
        return dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=4,
            layer_types=seven_lightning_then_softmax(4, period=4),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=4,
            full_attn_alpha_factor=1.5,
            linear_attn_alpha_factor=1.5,
            linear_attn_beta_factor=0.75,
            mlp_alpha_factor=1.5,
            max_position_embeddings=2048,
        )
