"""nnterp 1.x's ``nnterp.rename_utils``: 1.x's renaming tables, config look-ups, accessors and load-time checks.

nnterp 2 does not find a model's parts by renaming (each family declares its
paths, ``nnterp/families/<model_type>.py``); these are 1.x's names for code
that uses them directly:

* the tables (``MODEL_NAMES``, ``LAYER_NAMES``, ... `get_rename_dict`): the
  nnsight ``rename`` dict 1.x built, with a `RenameConfig`'s names first;
* `get_num_attention_heads` / `get_hidden_size` / `get_vocab_size`: a config
  look-up over 1.x's key lists;
* `LayerAccessor` (1.x's ``(model, attr_name, io_type)`` accessor);
* `AttentionProbabilitiesAccessor`, `AttnProbFunction` and the finders
  ``*_attention_prob_source``: 1.x's attention probabilities, defined in
  `nnterp.attention_prob_sources`; on a `StandardizedTransformer` the
  accessor reads each layer's ``self_attn.attention_probabilities``;
* `check_model_renaming` / `check_io`: 1.x's shape checks of the standard names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch as th

from . import families, utils

# 1.x's attention-probability names, at their 1.x path (see the module docstring).
from .attention_prob_sources import (  # noqa: F401
    AttentionProbabilitiesAccessor,
    AttnProbFunction,
    bloom_attention_prob_source,
    default_attention_prob_source,
    gpt2_attention_prob_source,
    gptj_attention_prob_source,
)
from .core.errors import InvalidArgument, RenamingError
from .logging import logger
from .utils import try_with_scan

IgnoreType = Literal["mlp", "attention"]


@dataclass
class RenameConfig:
    """1.x's names of a model's modules (each a name or a list of names) and config keys, for `get_rename_dict` and the look-ups.

    ``attn_name`` / ``mlp_name`` / ``ln_final_name`` / ``lm_head_name`` /
    ``model_name`` / ``layers_name``: renamed to ``self_attn`` / ``mlp`` /
    ``ln_final`` / ``lm_head`` / ``model`` / ``layers``. ``*_config_key``: an
    extra config key (or the value itself, an int). ``StandardizedTransformer``
    of nnterp 2 does not take one (a new architecture is a family).
    """

    attn_name: str | list[str] | None = None
    mlp_name: str | list[str] | None = None
    ln_final_name: str | list[str] | None = None
    lm_head_name: str | list[str] | None = None
    model_name: str | list[str] | None = None
    layers_name: str | list[str] | None = None
    attn_prob_source: AttnProbFunction | None = None
    ignore_mlp: bool | None = None
    ignore_attn: bool | None = None
    attn_head_config_key: str | list[str] | int | None = None
    hidden_size_config_key: str | list[str] | int | None = None
    vocab_size_config_key: str | list[str] | int | None = None


MODEL_NAMES = ["transformer", "gpt_neox", "decoder", "language_model"]


def expand_path_with_model(paths: list[str]) -> list[str]:
    """``paths`` plus each ``model.x`` path under every name of `MODEL_NAMES` (``model.transformer.x``, ...)."""
    expanded = [[path.replace("model.", f"model.{name}.") for path in paths if path.startswith("model.")] for name in MODEL_NAMES]
    return paths + sum(expanded, [])


def default_attn_head_config_keys() -> list[str]:
    return ["n_heads", "num_attention_heads", "n_head", "num_heads"]


def default_hidden_size_config_keys() -> list[str]:
    return ["hidden_size", "d_model", "n_embd"]


def default_vocab_size_config_keys() -> list[str]:
    return ["vocab_size", "n_vocab"]


ATTENTION_NAMES = ["attn", "self_attention", "attention", "norm_attn_norm"]
LAYER_NAMES = expand_path_with_model(["h", "blocks", "model.layers"])
LN_NAMES = expand_path_with_model(["final_layer_norm", "ln_f", "norm_f", "norm", "embedding_norm", "model.ln_final"])
LM_HEAD_NAMES = ["embed_out"]
MLP_NAMES = ["block_sparse_moe", "ffn"]
EMBED_TOKENS_NAMES = expand_path_with_model(["wte", "embed_in", "word_embeddings", "model.embed_tokens"])


def __getattr__(name: str) -> Any:
    if name == "IGNORE_MLP_MODELS":  # models with no MLP module; a transformers class, imported on first use
        return (utils.OPTForCausalLM,)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_rename_dict(rename_config: RenameConfig | None = None) -> dict[str, str]:
    """1.x's nnsight ``rename`` dict: ``{module name or path: standard name}``, a `RenameConfig`'s names, then 1.x's tables."""
    rename_dict: dict[str, str] = {}
    if rename_config is not None:
        for standard, names in (
            ("model", rename_config.model_name), ("layers", rename_config.layers_name), ("self_attn", rename_config.attn_name),
            ("mlp", rename_config.mlp_name), ("ln_final", rename_config.ln_final_name), ("lm_head", rename_config.lm_head_name),
        ):
            for name in [names] if isinstance(names, str) else names or []:
                rename_dict[name] = standard
    rename_dict.update(
        {name: "model" for name in MODEL_NAMES}
        | {name: "layers" for name in LAYER_NAMES}
        | {name: "self_attn" for name in ATTENTION_NAMES}
        | {name: "mlp" for name in MLP_NAMES}
        | {name: "ln_final" for name in LN_NAMES}
        | {name: "lm_head" for name in LM_HEAD_NAMES}
        | {name: "embed_tokens" for name in EMBED_TOKENS_NAMES}
    )
    return rename_dict


def text_config(model: Any) -> Any:
    """The model's config, or its ``text_config`` on a composite (a vision-language model)."""
    cfg = model.config
    return cfg.text_config if "text_config" in cfg else cfg


def _config_value(model: Any, keys: list[str], extra: Any, what: str) -> Any:
    """The first of ``keys`` (and ``extra``: a key, a list of keys, or the value itself) the text config has; ``None`` if none."""
    if isinstance(extra, int):
        return extra
    if isinstance(extra, str):
        keys.append(extra)
    elif isinstance(extra, list):
        keys.extend(extra)
    elif extra is not None:
        raise InvalidArgument(f"Invalid {what} config key: {extra}, expected None, str, list[str] or int")
    cfg = text_config(model)
    return next((getattr(cfg, key) for key in keys if key in cfg), None)


def get_num_attention_heads(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The number of attention heads in the model's config (1.x's keys, and ``rename_config.attn_head_config_key``)."""
    found = _config_value(model, default_attn_head_config_keys(), rename_config and rename_config.attn_head_config_key, "attn head")
    if found is None and raise_error:
        raise RenamingError(f"No attn head config key found in {model}")
    return found


def get_hidden_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The hidden size in the model's config (1.x's keys, and ``rename_config.hidden_size_config_key``)."""
    found = _config_value(model, default_hidden_size_config_keys(), rename_config and rename_config.hidden_size_config_key, "hidden size")
    if found is None:
        if raise_error:
            raise RenamingError(f"No hidden size config key found in {model}")
        logger.warning(f"Couldn't find the hidden size in {getattr(model, 'name_or_path', model)}: pass hidden_size_config_key in a RenameConfig.")
    return found


def get_vocab_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The vocabulary size in the model's config (1.x's keys, and ``rename_config.vocab_size_config_key``)."""
    found = _config_value(model, default_vocab_size_config_keys(), rename_config and rename_config.vocab_size_config_key, "vocab size")
    if found is None and raise_error:
        raise RenamingError(f"No vocab size config key found in {model}")
    return found


class IOType(Enum):
    """Whether a `LayerAccessor` reads a module's input or its output."""

    INPUT = "input"
    OUTPUT = "output"


class LayerAccessor:
    """1.x's accessor: ``accessor[i]`` is ``model.layers[i]`` (or its ``attr_name`` submodule), its input or output (``io_type``).

    A tuple input or output gives (and a write replaces) its first element;
    every layer must agree on being a tuple, as 1.x checked.
    ``StandardizedTransformer``'s own accessors are `nnterp.accessors.LayerAccessor`.
    """

    def __init__(self, model: Any, attr_name: str | None, io_type: IOType | None) -> None:
        self.model = model
        self.attr_name = attr_name
        self.io_type = io_type
        self._detected_is_tuple: bool | None = None

    def get_module(self, layer: int) -> Any:
        module = self.model.layers[layer]
        return module if self.attr_name is None else getattr(module, self.attr_name)

    def __getitem__(self, layer: int) -> Any:
        module = self.get_module(layer)
        if self.io_type is None:
            return module
        target = module.input if self.io_type is IOType.INPUT else module.output
        if self._detected_is_tuple is None:
            self._detected_is_tuple = isinstance(target, tuple)
        elif isinstance(target, tuple) != self._detected_is_tuple:
            raise RenamingError(
                f"Inconsistent tuple types detected: layer {layer} has {'tuple' if isinstance(target, tuple) else 'non-tuple'} "
                f"but expected {'tuple' if self._detected_is_tuple else 'non-tuple'}"
            )
        return target[0] if self._detected_is_tuple else target

    def __setitem__(self, layer: int, value: Any) -> None:
        if self.io_type is None:
            raise InvalidArgument(f"Cannot set the value of a module accessor. Did you mean {self.attr_name or 'layers'}_input/output")
        module = self.get_module(layer)
        name = self.io_type.value
        setattr(module, name, (value, *getattr(module, name)[1:]) if self._detected_is_tuple else value)

    def __call__(self, layer: int) -> Any:
        return self[layer]

    @property
    def returns_tuple(self) -> bool | None:
        """Whether the value is a tuple, ``None`` until it has been read once."""
        return self._detected_is_tuple


def get_ignores(model: Any, rename_config: RenameConfig | None = None) -> list[str]:
    """The parts 1.x's check skips for ``model`` (a transformers model): ``"attention"`` by ``rename_config``;
    ``"mlp"`` by it, on OPT (no MLP module), and where nnterp's family for the model has a block without an MLP
    (Mamba, Mamba-2, Falcon-Mamba; the hybrids' recurrent blocks), so ``mlps_output[i]`` fails for some ``i``."""
    ignores = []
    if isinstance(model, utils.OPTForCausalLM):
        logger.warning(f"{type(model).__name__} does not have a mlp module. You'll have to manually use layers.fc1 and layers.fc2 instead.")
        ignores.append("mlp")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None) in families.REGISTRY:
        if any("mlp" not in parts for parts in families.family_for(config).layer_parts(config)):
            logger.warning(f"{type(model).__name__} has blocks without a mlp module.")
            ignores.append("mlp")
    if rename_config is not None:
        if rename_config.ignore_mlp:
            ignores.append("mlp")
        if rename_config.ignore_attn:
            ignores.append("attention")
    return ignores


def check_io(std_model: Any, model_name: str, ignores: list[IgnoreType]) -> None:
    """Inside a trace or scan: every standard value of layer 0 (and the final norm's, the unembedding's) is a ``[batch, seq, hidden]`` tensor."""
    batch_size, seq_len = std_model.input_size
    hidden_size = std_model.hidden_size
    if hidden_size is None:
        raise RenamingError(f"Can't check the shapes of {model_name}'s internals: its hidden size is not known.")
    values = [("token_embeddings", lambda: std_model.token_embeddings), ("layers_input[0]", lambda: std_model.layers_input[0])]
    if "attention" not in ignores:
        values += [("attentions_input[0]", lambda: std_model.attentions_input[0]), ("attentions_output[0]", lambda: std_model.attentions_output[0])]
    if "mlp" not in ignores:
        values += [("mlps_input[0]", lambda: std_model.mlps_input[0]), ("mlps_output[0]", lambda: std_model.mlps_output[0])]
    values += [("layers_output[0]", lambda: std_model.layers_output[0]), ("ln_final.output", lambda: std_model.ln_final.output)]
    for name, read in values:
        value = read()
        if not isinstance(value, th.Tensor):
            raise RenamingError(f"{name} is not a tensor in {model_name} architecture. Found type {type(value)}. This means it's not properly initialized.")
        if tuple(value.shape) != (batch_size, seq_len, hidden_size):
            raise RenamingError(f"{name} has shape {tuple(value.shape)} != {(batch_size, seq_len, hidden_size)} in {model_name} architecture.")
    logits = std_model.lm_head.output
    if not isinstance(logits, th.Tensor):
        raise RenamingError(f"lm_head.output is not a tensor in {model_name} architecture. Found type {type(logits)}.")
    vocab = std_model.vocab_size
    if tuple(logits.shape[:-1]) != (batch_size, seq_len) or (vocab is not None and logits.shape[-1] != vocab):
        raise RenamingError(f"lm_head.output has shape {tuple(logits.shape)} != {(batch_size, seq_len, vocab or '<vocab_size>')} in {model_name} architecture.")


def check_model_renaming(std_model: Any, model_name: str, ignores: list[IgnoreType], allow_dispatch: bool, allow_multimodal: bool = False) -> None:
    """1.x's load-time check: the standard modules exist, the layers are of one type, and `check_io` passes (under a scan, else a trace)."""
    for name in ("layers", "ln_final", "lm_head"):
        if not hasattr(std_model, name):
            raise RenamingError(f"Could not find {name} module in {model_name} architecture. This means that it was not properly renamed.")
    if not allow_multimodal:
        types = {type(layer._module) for layer in std_model.layers}
        if len(types) > 1:
            raise RenamingError(
                f"Model {model_name} has heterogeneous layer types: {', '.join(sorted(t.__name__ for t in types))}. "
                "If you want to use this model anyway, pass allow_multimodal=True."
            )
    for part, ignore in (("self_attn", "attention"), ("mlp", "mlp")):
        if ignore not in ignores and getattr(std_model.layers[0], part, None) is None:
            raise RenamingError(f"Could not find {part} module in {model_name} architecture. This means that it was not properly renamed.")
    try_with_scan(
        std_model, lambda: check_io(std_model, model_name, ignores), RenamingError(f"Could not check the IO of {model_name}"),
        allow_dispatch, errors_to_raise=(RenamingError,),
    )
