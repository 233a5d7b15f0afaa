"""Qwen3.5-MoE (text): Qwen3.5 with a sparse mixture of experts in place of every MLP.

Features of the architecture, as the difference from `qwen3_5_text`: each
block's feed-forward part is a sparse block (a router, the routed experts and
a shared expert, HF's ``Qwen3_5MoeSparseMoeBlock``), exposed whole as
``mlp``. The mixers, ``linear_attn`` (gated DeltaNet) or ``self_attn`` as
``config.layer_types`` says, are Qwen3.5's. As with Qwen3.5, the hub's
checkpoints are vision-language composites (``model_type`` ``qwen3_5_moe``
with a ``text_config``) that ``AutoModelForCausalLM`` loads as this text
model.
"""

import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as MODELING

from ..components.attention import Attention
from ..components.linear_attention import LinearAttention
from .qwen3_5_text import EMBED_TOKENS, LAYER, LAYER_TYPES, LAYERS, LM_HEAD, LN_FINAL, layer_parts, text_config  # noqa: F401


MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
DECODER_LAYER = MODELING.Qwen3_5MoeDecoderLayer
COMPONENTS = {MODELING.Qwen3_5MoeAttention: Attention, MODELING.Qwen3_5MoeGatedDeltaNet: LinearAttention}
MIXER = LinearAttention
