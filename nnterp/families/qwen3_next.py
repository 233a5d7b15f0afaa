"""Qwen3-Next: the hybrid Qwen3.5-MoE descends from, with a fused input projection.

Features of the architecture, as the difference from `qwen3_5_moe`: the gated
DeltaNet projects q, k, v, z and β, a in two fused matrices (``in_proj_qkvz``,
``in_proj_ba``) grouped by key head, then reorders them, so it reaches the
same kernel with the same arguments and serves the same values. A block's
``mlp`` is the sparse block (HF's ``Qwen3NextSparseMoeBlock``), or a dense MLP
on the layers ``config.mlp_only_layers`` and ``decoder_sparse_step`` make
dense. Text only: there is no composite config.
"""

import transformers.models.qwen3_next.modeling_qwen3_next as MODELING

from ..components.attention import Attention
from ..components.linear_attention import LinearAttention
from .qwen3_5_moe import EMBED_TOKENS, LAYER, LAYER_TYPES, LAYERS, LM_HEAD, LN_FINAL, layer_parts, text_config  # noqa: F401


MODEL_TYPES = ("qwen3_next",)
DECODER_LAYER = MODELING.Qwen3NextDecoderLayer
COMPONENTS = {MODELING.Qwen3NextAttention: Attention, MODELING.Qwen3NextGatedDeltaNet: LinearAttention}
MIXER = LinearAttention
