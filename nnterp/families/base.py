"""`Family`: what nnterp needs to know about one transformers architecture, declared in one place.

A family is a class in ``nnterp/families/<model_type>.py``, a subclass of its
nearest sibling (`~nnterp.families.llama.Llama`, the plain transformer, is the
root): it inherits every declaration that stays the same and restates only
what differs, in its docstring first ("Features of the architecture, as the
difference from `qwen3_5_moe`: ...") and then in code. The registry
(`nnterp.families.REGISTRY`) finds it by ``config.model_type`` and imports its
file only then.

A family declares, as class attributes:

* ``MODELING``: the transformers modeling module it wraps; ``CONFIG``, the
  config class of its text model (``COMPOSITE_CONFIG``, the vision-language
  composite's, where the hub ships one); ``MODEL_TYPES``, the
  ``config.model_type`` values it serves (the text model's first);
* ``LAYERS``, ``EMBED_TOKENS``, ``LN_FINAL``, ``LM_HEAD``: where the standard
  parts live, as attribute paths from the causal LM;
* ``LAYER``, the component of a decoder block, and ``DECODER_LAYERS``, the HF
  block classes it serves; ``COMPONENTS``, HF module class -> the nnterp
  component that serves it; ``MIXER``, its recurrent mixer component (for
  `route_kernels`; ``None`` on a plain transformer);
* ``REAL_CHECKPOINTS``: published checkpoints' sizes, each with its public
  source (`RealCheckpoint`), where known (the one declaration a subclass
  does not inherit: a sibling's checkpoints are not its own);

and, as class methods: `envoys` (nnsight's ``envoys=`` map), `text_config`
and `layer_parts` (from a config alone, which parts each block has),
`logits_scale` (where the causal LM scales the unembedding's output), and
`tiny_config` (the tiny test config `nnterp.testing` builds checkpoints from).
``NAME`` is the family's name: its file's name and its key in the registry.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

from ..components.mlp import MLP

#: What every tiny test config shares besides the tokenizer's ids: untied embeddings, float32.
TINY = dict(tie_word_embeddings=False, dtype="float32")


@dataclass(frozen=True)
class RealCheckpoint:
    """A published checkpoint's sizes (config fields only, no weights) and the public source they come from."""

    sizes: dict = field(hash=False)
    source: str


class Family:
    """The declarations every family makes (see the module docstring); subclass a sibling, not this."""

    NAME: ClassVar[str] = ""
    MODELING: ClassVar[ModuleType]
    CONFIG: ClassVar[type]
    COMPOSITE_CONFIG: ClassVar[type | None] = None
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()

    LAYERS: ClassVar[str]
    EMBED_TOKENS: ClassVar[str]
    LN_FINAL: ClassVar[str]
    LM_HEAD: ClassVar[str]

    LAYER: ClassVar[type]
    DECODER_LAYERS: ClassVar[tuple[type, ...]] = ()
    COMPONENTS: ClassVar[dict[type, type]] = {}
    MIXER: ClassVar[type | None] = None
    #: Why a left-padded batch's rows differ from each prompt run alone in transformers itself (its forward, or its
    #: decode steps, ignore the padding somewhere), or ``None``: nnterp serves what transformers computes, and says so.
    PADDING_DIFFERS: ClassVar[str | None] = None
    #: Why transformers' forward does not continue a prompt exactly from the cache an earlier call left (a prefill in
    #: chunks differs from the whole prompt's), or ``None``; `nnterp.long_context_profile` runs in chunks only where
    #: it is ``None`` or ``CHUNK_STATE_INPUT`` carries the state instead.
    CHUNKS_DIFFER: ClassVar[str | None] = None
    #: Whether writing each recurrent layer's ``state_input`` (the previous chunk's ``state_output``) with the cache
    #: makes a chunk continue exactly where the forward alone does not (Mamba-1: under `nnterp.fast_states`, which
    #: `nnterp.long_context_profile` turns on).
    CHUNK_STATE_INPUT: ClassVar[bool] = False
    #: Whether giving each softmax layer the causal mask transformers' mask function builds at that layer's index
    #: makes a chunk continue exactly (MiniMax: its forward builds it from block 0's cache, a lightning block that
    #: keeps no keys, so a continued chunk's mask is placed as if the cache were empty).
    CHUNK_MASK: ClassVar[bool] = False
    #: Whether writing each recurrent layer's ``conv_state_input`` (the previous chunk's ``conv_state_output``) is
    #: needed as well (RecurrentGemma, whose prefill convolves over zeros whatever window its block keeps).
    CHUNK_WINDOW_INPUT: ClassVar[bool] = False
    #: The forward's keyword taking the cache a previous call returned (and the output's attribute holding it).
    CACHE_ARGUMENT: ClassVar[str] = "past_key_values"

    REAL_CHECKPOINTS: ClassVar[dict[str, RealCheckpoint]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super(Family, cls).__init_subclass__(**kwargs)
        package, _, stem = cls.__module__.rpartition(".")
        if "NAME" not in cls.__dict__ and package == __name__.rpartition(".")[0]:
            cls.NAME = stem
        if "REAL_CHECKPOINTS" not in cls.__dict__:
            cls.REAL_CHECKPOINTS = {}  # a sibling's published checkpoints are not this family's

    #: Why a padded batch cannot run on this family (its model ignores the attention mask), or ``None``.
    PADDING_REFUSED: ClassVar[str | None] = None

    #: Keyword arguments a trace needs for a backward pass through the model (``{}`` on most families).
    BACKWARD_KWARGS: ClassVar[dict] = {}

    #: The parts of a block in the order its forward computes them (readers of several values follow it).
    PART_ORDER: ClassVar[tuple[str, ...]] = ("self_attn", "linear_attn", "mlp")

    @classmethod
    def envoys(cls) -> dict:
        """nnsight's ``envoys=`` map: HF module class -> the component that serves it.

        The module at each block's ``LAYER.MLP`` attribute gets `~nnterp.components.mlp.MLP`
        by path (``"model.layers.*.mlp"``), whatever its class, unless ``COMPONENTS``
        maps its class (a class key wins in nnsight's lookup: Nemotron-H's ``mixer``).
        """
        by_path = {f"{cls.LAYERS}.*.{cls.LAYER.MLP}": MLP} if getattr(cls.LAYER, "MLP", None) else {}
        return {**{block: cls.LAYER for block in cls.DECODER_LAYERS}, **cls.COMPONENTS, **by_path}

    @classmethod
    def around_run(cls, model: Any) -> AbstractContextManager:
        """What nnterp does around every run of the HF ``model`` (a trace, a generate): nothing on most families.

        RWKV's undoes the weight rescaling transformers' eval forward makes in place, so a run leaves the weights as
        it found them.
        """
        return nullcontext()

    @classmethod
    def cache_refused(cls, config: Any) -> bool:
        """Whether the installed transformers cannot run this model with a cache (False on most families).

        Qwen3.5's says True for a model with no attention layer (`nnterp.recurrent.no_cache`): nnterp then says
        ``use_cache=False`` where it would say "run it with use_cache=True", and turns transformers' error into its own.
        """
        return False

    @classmethod
    def text_config(cls, config: Any) -> Any:
        """The config of the text model (the composite's ``text_config`` where there is one)."""
        return config

    @classmethod
    def logits_scale(cls, config: Any) -> float:
        """The factor the causal LM multiplies the unembedding's output by to give its logits (1 on most families)."""
        return 1.0

    @classmethod
    def logits_softcap(cls, config: Any) -> float | None:
        """The cap ``c`` where the causal LM soft-caps its logits (``c * tanh(logits / c)``, after `logits_scale`), else ``None``."""
        return None

    @classmethod
    def first_cache(cls, config: Any) -> Any:
        """The cache a sequence's first call is passed, for the later ones to continue, where the forward returns
        none (RecurrentGemma); ``None``: the forward makes one and returns it."""
        return None

    @classmethod
    def zero_carried_context(cls, cache: Any, layer: int) -> None:
        """Zero, in ``cache``, what ``layer`` carries from earlier tokens outside its recurrent mixer's state and
        window (RWKV-4: the channel mix's token shift), so that a reset of the layer's state forgets all of the
        context (`nnterp.long_context_profile`'s effective memory); nothing on most families."""

    @classmethod
    def continues_chunks(cls) -> bool:
        """Whether nnterp continues a prompt exactly from the cache an earlier call left: transformers' forward
        does, or nnterp mends it (``CHUNK_STATE_INPUT``, ``CHUNK_MASK``)."""
        return cls.CHUNKS_DIFFER is None or cls.CHUNK_STATE_INPUT or cls.CHUNK_MASK

    @classmethod
    def layer_parts(cls, config: Any) -> list[set[str]]:
        """The standard parts each block has (``{"self_attn", "mlp"}``, ...), from the config alone."""
        raise NotImplementedError(f"{cls.__name__} declares no layer_parts")

    @classmethod
    def tiny_sizes(cls) -> dict:
        """The tiny test config's sizes: the smallest that still exercise the architecture."""
        raise NotImplementedError(f"{cls.__name__} declares no tiny_sizes")

    @classmethod
    def tiny_config(cls, model_type: str, **tokens: Any) -> Any:
        """The tiny test config of ``model_type`` (one of ``MODEL_TYPES``).

        ``tokens`` are the tokenizer's fields (``vocab_size`` and the special
        ids) that `nnterp.testing.tiny_config` passes from its tiny tokenizer.
        """
        cls._check(model_type)
        return cls.CONFIG(**cls.tiny_sizes(), **TINY, **tokens)

    @classmethod
    def real_config(cls, checkpoint: str) -> Any:
        """The text config of a published checkpoint, built from `REAL_CHECKPOINTS`' sizes (the config class's defaults otherwise)."""
        return cls.CONFIG(**cls.REAL_CHECKPOINTS[checkpoint].sizes)

    @classmethod
    def _check(cls, model_type: str) -> None:
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(f"{cls.__name__} serves model_type {', '.join(cls.MODEL_TYPES)}, not {model_type!r}")
