"""xLSTM: a stack of mLSTM blocks (matrix-memory LSTM cells), no attention."""

import transformers.models.xlstm.modeling_xlstm as MODELING
from transformers.models.xlstm.configuration_xlstm import xLSTMConfig

from ..components.layer import Layer
from ..components.mlstm import MLSTM
from .base import RealCheckpoint
from .llama import Llama


class XLSTMLayer(Layer):
    """An xLSTM block: a norm, the mLSTM layer, a norm, a gated feed-forward (``ffn``)."""

    MLP = "ffn"


class XLSTM(Llama):
    """xLSTM (NX-AI's xLSTM-7b): a stack of mLSTM blocks, no attention.

    Features of the architecture, as the difference from `llama`: each block is
    an RMS norm, an mLSTM layer (HF's ``mlstm_layer``, served as ``linear_attn``
    by `MLSTM`: a matrix memory, a normalizer and a stabilizer per head, packed
    into one state value), an RMS norm and a gated feed-forward (``ffn``, served
    as ``mlp``); there is no ``self_attn``. The parts live under ``backbone``
    (``blocks``, ``embeddings``, ``out_norm``); the logits are soft-capped
    (``output_logit_soft_cap``). transformers' forward takes no attention mask,
    so nnterp refuses a left-padded batch (``PADDING_REFUSED``); it copies each block's state into its
    cache in place after using it, so a backward pass needs ``use_cache=False`` (``BACKWARD_KWARGS``).
    """

    MODELING = MODELING
    CONFIG = xLSTMConfig
    MODEL_TYPES = ("xlstm",)

    LAYERS = "backbone.blocks"
    EMBED_TOKENS = "backbone.embeddings"
    LN_FINAL = "backbone.out_norm"

    LAYER = XLSTMLayer
    DECODER_LAYERS = (MODELING.xLSTMBlock,)
    COMPONENTS = {MODELING.xLSTMLayer: MLSTM}
    MIXER = MLSTM
    PADDING_REFUSED = (
        "transformers' xLSTM forward takes no attention mask, so a padded batch would run the padding through every "
        "block's mLSTM state and change each shorter prompt's result: trace prompts of one length together, or each "
        "prompt in its own trace"
    )
    #: With use_cache=True, transformers copies each block's state into the cache in place after the kernel
    #: read it, so autograd refuses a backward pass (a plain transformers forward included).
    BACKWARD_KWARGS = {"use_cache": False}

    REAL_CHECKPOINTS = {
        "NX-AI/xLSTM-7b": RealCheckpoint(
            dict(hidden_size=4096, num_hidden_layers=32, num_heads=8, qk_dim_factor=0.5, v_dim_factor=1.0, vocab_size=50304),
            "transformers' xLSTMConfig defaults, documented as NX-AI/xLSTM-7b's (its auto_docstring checkpoint): "
            "32 blocks, hidden 4096, 8 heads, qk_dim_factor 0.5, v_dim_factor 1.0",
        ),
    }

    @classmethod
    def logits_softcap(cls, config) -> float | None:
        return cls.text_config(config).output_logit_soft_cap

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{"linear_attn", "mlp"} for _ in range(cls.text_config(config).num_hidden_layers)]

    @classmethod
    def tiny_sizes(cls) -> dict:
        # The released key:value ratio (1:2) at hidden 64: the cache rounds the q/k and v widths up to multiples of
        # 64, so both must be ones (64 and 128: key_dim 16, value_dim 32, distinct so a transposed state shows).
        # chunk_size 4: a prompt runs the chunkwise kernel on whole chunks and the token loop on the rest.
        return dict(
            hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=1.0, v_dim_factor=2.0,
            chunk_size=4, ffn_proj_factor=2.0, ffn_round_up_to_multiple_of=64,
        )
