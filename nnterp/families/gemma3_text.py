"""Gemma 3 (text): sandwich-norm blocks, a scaled embedding, sliding-window and full attention layers."""

import transformers.models.gemma3.modeling_gemma3 as MODELING
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig

from ..components.attention import Attention
from .base import RealCheckpoint
from .llama import Llama


class Gemma3Text(Llama):
    """Gemma 3 (text): sandwich-norm blocks, a scaled embedding, sliding-window and full attention layers.

    Features of the architecture, as the difference from `llama`: the token
    embedding multiplies its rows by ``sqrt(hidden_size)`` inside the module
    (HF's ``Gemma3TextScaledWordEmbedding``), so ``embed_tokens``' output, and
    ``layers[0].layer_input``, are already scaled. A block norms its attention's
    and MLP's inputs *and* outputs (four norms), the attention normalises
    queries and keys per head and scales scores by ``query_pre_attn_scalar``,
    and ``config.layer_types`` makes five blocks in every six attend within a
    sliding window (with their own RoPE base) and the sixth to the whole prefix.
    ``Gemma3ForCausalLM`` soft-caps the logits *after* the unembedding when
    ``config.final_logit_softcapping`` is set; ``model.logits`` (the model's
    output logits) are after that cap and ``lm_head``'s output before it; no
    released Gemma 3 sets it (``None``). Blocks are ``self_attn``
    then a gated ``mlp``; no recurrent state. The hub ships most Gemma 3
    checkpoints as a vision-language composite, served by `gemma3`.
    """

    MODELING = MODELING
    CONFIG = Gemma3TextConfig
    MODEL_TYPES = ("gemma3_text",)

    DECODER_LAYERS = (MODELING.Gemma3DecoderLayer,)
    COMPONENTS = {MODELING.Gemma3Attention: Attention}

    @classmethod
    def logits_softcap(cls, config) -> float | None:
        return getattr(cls.text_config(config), "final_logit_softcapping", None)

    REAL_CHECKPOINTS = {
        "google/gemma-3-1b-pt": RealCheckpoint(
            dict(num_hidden_layers=26),
            "keras-hub's Gemma 3 presets (gemma3_1b: a 26-layer, text-only model); its other sizes are not recorded here",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        # One sliding-window block then the full one (the released order, cut to two), the window
        # shorter than the test prompts; no logit softcapping, as released.
        return dict(
            super(Gemma3Text, cls).tiny_sizes(),
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
