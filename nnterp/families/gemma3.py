"""Gemma 3 (vision-language composite): the hub's Gemma 3 checkpoints, served as transformers loads them."""

import transformers.models.gemma3.modeling_gemma3 as MODELING
from transformers.models.gemma3.configuration_gemma3 import Gemma3Config

from ..components.attention import Attention
from .base import TINY
from .gemma3_text import Gemma3Text


class Gemma3(Gemma3Text):
    """Gemma 3 (vision-language composite): the hub's Gemma 3 checkpoints, served as transformers loads them.

    Features of the architecture, as the difference from `gemma3_text`: the
    checkpoint is the composite (``model_type`` ``gemma3``, a SigLIP vision
    tower, a projector and a ``text_config``). Unlike Qwen3.5's composite,
    ``AutoModelForCausalLM`` loads it whole, as ``Gemma3ForConditionalGeneration``
    (``Gemma3ForCausalLM`` cannot read its weights: they are stored under the
    composite's names), and nnterp serves that model: the text model's parts sit
    under ``model.language_model`` and ``lm_head`` is the composite's. Its blocks,
    embedding scale and attention are `gemma3_text`'s; on text-only input the
    logits are the text model's. ``Gemma3ForConditionalGeneration`` applies no
    final logit softcapping at all, so ``logits`` (its output logits) are the
    ``lm_head`` output whatever ``final_logit_softcapping`` says. The vision tower is
    not wrapped: nnterp reads the text stack.
    """

    MODELING = MODELING
    CONFIG = Gemma3Config
    COMPOSITE_CONFIG = Gemma3Config
    MODEL_TYPES = ("gemma3",)

    LAYERS = "model.language_model.layers"
    EMBED_TOKENS = "model.language_model.embed_tokens"
    LN_FINAL = "model.language_model.norm"

    DECODER_LAYERS = (MODELING.Gemma3DecoderLayer,)
    COMPONENTS = {MODELING.Gemma3Attention: Attention}

    @classmethod
    def logits_softcap(cls, config) -> None:
        return None  # Gemma3ForConditionalGeneration caps nothing

    @classmethod
    def text_config(cls, config):
        """The text model's config: the composite's ``text_config``."""
        return config.get_text_config()

    @classmethod
    def tiny_config(cls, model_type: str, **tokens):
        """The composite: `gemma3_text`'s tiny text config and a one-block SigLIP tower (2 x 2 patches, 4 image tokens)."""
        cls._check(model_type)
        text = dict(cls.tiny_sizes(), **TINY, **tokens)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16)
        return cls.CONFIG(text_config=text, vision_config=vision, mm_tokens_per_image=4, **TINY)
