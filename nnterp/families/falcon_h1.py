"""Falcon-H1: Mamba-2 and softmax attention in parallel inside every block, with μP multipliers."""

import transformers.models.falcon_h1.modeling_falcon_h1 as MODELING
from transformers.models.falcon_h1.configuration_falcon_h1 import FalconH1Config

from ..components.attention import Attention
from ..components.state_space import StateSpace
from .bamba import Bamba


class FalconH1(Bamba):
    """Falcon-H1: Mamba-2 and softmax attention in parallel inside every block, with μP multipliers.

    Features of the architecture, as the difference from `bamba`: every block
    has *both* mixers, run on the same normed input and summed into the
    residual stream: a Mamba-2 mixer (HF's ``mamba``, ``linear_attn``) and
    softmax attention (``self_attn``), then the MLP (HF's ``feed_forward``,
    ``mlp``). So every layer has ``linear_attn``, ``self_attn`` and ``mlp``.

    Its multipliers (μP), and where they apply relative to the values nnterp serves:

    * ``embedding_multiplier``: after ``embed_tokens`` (its output is before,
      ``layers[0].layer_input`` after);
    * ``ssm_in_multiplier`` and ``ssm_multipliers`` (one per section of the
      input projection: z, x, B, C, dt): inside the mixer, before the kernel,
      so ``attention_values`` (x), ``attention_keys`` (B),
      ``attention_queries`` (C) and ``dt`` are served *after* them;
    * ``ssm_out_multiplier``: on the mixer's output in the block,
      ``linear_attn.attention_output`` is before it;
    * ``attention_in_multiplier``: on the attention's input, in the block
      (``self_attn``'s input is after it); ``key_multiplier``: on the keys,
      inside ``self_attn``; ``attention_out_multiplier``: on its output in the
      block, ``self_attn.attention_output`` is before it. ``layer_output`` is
      the residual plus both scaled outputs, then plus the MLP's;
    * ``mlp_multipliers`` (gate, down): inside ``mlp``;
    * ``lm_head_multiplier``: the causal LM multiplies the unembedding's output
      by it; ``model.logits`` and ``next_token_probs`` are after it (transformers'
      logits, `logits_scale`), ``lm_head.output`` before.
    """

    MODELING = MODELING
    CONFIG = FalconH1Config
    MODEL_TYPES = ("falcon_h1",)

    DECODER_LAYERS = (MODELING.FalconH1DecoderLayer,)
    COMPONENTS = {MODELING.FalconH1Attention: Attention, MODELING.FalconH1Mixer: StateSpace}
    MIXER = StateSpace

    @classmethod
    def logits_scale(cls, config) -> float:
        return cls.text_config(config).lm_head_multiplier

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{"linear_attn", "self_attn", "mlp"} for _ in range(cls.text_config(config).num_hidden_layers)]

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_ssm=128,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,  # small, so ordinary prompts span several chunks
            # Multipliers none of them 1, so a misplaced one shows.
            embedding_multiplier=2.0,
            lm_head_multiplier=2.0,  # > 1 keeps the random head informative (0.5 flattens it)
            mlp_multipliers=[0.8, 0.6],
            key_multiplier=0.7,
            attention_in_multiplier=1.2,
            attention_out_multiplier=0.9,
            ssm_multipliers=[0.9, 0.8, 1.1, 1.2, 0.7],
            ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.8,
            max_position_embeddings=2048,
            # transformers draws the mixer's convolution N(0, initializer_range), and the tiny
            # checkpoint keeps convolutions as made (`_sharpen`): at the default 0.02 x, B and C
            # come out ~50x smaller than the mixer's input, so the recurrent state barely reaches
            # the output (a decode step's state, even 30x a random one, leaves the greedy ids).
            # 0.3 is about torch's own init of a width-4 depthwise convolution (mamba2's tiny).
            initializer_range=0.3,
        )
