"""GPT-2: the original pre-norm transformer, learned positions and a fused query/key/value projection."""

import transformers.models.gpt2.modeling_gpt2 as MODELING
from transformers.models.gpt2.configuration_gpt2 import GPT2Config

from ..components.attention import Attention
from .base import RealCheckpoint
from .llama import Llama


class GPT2(Llama):
    """GPT-2: the original pre-norm transformer, learned positions and a fused query/key/value projection.

    Features of the architecture, as the difference from `llama`: the layout is
    ``transformer.h`` (blocks), ``transformer.wte`` (the token embedding, served
    as ``embed_tokens``) and ``transformer.ln_f`` (the final LayerNorm). Positions
    are a learned table, ``transformer.wpe``, added to the token embedding
    before the first block, so ``layers[0].layer_input`` is ``wte + wpe``, not
    ``embed_tokens``' output. A block (``GPT2Block``) holds its attention at
    ``attn`` (``GPT2Attention``, served as ``self_attn``), which projects
    queries, keys and values with one fused ``c_attn`` (a ``Conv1D``) and
    ``c_proj``; its MLP is ``mlp`` (``c_fc``, GELU, ``c_proj``), not gated.
    LayerNorms with biases throughout; no recurrent state.
    """

    MODELING = MODELING
    CONFIG = GPT2Config
    MODEL_TYPES = ("gpt2",)

    LAYERS = "transformer.h"
    EMBED_TOKENS = "transformer.wte"
    LN_FINAL = "transformer.ln_f"

    DECODER_LAYERS = (MODELING.GPT2Block,)
    COMPONENTS = {MODELING.GPT2Attention: Attention}

    REAL_CHECKPOINTS = {
        "openai-community/gpt2": RealCheckpoint(
            dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
            "transformers' GPT2Config defaults, which its docstring names as that checkpoint's",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=2048)
