"""What `StandardizedTransformer` does with its arguments before nnsight builds the model, and its load-time check.

* `model_config`: the config the ``model`` argument names (a hub id, a folder
  saved with ``save_pretrained``, a loaded ``PreTrainedModel``), or a
  `LoadError` saying what is wrong with it and the fix;
* `constructor_keywords`: nnterp 1.x's keywords popped from the others
  (``enable_attention_probs``, ``check_renaming``; those refused, those
  ignored), and every keyword that nothing would take refused now;
* `standard_aliases`: the nnsight ``rename`` map that puts the standard names
  (``layers``, ``embed_tokens``, ``ln_final``, ``lm_head``, 1.x's ``model``) on
  the family's paths;
* `check_standard_names`: 1.x's ``check_renaming=True``, one forward checking
  every standard value's shape;
* `transformers_own_config`: the config again through transformers' own class
  where another package registered its own for a model type nnterp serves
  (flash-linear-attention does so for ``mamba2`` when transformers imports it).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch

from .accessors import token_mixer
from .core.errors import InvalidArgument, LoadError, SignatureError, UnsupportedModel, WrongType
from .families import REGISTRY


def folder_config(path: str) -> Any:
    """A saved folder's config, or a `LoadError` (one line) saying what is wrong with its config.json and the fix."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json")
    fix = "pass a folder written by save_pretrained, or fix its config.json"
    if not os.path.isfile(file):
        raise LoadError(f"{path!r} has no config.json: {fix}")
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise LoadError(f"{file!r} is not valid JSON ({' '.join(str(error).split())}): {fix}") from error
    if not isinstance(data, dict):
        raise LoadError(f"{file!r} holds a JSON {type(data).__name__}, not an object of config fields: {fix}")
    if "model_type" not in data:
        raise LoadError(f"{file!r} has no `model_type` field (the family, e.g. \"qwen3_5_text\"): {fix}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:  # a field of the wrong type, an unknown model_type: transformers says which
        raise LoadError(f"could not read {file!r}: {' '.join(str(error).split())}; {fix}") from error


def model_config(model: Any, revision: str | None = None) -> Any:
    """The config of what ``StandardizedTransformer(model)`` names: a loaded model's own, a folder's, or the hub's at ``revision``."""
    from transformers import AutoConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model.config
    if not isinstance(model, (str, os.PathLike)):
        raise WrongType(
            f"StandardizedTransformer takes a hub id, a folder saved with save_pretrained, or a loaded "
            f"PreTrainedModel; got {type(model).__name__}"
        )
    path = os.fspath(model)
    if os.path.isdir(path):
        return transformers_own_config(folder_config(path), lambda: folder_config(path))
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1  # a hub id is "owner/name"
    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except Exception as error:
        where = "no folder exists at that path" if looks_local else "the hub could not serve it"
        raise LoadError(
            f"could not load {path!r}: {where} ({type(error).__name__}: {error}). Pass a folder saved with "
            "save_pretrained, a hub id this machine can reach, or a loaded model with tokenizer="
        ) from error
    return transformers_own_config(config, lambda: AutoConfig.from_pretrained(path, revision=revision))


class ForeignRegistration(UserWarning):
    """Another package had registered its own classes for a model type nnterp serves through transformers' classes."""


def transformers_own_config(config: Any, reload: Any) -> Any:
    """``config``, or the same checkpoint's config through transformers' own class, re-registered for its model type.

    A package may register its own config and model classes for a model type
    transformers ships: flash-linear-attention registers its ``Mamba2Config``
    and ``Mamba2ForCausalLM`` for ``"mamba2"`` (``exist_ok=True``), and
    transformers imports it when a modeling module binds its hub kernels. The
    checkpoint would then load as that package's model, which has none of the
    module paths nnterp's family knows (its mixer would be a plain envoy, with no
    ``linear_attn`` value served). So nnterp registers transformers' class for
    that model type again (process-wide: ``AutoConfig`` maps the type back to
    transformers, and ``AutoModelForCausalLM`` follows the config's class),
    warns once with `ForeignRegistration`, and reads the config again.
    ``reload`` reads the checkpoint's config.
    """
    from transformers import AutoConfig

    model_type = getattr(config, "model_type", None)
    if type(config).__module__.startswith("transformers.") or model_type not in REGISTRY:
        return config
    family = REGISTRY[model_type]
    own = next((c for c in (family.CONFIG, family.COMPOSITE_CONFIG) if c is not None and c.model_type == model_type), None)
    if own is None:
        return config
    warnings.warn(
        f"{type(config).__module__.partition('.')[0]} had registered its own {type(config).__name__} for model_type "
        f"{model_type!r}; nnterp loads transformers' {own.__name__} and its model, which it standardizes (to use the "
        "other package's model, load it with that package and trace it with nnsight)",
        ForeignRegistration,
        stacklevel=3,
    )
    AutoConfig.register(model_type, own, exist_ok=True)
    return reload()


def standard_aliases(family: Any) -> dict:
    """nnsight ``rename`` aliases for the standard parts: envoys, so ``tracer.cache()`` navigates them too.

    ``model.layers`` (the blocks' ``ModuleList``), ``embed_tokens``,
    ``ln_final``, ``lm_head``; and nnterp 1.x's ``model.model``: the backbone
    (``transformer`` on GPT-2, ``backbone`` on Mamba), with the same
    ``layers`` / ``embed_tokens`` / ``ln_final`` on it (``model.model.ln_final``
    is Llama's ``model.model.norm``).
    """
    backbone = family.LAYERS.split(".")[0] if "." in family.LAYERS else None
    aliases: dict = {family.LM_HEAD: "lm_head"}
    for path, name in ((family.LAYERS, "layers"), (family.EMBED_TOKENS, "embed_tokens"), (family.LN_FINAL, "ln_final")):
        aliases[path] = [name, f"{backbone}.{name}"] if backbone and path.startswith(f"{backbone}.") else name
    if backbone not in (None, "model"):
        aliases[backbone] = "model"
    return aliases


#: nnterp 1.x constructor keywords nnterp does not serve -> why, and what to do instead.
_REFUSED = {
    "rename_config": "nnterp does not rename by configuration: a new architecture is a family, nnterp/families/<model_type>.py",
    "allow_multimodal": "nnterp serves the text stack of the composites it has a family for (gemma3, qwen3_5); drop the keyword",
}
#: 1.x keywords accepted and ignored: the two tuned 1.x's load-time check; the ``*_rename`` ones are
#: pre-1.3 spellings of a module's name, which 1.3.0 no longer read (its test passes one and expects a load).
_IGNORED = (
    "allow_dispatch", "check_attn_probs_with_trace",
    "attn_rename", "mlp_rename", "ln_final_rename", "lm_head_rename", "model_rename", "layers_rename",
)


def constructor_keywords(config: Any, kwargs: dict) -> tuple[bool, bool]:
    """Pop nnterp 1.x's keywords from ``kwargs``: ``(enable_attention_probs, check_renaming)``; refuse an unknown one.

    ``enable_attention_probs=True`` loads eager attention (refused beside
    another ``attn_implementation``). A keyword that is neither nnterp's,
    nnsight's, a ``from_pretrained`` argument nor a config field is refused
    now, rather than failing inside ``from_pretrained`` at the first trace.
    """
    import inspect
    import re

    from nnsight import TransformersModel
    from transformers import PreTrainedModel

    for name in _IGNORED:
        kwargs.pop(name, None)
    for name, why in _REFUSED.items():
        if name in kwargs:
            raise SignatureError(f"StandardizedTransformer does not take nnterp 1.x's `{name}=`: {why}")
    enable = bool(kwargs.pop("enable_attention_probs", False))
    check = bool(kwargs.pop("check_renaming", False))
    if enable:
        implementation = kwargs.get("attn_implementation", "eager")
        if implementation != "eager":
            raise InvalidArgument(
                f"enable_attention_probs=True loads eager attention, and attn_implementation={implementation!r} asks for another: pass one of them"
            )
        kwargs["attn_implementation"] = "eager"
    known = set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    known |= set(re.findall(r"^\s+(\w+) \(", PreTrainedModel.from_pretrained.__doc__ or "", re.M))
    known |= {"trust_remote_code", "torch_dtype", "low_cpu_mem_usage", "output_loading_info", "tp_plan", "tp_size",
              "gguf_file", "generation_config", "tokenizer_kwargs", "automodel", "rename", "envoys", "dtype", "device_map"}
    for klass in TransformersModel.__mro__:
        if "__init__" in vars(klass):
            known |= set(inspect.signature(klass.__init__).parameters)
    fields = set(config.to_dict()) if hasattr(config, "to_dict") else set()
    unknown = sorted(name for name in kwargs if name not in known and name not in fields and not hasattr(config, name))
    if unknown:
        raise SignatureError(
            f"StandardizedTransformer got unknown keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
            "not an nnterp keyword (dispatch, device, tokenizer, enable_attention_probs, check_renaming), not a "
            "from_pretrained argument, not a field of the model's config"
        )
    return enable, check


def check_standard_names(model: Any, prompt: str = "Hello world, this is a check") -> None:
    """nnterp 1.x's ``check_renaming`` at load: run one forward and check every standard value's shape.

    Every layer's ``layer_input`` / ``layer_output``, its mixer's
    ``attention_output`` and its MLP's ``mlp_output`` are ``[batch, seq,
    hidden]``, the logits ``[batch, seq, vocab]``, and under eager attention
    each ``attention_probabilities`` is ``[batch, heads, seq, seq]`` with rows
    summing to 1. Raises `UnsupportedModel` naming the first value that is not.
    """
    found: list = []
    with torch.no_grad(), model.trace(prompt):
        ids = model.inputs[1]["input_ids"]
        for index, layer in enumerate(model.layers):
            found.append((f"layers_input[{index}]", "hidden", layer.layer_input.shape))
            mixer = token_mixer(layer)
            if mixer is not None:
                if layer.self_attn is not None and model.attn_probs_available:
                    probs = layer.self_attn.attention_probabilities
                    found.append((f"attention_probabilities[{index}]", "probs", probs.shape))
                    found.append((f"attention_probabilities[{index}] row sums", "sums", float((probs.sum(-1) - 1).abs().max())))
                found.append((f"attentions_output[{index}]", "hidden", mixer.attention_output.shape))
            if layer.mlp is not None:
                found.append((f"mlps_output[{index}]", "hidden", layer.mlp.mlp_output.shape))
            found.append((f"layers_output[{index}]", "hidden", layer.layer_output.shape))
        found.append(("logits", "logits", model.logits.shape))
        found.append(("input", "ids", ids.shape))
    batch, seq = found[-1][2]
    expected = {
        "hidden": (batch, seq, model.hidden_size), "logits": (batch, seq, model.vocab_size),
        "probs": (batch, model.num_heads, seq, seq),
    }
    for name, kind, got in found[:-1]:
        if kind == "sums":
            if got > 1e-3:
                raise UnsupportedModel(f"check_renaming: {name} differ from 1 by {got:.2g}")
        elif tuple(got) != expected[kind]:
            raise UnsupportedModel(f"check_renaming: {name} has shape {tuple(got)}, expected {expected[kind]} on {model.family.NAME}")
