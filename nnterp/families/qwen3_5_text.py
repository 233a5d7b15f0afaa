"""Qwen3.5 (text): a hybrid of gated DeltaNet and softmax attention blocks."""

from contextlib import AbstractContextManager, nullcontext

import torch
import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as MODELING
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

from ..components.attention import Attention
from ..components.gated_deltanet import LinearAttention
from ..recurrent.no_cache import TRANSFORMERS_ERROR, RefusedCacheRun
from .base import TINY, RealCheckpoint
from .llama import Llama

#: Family class -> whether the installed transformers runs its all-linear model with a cache (probed once).
_CACHE_REFUSED: dict[type, bool] = {}


def every_fourth_full(layers: int) -> list[str]:
    """``config.layer_types`` of the released hybrids: three DeltaNet blocks, then one attention block."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


class Qwen3_5Text(Llama):
    """Qwen3.5 (text): a hybrid of gated DeltaNet and softmax attention blocks.

    Features of the architecture, as the difference from `llama`: each block holds
    either a gated DeltaNet (``linear_attn``, `LinearAttention`) or gated softmax
    attention (``self_attn``), as ``config.layer_types`` says (three DeltaNet
    blocks in every four on the released checkpoints), then an MLP. The hub's
    Qwen3.5 checkpoints are vision-language ones (``model_type`` ``qwen3_5`` with
    a ``text_config``); ``AutoModelForCausalLM`` loads them as this text model, and
    so does nnterp.

    A model whose layers are *all* gated DeltaNet (no ``full_attention`` in
    ``config.layer_types``, like the ``deltanet`` toy) cannot run with a cache
    on transformers 5.18-5.24: the cache's ``get_seq_length`` raises "can only
    be called on Attention layers" in the causal mask and in ``generate``
    (`nnterp.recurrent.no_cache`). `cache_refused` finds it by running such a
    model; there, a default trace and a default ``generate`` raise
    `~nnterp.core.errors.InvalidArgument` naming ``use_cache=False`` (nnterp
    does not pass it for you: the run would serve other values than it asked
    for), and the values only a cache keeps (``state_output``, the convolution
    windows) say so in ``support()``. With ``use_cache=False`` the states, the
    kernel's arguments, effective attention and ``state_input`` are served,
    and ``generate(..., use_cache=False)`` works (recomputing each step).
    """

    MODELING = MODELING
    CONFIG = Qwen3_5TextConfig
    COMPOSITE_CONFIG = Qwen3_5Config
    MODEL_TYPES = ("qwen3_5_text", "qwen3_5")

    DECODER_LAYERS = (MODELING.Qwen3_5DecoderLayer,)
    COMPONENTS = {MODELING.Qwen3_5Attention: Attention, MODELING.Qwen3_5GatedDeltaNet: LinearAttention}
    MIXER = LinearAttention

    #: ``config.layer_types`` entry -> the standard part of that block.
    LAYER_TYPES = {"linear_attention": "linear_attn", "full_attention": "self_attn"}

    REAL_CHECKPOINTS = {
        "Qwen/Qwen3.5-0.8B": RealCheckpoint(
            dict(
                hidden_size=1024,
                num_hidden_layers=24,
                layer_types=every_fourth_full(24),
                num_attention_heads=8,
                linear_num_key_heads=16,
                linear_num_value_heads=16,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
            ),
            "nnterp's DeltaNet-state recipe, run on that checkpoint (24 blocks, three DeltaNet in every four, "
            "16 value heads of [128, 128] states, 8 attention heads, width-4 convolution; hidden 1024, 16 key heads)",
        ),
    }

    @classmethod
    def cache_refused(cls, config) -> bool:
        """Whether this model has no attention layer and the installed transformers cannot run such a model with a cache.

        Found by behaviour, once per family and process: one forward with a cache of a one-layer random model of
        this family's config class whose layer is recurrent (its RNG forked: the caller's seed is untouched).
        """
        # Only a config whose every layer is of a recurrent kind can be in the trap (the families built on this one
        # name their kinds in LAYER_TYPES, or have no layer_types); the probe decides.
        kinds = set(getattr(cls.text_config(config), "layer_types", None) or ())
        if not kinds or any(cls.LAYER_TYPES.get(kind) != "linear_attn" for kind in kinds):
            return False
        if cls not in _CACHE_REFUSED:
            _CACHE_REFUSED[cls] = cls.probe_cache()
        return _CACHE_REFUSED[cls]

    @classmethod
    def probe_cache(cls) -> bool:
        """Run a one-layer all-linear model of this family with a cache: True where transformers' trap raises."""
        linear = next(kind for kind, part in cls.LAYER_TYPES.items() if part == "linear_attn")
        sizes = dict(cls.tiny_sizes(), **TINY, vocab_size=8, num_hidden_layers=1, layer_types=[linear])
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                model = transformers.AutoModelForCausalLM.from_config(cls.CONFIG(**sizes))
                model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)
            except Exception as error:  # noqa: BLE001  (a config that refuses such a model, OLMo-Hybrid's: no trap)
                return isinstance(error, ValueError) and TRANSFORMERS_ERROR in str(error)
        return False

    @classmethod
    def around_run(cls, model) -> AbstractContextManager:
        """On a model that cannot run with a cache, transformers' error becomes nnterp's, naming use_cache=False."""
        return RefusedCacheRun(model) if cls.cache_refused(model.config) else nullcontext()

    @classmethod
    def text_config(cls, config):
        """The text model's config: the composite's ``text_config``, or the config itself."""
        return config.get_text_config()

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{cls.LAYER_TYPES[kind], "mlp"} for kind in cls.text_config(config).layer_types]

    @classmethod
    def tiny_sizes(cls) -> dict:
        # Three linear layers then one full-attention layer: both kinds of mixer, the full
        # layer last as in the real 3:1 models. Key and value head counts/dims all differ
        # so that a transposed or mis-reshaped recurrent state [heads, k_dim, v_dim] fails loudly.
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=every_fourth_full(4),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            max_position_embeddings=2048,
        )

    @classmethod
    def tiny_config(cls, model_type: str, **tokens):
        """The text model's tiny config, or the vision-language composite the hub ships (a one-block vision tower)."""
        composite = cls.COMPOSITE_CONFIG
        if composite is None or model_type != composite.model_type:
            return super(Qwen3_5Text, cls).tiny_config(model_type, **tokens)
        text = dict(cls.tiny_sizes(), **TINY, **tokens)
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=text["hidden_size"],
            num_position_embeddings=64,
        )
        return composite(text_config=text, vision_config=vision, **TINY)
