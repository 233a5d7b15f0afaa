"""Granite-4.0 hybrids: Mamba-2 and attention blocks, each with a mixture of experts beside a shared MLP, and scaling multipliers."""

import transformers.models.granitemoehybrid.modeling_granitemoehybrid as MODELING
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.state_space import StateSpace
from .bamba import Bamba


class GraniteMoeHybridLayer(Layer):
    """A Granite-4.0 block: ``mlp`` is the mixture of experts (``block_sparse_moe``), or the shared MLP on a dense config."""

    MLP = "block_sparse_moe"

    def __init__(self, *args, **kwargs) -> None:
        super(GraniteMoeHybridLayer, self).__init__(*args, **kwargs)
        if self.mlp is None:  # no experts (num_local_experts=0): the shared MLP is the whole feed-forward
            object.__setattr__(self, "mlp", self._child_map.get("shared_mlp"))


class GraniteMoeHybrid(Bamba):
    """Granite-4.0 hybrids: Mamba-2 and attention blocks, each with a mixture of experts beside a shared MLP, and scaling multipliers.

    Features of the architecture, as the difference from `bamba`: the blocks'
    kinds are ``config.layer_types`` itself. The feed-forward half is a mixture
    of experts (HF's ``block_sparse_moe``, exposed as ``mlp``) *plus* a shared
    MLP run on the same input (HF's ``shared_mlp``, reachable under that name on
    the layer): their outputs are summed, so ``mlp`` is the routed part only; on
    a dense config (``num_local_experts=0``) ``mlp`` is the shared MLP.

    Four multipliers, and where they apply relative to the values nnterp serves:

    * ``embedding_multiplier``: the model multiplies ``embed_tokens``' output
      by it before the first block, so ``embed_tokens.output`` is *before* it
      and ``layers[0].layer_input`` after;
    * ``residual_multiplier``: each block adds ``residual_multiplier`` times
      its mixer's output (``linear_attn.attention_output`` /
      ``self_attn.attention_output``, served before the multiplier) and times
      its feed-forward output; ``layer_output`` is after;
    * ``attention_multiplier``: the attention's softmax scale (in place of
      1/√head_dim), inside ``self_attn``;
    * ``logits_scaling``: the causal LM divides the unembedding's output by it;
      ``model.logits`` and ``next_token_probs`` are after it, equal to
      transformers' logits (`logits_scale`), while ``lm_head.output`` is before.
    """

    MODELING = MODELING
    CONFIG = GraniteMoeHybridConfig
    MODEL_TYPES = ("granitemoehybrid",)

    LN_FINAL = "model.norm"

    LAYER = GraniteMoeHybridLayer
    DECODER_LAYERS = (MODELING.GraniteMoeHybridDecoderLayer,)
    COMPONENTS = {MODELING.GraniteMoeHybridAttention: Attention, MODELING.GraniteMoeHybridMambaLayer: StateSpace}
    MIXER = StateSpace

    @classmethod
    def logits_scale(cls, config) -> float:
        return 1.0 / cls.text_config(config).logits_scaling

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=32,  # each expert's
            shared_intermediate_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,  # small, so ordinary prompts span several chunks
            # Multipliers none of them 1, so a misplaced one shows (smaller than the released
            # 12 and 0.22, which on random weights drown the mixers' effect on the next token).
            embedding_multiplier=2.0,
            residual_multiplier=0.8,
            attention_multiplier=0.0625,
            logits_scaling=0.5,  # divides: < 1 keeps the random head informative (the released 8 flattens it)
            max_position_embeddings=2048,
        )
