"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local attention blocks, two in every three recurrent."""

import transformers.models.recurrent_gemma.modeling_recurrent_gemma as MODELING
from transformers import DynamicCache
from transformers.models.recurrent_gemma.configuration_recurrent_gemma import RecurrentGemmaConfig

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.rg_lru import RGLRU
from .base import RealCheckpoint
from .llama import Llama


class RecurrentGemmaLayer(Layer):
    """A Griffin residual block: its mixer at HF's ``temporal_block``, its feed-forward part at ``mlp_block``."""

    MLP = "mlp_block"


class RecurrentGemma(Llama):
    """RecurrentGemma (Griffin): RG-LRU recurrent blocks and local attention blocks, two in every three recurrent.

    Features of the architecture, as the difference from `llama`: each block's
    mixer is HF's ``temporal_block``, either a recurrent block (a gated branch
    times a width-``conv1d_width`` convolution followed by the RG-LRU, served by
    `RGLRU` as ``linear_attn``) or multi-query attention within a sliding window
    of ``attention_window_size`` tokens with RoPE on half of each head
    (``self_attn``), placed by ``config.block_types`` repeated over the blocks
    (``config.layers_block_type``: recurrent, recurrent, attention, ... as
    released); the feed-forward part is HF's ``mlp_block``, exposed as ``mlp``.
    The model multiplies the embedding by ``sqrt(hidden_size)`` (rounded to
    bfloat16) *after* ``embed_tokens``, so ``embed_tokens``' output is unscaled
    and ``layers[0].layer_input`` scaled. The causal LM soft-caps its logits at
    ``config.logits_soft_cap`` after the unembedding. The recurrent state and
    the convolution window live on the blocks' modules, not in a cache object.
    """

    MODELING = MODELING
    CONFIG = RecurrentGemmaConfig
    MODEL_TYPES = ("recurrent_gemma",)

    LN_FINAL = "model.final_norm"

    LAYER = RecurrentGemmaLayer
    DECODER_LAYERS = (MODELING.RecurrentGemmaDecoderLayer,)
    COMPONENTS = {MODELING.RecurrentGemmaAttention: Attention, MODELING.RecurrentGemmaRecurrentBlock: RGLRU}
    MIXER = RGLRU
    #: transformers 5.23 names the blocks' layer types (``linear_attention``, ``sliding_attention``), so that its
    #: ``DynamicCache`` keeps keys for the attention blocks only; before, every block gets a sliding-window layer, the
    #: cache's length is read from a recurrent block's (always 0) and a continued chunk's attention mask is misplaced.
    MENDABLE = "linear_attention" in MODELING.TEMPORAL_BLOCK_CLASSES
    CHUNKS_DIFFER = (
        "transformers' RecurrentGemma forward returns no cache, and a call passed none resets the RG-LRU state and "
        "convolution window its modules keep (and keeps no earlier keys for its attention blocks); a prompt of several "
        "tokens also convolves over zeros, not the window its block keeps"
    ) + ("" if MENDABLE else "; before transformers 5.23 its cache also misplaces a continued chunk's attention mask, which nnterp does not mend")
    #: Mended by passing the first chunk a cache (`first_cache`) and writing each block's window and state.
    CHUNK_STATE_INPUT = MENDABLE
    CHUNK_WINDOW_INPUT = MENDABLE
    PADDING_DIFFERS = (
        "transformers' recurrent block ignores the attention mask: a left-padded row's RG-LRU restarts at its first "
        "token (its position 0), but the padding's inputs enter its first conv_width - 1 tokens' convolution, so the "
        "row's states and logits are close to, not equal to, the prompt's alone; trace one prompt per invoke, or "
        "batch prompts of one length"
    )

    REAL_CHECKPOINTS = {
        "google/recurrentgemma-2b": RealCheckpoint(
            dict(
                hidden_size=2560,
                intermediate_size=3 * 2560,
                num_hidden_layers=26,
                num_attention_heads=10,
                attention_window_size=2048,
                conv1d_width=4,
                logits_soft_cap=30.0,
                block_types=["recurrent", "recurrent", "attention"],
            ),
            "transformers' RecurrentGemmaConfig defaults, which its docstring documents as google/recurrentgemma-2b's "
            "(26 blocks, hidden 2560 = lru_width, 10 heads, window 2048, width-4 convolution, two recurrent blocks "
            "then one attention block); its key/value heads are not recorded here",
        ),
    }

    @classmethod
    def first_cache(cls, config) -> DynamicCache | None:
        # for the attention blocks' keys: the forward makes one but returns none
        return DynamicCache(config=config) if cls.MENDABLE else None

    @classmethod
    def logits_softcap(cls, config) -> float | None:
        return cls.text_config(config).logits_soft_cap

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        # layers_block_type names the blocks as layer_types do from 5.23; before, as block_types does.
        mixer = {"linear_attention": "linear_attn", "sliding_attention": "self_attn", "recurrent": "linear_attn", "attention": "self_attn"}
        return [{mixer[kind], "mlp"} for kind in cls.text_config(config).layers_block_type]

    @classmethod
    def tiny_sizes(cls) -> dict:
        # The released block order cut to three blocks (recurrent, recurrent, attention); four heads of
        # 16 channels in the RG-LRU's block-diagonal gates, one key/value head, a window shorter than the
        # test prompts.
        return dict(
            hidden_size=64,
            lru_width=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_window_size=4,
            conv1d_width=4,
            block_types=["recurrent", "recurrent", "attention"],
        )
