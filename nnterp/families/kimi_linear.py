"""Kimi-Linear: Kimi delta attention and multi-head latent attention blocks, mostly sparse MLPs."""

import transformers.models.kimi_linear.modeling_kimi_linear as MODELING
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

from ..components.attention import Attention
from ..components.kimi_delta_attention import KimiDeltaAttention
from .qwen3_5_text import Qwen3_5Text, every_fourth_full


class KimiLinear(Qwen3_5Text):
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

    MODELING = MODELING
    CONFIG = KimiLinearConfig
    COMPOSITE_CONFIG = None
    MODEL_TYPES = ("kimi_linear",)

    DECODER_LAYERS = (MODELING.KimiLinearDecoderLayer,)
    COMPONENTS = {MODELING.KimiLinearAttention: Attention, MODELING.KimiLinearDeltaAttention: KimiDeltaAttention}
    MIXER = KimiDeltaAttention

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            # Kimi's own default puts full attention at i % 4 == 0 (i > 0), so 4
            # layers would be all linear; hub checkpoints instead list
            # 1-indexed `linear_attn_config.full_attn_layers`. Be explicit.
            layer_types=every_fourth_full(4),
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_attention_heads=4,
            num_key_value_heads=4,  # MLA expands the latent to every head
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            linear_num_heads=4,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            max_position_embeddings=2048,
        )
