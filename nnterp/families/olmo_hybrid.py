"""OLMo-Hybrid: gated DeltaNet and softmax attention blocks, each its own block class."""

from __future__ import annotations

import ast
from typing import Any

import transformers.models.olmo_hybrid.modeling_olmo_hybrid as MODELING
from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig
from nnsight.intervention.source import compiled, decorator_chain

from ..components.attention import Attention
from ..components.kernels import _missing
from ..components.linear_attention import LinearAttention
from ..core.errors import NnterpError
from .qwen3_5_text import Qwen3_5Text


def _previous_state_test(forward: Any) -> str:
    """How ``forward`` asks the cache whether it continues a state.

    ``"get_recurrent_state"`` (5.21+: the state is ``None`` until a prompt
    wrote it), ``"has_previous_state(layer)"`` or ``"has_previous_state()"``
    (up to 5.20, with or without the layer index).
    """
    inner = decorator_chain(forward)[0]
    tree = ast.parse(compiled(inner).source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    if any(call.func.attr == "get_recurrent_state" for call in calls):
        return "get_recurrent_state"
    asks = [call for call in calls if call.func.attr == "has_previous_state"]
    if not asks:
        raise NnterpError(_missing("the cache test (`get_recurrent_state` or `has_previous_state`)", inner))
    return "has_previous_state(layer)" if asks[0].args or asks[0].keywords else "has_previous_state()"


class OlmoHybridLinearAttention(LinearAttention):
    """`LinearAttention`, its labels and its cache test found in OLMo-Hybrid's own mixer."""

    #: The installed forward's cache test (`_previous_state_test`), found by `resolve`.
    CACHE_TEST = "get_recurrent_state"

    @classmethod
    def resolve(cls, hf_mixer: type) -> None:
        super().resolve(hf_mixer)
        cls.CACHE_TEST = _previous_state_test(hf_mixer.forward)

    @classmethod
    def continues_cache(cls, module: Any, cache: Any) -> bool:
        if cache is not None and cls.CACHE_TEST == "has_previous_state()":
            return bool(cache.has_previous_state())
        return super().continues_cache(module, cache)


OlmoHybridLinearAttention.resolve(MODELING.OlmoHybridGatedDeltaNet)

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
    component follows whichever test the installed forward makes.
    """

    MODELING = MODELING
    CONFIG = OlmoHybridConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("olmo_hybrid",)

    #: The two block classes, both served by `Layer`.
    DECODER_LAYERS = (MODELING.OlmoHybridLinearAttentionDecoderLayer, MODELING.OlmoHybridAttentionDecoderLayer)
    COMPONENTS = {MODELING.OlmoHybridAttention: Attention, MODELING.OlmoHybridGatedDeltaNet: OlmoHybridLinearAttention}
    MIXER = OlmoHybridLinearAttention

    @classmethod
    def tiny_sizes(cls) -> dict:
        sizes = super().tiny_sizes()
        del sizes["head_dim"]  # OLMo derives it as hidden_size // num_attention_heads
        return sizes
