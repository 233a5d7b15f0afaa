"""OLMo-Hybrid: gated DeltaNet and softmax attention blocks, each its own block class."""

from __future__ import annotations

import transformers.models.olmo_hybrid.modeling_olmo_hybrid as MODELING
from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig

from ..components.attention import Attention
from ..components.gated_deltanet import LinearAttention
from .qwen3_5_text import Qwen3_5Text


class OlmoHybrid(Qwen3_5Text):
    """OLMo-Hybrid: gated DeltaNet and softmax attention blocks, each its own block class.

    Features of the architecture, as the difference from `qwen3_5_text`: the two
    kinds of block are two HF classes (``OlmoHybridLinearAttentionDecoderLayer``
    holding ``linear_attn``, ``OlmoHybridAttentionDecoderLayer`` holding
    ``self_attn``), both served by `Layer`, as ``config.layer_types`` places
    them; every block has a dense ``mlp``. The gated DeltaNet projects q, k, v
    separately, may double β (``allow_neg_eigval``: a write strength in (0, 2),
    so ``betas`` can exceed 1) and serves the same values as Qwen3.5's.

    A quirk of transformers up to 5.20: this mixer decides whether it continues a
    cached state with ``cache.has_previous_state()`` *without* its layer index
    (the last linear block's flag), where the other families pass their own. The
    component follows whichever test the installed forward makes (the label
    ``CACHE_TEST``, found by `nnterp.recurrent.labels.cache_test`).
    """

    MODELING = MODELING
    CONFIG = OlmoHybridConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("olmo_hybrid",)

    #: The two block classes, both served by `Layer`.
    DECODER_LAYERS = (MODELING.OlmoHybridLinearAttentionDecoderLayer, MODELING.OlmoHybridAttentionDecoderLayer)
    COMPONENTS = {MODELING.OlmoHybridAttention: Attention, MODELING.OlmoHybridGatedDeltaNet: LinearAttention}
    MIXER = LinearAttention

    @classmethod
    def tiny_sizes(cls) -> dict:
        sizes = super(OlmoHybrid, cls).tiny_sizes()
        del sizes["head_dim"]  # OLMo derives it as hidden_size // num_attention_heads
        return sizes
