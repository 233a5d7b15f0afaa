"""Nemotron-H: a pattern of Mamba-2, attention, MLP and MoE blocks, one part per block."""

import transformers.models.nemotron_h.modeling_nemotron_h as MODELING
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.state_space import StateSpace
from .mamba2 import Mamba2


class NemotronHLayer(Layer):
    """A Nemotron-H block: a norm and one part, HF's ``mixer``, which is the block's ``mlp`` when it is an MLP or MoE."""

    MLP = "mixer"

    def __init__(self, *args, **kwargs) -> None:
        super(NemotronHLayer, self).__init__(*args, **kwargs)
        if self.self_attn is not None or self.linear_attn is not None:
            object.__setattr__(self, "mlp", None)  # the `mixer` child is the block's sequence mixer, not an MLP


class NemotronH(Mamba2):
    """Nemotron-H: a pattern of Mamba-2, attention, MLP and MoE blocks, one part per block.

    Features of the architecture, as the difference from `mamba2`: every block is
    a norm and *one* part, which HF keeps at the block's ``mixer`` whatever it is,
    as ``config.layers_block_type`` says (the hub's configs write it as
    ``hybrid_override_pattern``, one letter a block: ``M`` Mamba-2, ``*``
    attention, ``-`` MLP, ``E`` MoE, which the config turns into the list):
    a Mamba-2 mixer (``linear_attn``, `StateSpace`, with grouped B and C,
    ``n_groups > 1``), softmax attention (``self_attn``), or a feed-forward
    block (``mlp``: a squared-ReLU MLP, or the whole sparse block, router,
    experts and shared expert, HF's ``NemotronHMoE``). So a block has exactly
    one of ``linear_attn``, ``self_attn``, ``mlp``, and the others are ``None``.
    The parts live under ``model`` (``model.embeddings``, ``model.norm_f``).

    The Mamba-2 step size has a lower bound only, ``time_step_min`` (the
    mixer's ``time_step_limit``; ``config.time_step_limit`` is not read), which
    transformers applies in the prompt's chunk scan (``dt_limit``) and *not* in
    the decode step's ``mamba2_selective_state_update``: where the bound bites,
    a prompt and the same tokens fed one by one differ. nnterp serves each call
    as its kernel computes it (``betas`` on a prompt are clamped, on a decode
    step they are not).
    """

    MODELING = MODELING
    CONFIG = NemotronHConfig
    MODEL_TYPES = ("nemotron_h",)

    LAYERS = "model.layers"
    EMBED_TOKENS = "model.embeddings"
    LN_FINAL = "model.norm_f"

    LAYER = NemotronHLayer
    DECODER_LAYERS = (MODELING.NemotronHBlock,)
    COMPONENTS = {MODELING.NemotronHAttention: Attention, MODELING.NemotronHMamba2Mixer: StateSpace}
    MIXER = StateSpace
    CHUNKS_DIFFER = None  # its forward continues a prompt from the cache

    #: ``config.layers_block_type`` entry -> the standard part of that block.
    BLOCK_TYPES = {"linear_attention": "linear_attn", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{cls.BLOCK_TYPES[kind]} for kind in cls.text_config(config).layers_block_type]

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            # Every kind of block, as the released patterns start ("M-M-M-M*-..." on
            # Nemotron-H, "MEMEM*E..." on Nemotron 3): Mamba-2, MoE, Mamba-2, attention, MLP.
            layers_block_type=["linear_attention", "moe", "linear_attention", "full_attention", "mlp"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,  # grouped B and C, as the released models (8 groups)
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,  # small, so ordinary prompts span several chunks
            # The step's lower bound (`time_step_min`, 0.001 released) also sets the init range of
            # dt_bias; here it sits below every step the tiny weights make (dt_bias is floored at
            # `time_step_floor`), because transformers' decode kernel ignores the bound its chunk
            # scan applies, and the oracles continue token by token (see the class docstring).
            time_step_min=1e-5,
            time_step_floor=1e-3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            n_shared_experts=1,
            max_position_embeddings=2048,
        )
