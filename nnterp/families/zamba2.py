"""Zamba2: Mamba-2 blocks, some of them preceded by a transformer block shared across depths."""

from typing import Any

import transformers.models.zamba2.modeling_zamba2 as MODELING
from transformers.models.zamba2.configuration_zamba2 import Zamba2Config

from ..components.attention import Attention
from ..components.layer import Layer
from ..components.mlp import MLP
from ..components.state_space import StateSpace
from .bamba import Bamba
from .base import TINY


class Zamba2Layer(Layer):
    """A Zamba2 block: a Mamba-2 block, or a hybrid one (the shared transformer block, a linear map, then a Mamba-2 block).

    A hybrid's parts are its children's: ``linear_attn`` is its Mamba-2 block's
    mixer (that block, HF's ``mamba_decoder``, is itself a `Zamba2Layer` envoy),
    ``self_attn`` and ``mlp`` the shared block's attention and feed-forward.
    """

    MLP = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(Zamba2Layer, self).__init__(*args, **kwargs)
        mamba = self._child_map.get("mamba_decoder")  # a hybrid's Mamba-2 block (itself a Zamba2Layer envoy)
        shared = self._child_map.get("shared_transformer")
        if mamba is not None:
            object.__setattr__(self, "linear_attn", mamba.linear_attn)
        if shared is not None:
            object.__setattr__(self, "self_attn", shared._child_map.get("self_attn"))
            object.__setattr__(self, "mlp", shared._child_map.get("feed_forward"))


class Zamba2(Bamba):
    """Zamba2: Mamba-2 blocks, some of them preceded by a transformer block shared across depths.

    Features of the architecture, as the difference from `bamba`: every block
    is a Mamba-2 block (HF's ``Zamba2MambaDecoderLayer``: norm, the mixer
    ``mamba`` exposed as ``linear_attn``, residual; no MLP), and the blocks
    ``config.layers_block_type`` marks ``"hybrid"`` (``config.hybrid_layer_ids``)
    are a ``Zamba2HybridLayer`` that runs, before its Mamba-2 block
    (``mamba_decoder``), a *shared* transformer block (``shared_transformer``):

    * its input is the block's input concatenated with the token embeddings
      (``[batch, seq, 2 * hidden]``, normed), its attention's (``self_attn``)
      output is normed and fed to its MLP (``feed_forward``, exposed as
      ``mlp``; its output is the shared block's);
    * a per-depth ``linear`` maps that output, which is added to the Mamba-2
      block's *input* (before its norm), not to the residual stream: so
      ``layer_output`` is ``layer_input`` plus ``linear_attn.attention_output``,
      and ``self_attn`` / ``mlp`` reach the residual stream only through the
      mixer.

    Shared: the hybrid blocks cycle through ``config.num_mem_blocks`` transformer
    blocks (``block_id`` = hybrid index mod ``num_mem_blocks``). transformers
    builds one ``Zamba2AttentionDecoderLayer`` *per hybrid block* and ties their
    parameters (``Zamba2Model._tied_weights_keys``): at each depth ``self_attn``
    and ``mlp`` are their own modules (their own envoys, so reading them at two
    depths gives each depth's value) holding the same weights. Each depth also
    has its own low-rank adapters inside the shared modules (the MLP's
    ``gate_up_proj_adapter_list``; q, k, v adapters with
    ``use_shared_attention_adapter``), selected by the depth's position among
    the hybrid blocks, so the shared weights compute a different function at
    each depth. transformers 5.24 ties them only when ``tie_word_embeddings``
    is set (it drops a model's whole tie map otherwise), as the released
    checkpoints do; so the tiny checkpoint ties its embeddings too.

    As on `nemotron_h`, the Mamba-2 step size has a lower bound only,
    ``time_step_min`` (the mixer's ``time_step_limit``), which transformers
    applies in the prompt's chunk scan and *not* in the decode step: where it
    bites, a prompt and the same tokens fed one by one differ; nnterp serves
    each call as its kernel computes it.
    """

    MODELING = MODELING
    CONFIG = Zamba2Config
    MODEL_TYPES = ("zamba2",)

    LAYER = Zamba2Layer
    DECODER_LAYERS = (MODELING.Zamba2MambaDecoderLayer, MODELING.Zamba2HybridLayer)
    # The shared block's MLP class is served by the MLP component (a hybrid's `mlp`), by class: no path reaches it.
    COMPONENTS = {MODELING.Zamba2Attention: Attention, MODELING.Zamba2MambaMixer: StateSpace, MODELING.Zamba2MLP: MLP}
    MIXER = StateSpace

    #: A hybrid block runs the shared transformer block (attention, MLP) before its Mamba-2 mixer.
    PART_ORDER = ("self_attn", "mlp", "linear_attn")
    BLOCK_TYPES = {"linear_attention": {"linear_attn"}, "hybrid": {"linear_attn", "self_attn", "mlp"}}

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [set(cls.BLOCK_TYPES[kind]) for kind in cls.text_config(config).layers_block_type]

    @classmethod
    def tiny_config(cls, model_type: str, **tokens: Any) -> Any:
        cls._check(model_type)
        # Tied embeddings: transformers ties the shared blocks only then (see the class docstring).
        return cls.CONFIG(**{**cls.tiny_sizes(), **TINY, "tie_word_embeddings": True, **tokens})

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            # Mamba-2 first, hybrids in between, as the released models (the config's default:
            # a hybrid every sixth block from the seventh); two hybrids, so one block is shared.
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            num_mem_blocks=1,
            use_shared_attention_adapter=True,  # per-depth q, k, v adapters in the shared attention
            adapter_rank=8,
            use_mem_rope=True,
            num_attention_heads=4,  # over the concatenated 2 * hidden: head_dim 32
            n_mamba_heads=4,
            mamba_ngroups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            chunk_size=8,  # small, so ordinary prompts span several chunks
            # The step's lower bound (`time_step_min`, 0.001 released) also sets the init range of
            # dt_bias; here it sits below every step the tiny weights make (dt_bias is floored at
            # `time_step_floor`), because transformers' decode kernel ignores the bound its chunk
            # scan applies, and the oracles continue token by token (see the class docstring).
            time_step_min=1e-5,
            time_step_floor=1e-3,
            max_position_embeddings=2048,
        )
