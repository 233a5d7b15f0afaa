"""Tiny, randomly initialised, *saved* checkpoints of every supported family.

Mental model: a test should load a model exactly as a user would, with
``AutoModelForCausalLM.from_pretrained(path)``, so the code paths for config
parsing, weight loading and tokenizer discovery are the real ones.  The hub is
out of reach, so this module fabricates such a folder: a tiny config for the
family (see :func:`tiny_config`), a seeded random init, and the tiny tokenizer
of :mod:`nnterp.testing.tokenizer`, all written with ``save_pretrained``.

Random init from ``transformers`` is tuned for training (std 0.02), which
makes the next-token distribution of a tiny model almost uniform and nearly
prompt-independent; tests comparing two prompts or two interventions would
then pass vacuously.  :func:`_sharpen` re-draws the weights with
variance-preserving scales so outputs depend visibly on the input.

Folders are cached on disk, keyed by a hash of everything that determines
their content; building happens in a temp folder that is renamed into place,
so concurrent test workers never read a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedConfig

from nnterp.core.errors import InvalidArgument
from nnterp.families import MODEL_TYPES, REGISTRY
from nnterp.testing.tokenizer import publish_dir, tiny_tokenizer, tokenizer_fingerprint

__all__ = ["BUILD_VERSION", "MODEL_TYPES", "SEED", "default_cache_dir", "tiny_checkpoint", "tiny_config"]

# Bump when the recipe changes in a way the config hash cannot see
# (seed, weight scaling, files written): it invalidates every cached folder.
BUILD_VERSION = 1
SEED = 0
# Logit std at the output is roughly LOGIT_GAIN (final norm gives unit-RMS
# features); 3 puts the top next-token probability around 0.1-0.5 over ~512
# tokens: far from uniform (0.002), far from one-hot saturation.
LOGIT_GAIN = 3.0


def _tokens() -> dict:
    """The tokenizer's fields every tiny config shares: the vocabulary's size and the special ids."""
    tok = tiny_tokenizer()
    return dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)


def tiny_config(model_type: str) -> PreTrainedConfig:
    """A fresh tiny config of ``model_type`` (one of :data:`MODEL_TYPES`).

    Each family declares its own (``Family.tiny_config``): the smallest sizes
    that still exercise its structure, 4 layers (3 linear-attention + 1
    full-attention) for hybrids, 2 layers for pure SSMs and llama;
    ``vocab_size`` and special ids follow :func:`~nnterp.testing.tiny_tokenizer`.
    """
    if model_type not in REGISTRY:
        raise InvalidArgument(f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return REGISTRY[model_type].tiny_config(model_type, **_tokens())


def default_cache_dir() -> Path:
    env = os.environ.get("NNTERP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nnterp" / "tiny"


def _fingerprint(config: PreTrainedConfig) -> str:
    payload = json.dumps(
        {
            "config": config.to_dict(),
            "transformers": transformers.__version__,
            "build": BUILD_VERSION,
            "tokenizer": tokenizer_fingerprint(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@torch.no_grad()
def _sharpen(model: nn.Module, generator: torch.Generator) -> None:
    """Redraw matrices with variance-preserving scales (see module doc).

    Only matrices are touched: embeddings get std 1 (unit-scale residual
    stream), projections and stacked expert weights std 1/sqrt(fan_in), the
    LM head LOGIT_GAIN/sqrt(hidden).  Everything with a designed init stays as
    transformers made it: norms, biases, convolutions, the SSM dynamics
    (A_log, D, dt_bias) and Mamba's dt_proj, whose scale sets the time step.
    """
    head = model.get_output_embeddings()
    for mod_name, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or mod_name.endswith("dt_proj"):
            continue
        for name, p in module.named_parameters(recurse=False):
            if module is head and name == "weight":
                std = LOGIT_GAIN / math.sqrt(p.shape[-1])
            elif isinstance(module, nn.Embedding):
                std = 1.0
            elif (p.ndim == 2 and name == "weight") or (p.ndim == 3 and "expert" in type(module).__name__.lower()):
                std = 1.0 / math.sqrt(p.shape[-1])
            else:
                continue
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * std)


def _build_model(config: PreTrainedConfig) -> nn.Module:
    # fork_rng: building a fixture must not perturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        if config.get_text_config() is not config:
            # The hub ships some families (Qwen3.5 and its MoE) as the vision-language
            # composite; save that layout so loaders see the real key names (model.language_model.*).
            model = AutoModelForImageTextToText.from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    _sharpen(model, torch.Generator().manual_seed(SEED))
    return model.to(torch.float32).eval()


def tiny_checkpoint(model_type: str, *, cache_dir: str | os.PathLike | None = None, changes: dict | None = None) -> Path:
    """Path of a saved tiny checkpoint (model + tokenizer) of ``model_type``.

    ``changes``: config fields set over the family's tiny config, for a variant of it (a kimi_linear whose
    MLPs are all dense: ``{"mlp_layer_types": ["dense"] * 4}``); the folder's hash covers them.

    Built on first use, then reused: the folder name carries the model type
    and a hash of (config, transformers version, BUILD_VERSION, tokenizer), so
    a stale folder is never picked up.  ``cache_dir`` defaults to
    ``$NNTERP_CACHE`` or ``~/.cache/nnterp/tiny``.
    """
    config = tiny_config(model_type)
    for name, value in (changes or {}).items():
        setattr(config, name, value)
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = parent / f"{model_type}-{_fingerprint(config)}"
    if not final.is_dir():  # folders only ever appear complete (publish_dir)

        def write(tmp: Path) -> None:
            _build_model(config).save_pretrained(tmp)
            tiny_tokenizer().save_pretrained(tmp)

        publish_dir(final, write)
    return final
