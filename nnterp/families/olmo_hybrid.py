"""OLMo-Hybrid: gated DeltaNet and softmax attention blocks, each its own block class.

Features of the architecture, as the difference from `qwen3_5_text`: the two
kinds of block are two HF classes (``LinearAttentionDecoderLayer``
holding ``linear_attn``, ``OlmoHybridAttentionDecoderLayer`` holding
``self_attn``), both served by `Layer`, as ``config.layer_types`` places
them; every block has a dense ``mlp``. The gated DeltaNet projects q, k, v
separately, may double β (``allow_neg_eigval``: a write strength in (0, 2),
so ``betas`` can exceed 1) and serves the same values as Qwen3.5's.

A quirk of transformers up to 5.20: this mixer decides whether it continues a
cached state with ``cache.has_previous_state()`` *without* its layer index
(the last linear block's flag), where the other families pass their own. The
component follows whichever test the installed forward makes.
"""

from __future__ import annotations

import transformers.models.olmo_hybrid.modeling_olmo_hybrid as MODELING

from ..components.attention import Attention
from ..components.linear_attention import LinearAttention
from .qwen3_5_text import EMBED_TOKENS, LAYER, LAYER_TYPES, LAYERS, LM_HEAD, LN_FINAL, layer_parts, text_config  # noqa: F401


MODEL_TYPES = ("olmo_hybrid",)
DECODER_LAYER = MODELING.OlmoHybridLinearAttentionDecoderLayer
COMPONENTS = {
    # The attention blocks are a second decoder-block class, served by the same `Layer`.
    MODELING.OlmoHybridAttentionDecoderLayer: LAYER,
    MODELING.OlmoHybridAttention: Attention,
    MODELING.OlmoHybridGatedDeltaNet: LinearAttention,
}
MIXER = LinearAttention
