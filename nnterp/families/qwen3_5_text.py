"""Qwen3.5 (text): a hybrid of gated DeltaNet and softmax attention blocks.

Features of the architecture, as the difference from `llama`: each block holds
either a gated DeltaNet (``linear_attn``, `LinearAttention`) or gated softmax
attention (``self_attn``), as ``config.layer_types`` says (three DeltaNet
blocks in every four on the released checkpoints), then an MLP. The hub's
Qwen3.5 checkpoints are vision-language ones (``model_type`` ``qwen3_5`` with
a ``text_config``); ``AutoModelForCausalLM`` loads them as this text model, and
so does nnterp.
"""

import transformers.models.qwen3_5.modeling_qwen3_5 as MODELING

from ..components.attention import Attention
from ..components.linear_attention import LinearAttention
from .llama import EMBED_TOKENS, LAYER, LAYERS, LM_HEAD, LN_FINAL  # noqa: F401  (same places)

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
DECODER_LAYER = MODELING.Qwen3_5DecoderLayer
COMPONENTS = {MODELING.Qwen3_5Attention: Attention, MODELING.Qwen3_5GatedDeltaNet: LinearAttention}
MIXER = LinearAttention

#: ``config.layer_types`` entry -> the standard part of that block.
LAYER_TYPES = {"linear_attention": "linear_attn", "full_attention": "self_attn"}


def text_config(config):
    """The text model's config: the composite's ``text_config``, or the config itself."""
    return config.get_text_config()


def layer_parts(config) -> list[set[str]]:
    return [{LAYER_TYPES[kind], "mlp"} for kind in text_config(config).layer_types]
