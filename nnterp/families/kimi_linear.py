"""Kimi-Linear: Kimi delta attention and multi-head latent attention blocks, mostly sparse MLPs.

Features of the architecture, as the difference from `qwen3_5_text`: the
recurrent mixer is Kimi delta attention (`KimiDeltaAttention`: a gated
DeltaNet with one decay per key channel), and the softmax blocks are
multi-head latent attention (MLA). transformers keeps *both* at the block's
``self_attn``; nnterp exposes the delta attention as ``linear_attn`` and the
MLA as ``self_attn``, by component kind, as ``config.layer_types`` places them
(the hub's checkpoints list 1-indexed ``linear_attn_config.full_attn_layers``,
which the config turns into ``layer_types``). ``mlp`` is the whole sparse
block (router, experts, shared experts: HF's ``KimiLinearMoE``), or a dense
MLP where ``config.mlp_layer_types`` says ``"dense"``.
"""

import transformers.models.kimi_linear.modeling_kimi_linear as MODELING

from ..components.attention import Attention
from ..components.kimi_delta_attention import KimiDeltaAttention
from .qwen3_5_text import EMBED_TOKENS, LAYER, LAYER_TYPES, LAYERS, LM_HEAD, LN_FINAL, layer_parts, text_config  # noqa: F401

MODEL_TYPES = ("kimi_linear",)
DECODER_LAYER = MODELING.KimiLinearDecoderLayer
COMPONENTS = {MODELING.KimiLinearAttention: Attention, MODELING.KimiLinearDeltaAttention: KimiDeltaAttention}
MIXER = KimiDeltaAttention
