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
from transformers import AutoModelForCausalLM, PreTrainedConfig

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

MODEL_TYPES: tuple[str, ...] = (
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "qwen3_next",
    "olmo_hybrid",
    "kimi_linear",
    "mamba",
    "mamba2",
    "llama",
)

# Three linear layers then one full-attention layer: every hybrid family gets
# both kinds of mixer, and the full layer sits last as in the real 3:1 models.
_HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _common() -> dict:
    tok = tiny_tokenizer()
    return dict(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _qwen3_5_text_kwargs() -> dict:
    # Key and value head counts/dims all differ so that a transposed or
    # mis-reshaped recurrent state [heads, k_dim, v_dim] fails loudly.
    return dict(
        _common(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=list(_HYBRID),
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


def _moe_kwargs() -> dict:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _build_config(model_type: str) -> PreTrainedConfig:
    t = transformers
    if model_type == "qwen3_5_text":
        return t.Qwen3_5TextConfig(**_qwen3_5_text_kwargs())
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        text = _qwen3_5_text_kwargs()
        if model_type == "qwen3_5_moe":
            text.pop("intermediate_size")
            text.update(_moe_kwargs())
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
        composite = t.Qwen3_5Config if model_type == "qwen3_5" else t.Qwen3_5MoeConfig
        return composite(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32")
    if model_type == "qwen3_5_moe_text":
        kw = _qwen3_5_text_kwargs()
        kw.pop("intermediate_size")  # MoE text config has no dense MLP width
        return t.Qwen3_5MoeTextConfig(**kw, **_moe_kwargs())
    if model_type == "qwen3_next":
        return t.Qwen3NextConfig(**_qwen3_5_text_kwargs(), **_moe_kwargs(), decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "olmo_hybrid":
        kw = _qwen3_5_text_kwargs()
        kw.pop("head_dim")  # OLMo derives it as hidden_size // num_attention_heads
        return t.OlmoHybridConfig(**kw)
    if model_type == "kimi_linear":
        return t.KimiLinearConfig(
            **_common(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            # Kimi's own default puts full attention at i % 4 == 0 (i > 0), so 4
            # layers would be all linear; hub checkpoints instead list
            # 1-indexed `linear_attn_config.full_attn_layers`. Be explicit.
            layer_types=list(_HYBRID),
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_attention_heads=4,
            num_key_value_heads=4,  # MLA expands the latent to every head
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            linear_num_heads=4,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            max_position_embeddings=2048,
        )
    if model_type == "mamba":
        return t.MambaConfig(
            **_common(), hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, use_mambapy=False
        )
    if model_type == "mamba2":
        return t.Mamba2Config(
            **_common(),
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            n_groups=1,
            state_size=16,
            expand=2,
            conv_kernel=4,
            chunk_size=8,  # small, so ordinary prompts span several chunks
        )
    if model_type == "llama":
        return t.LlamaConfig(
            **_common(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
    raise ValueError(f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")


def tiny_config(model_type: str) -> PreTrainedConfig:
    """A fresh tiny config of ``model_type`` (one of :data:`MODEL_TYPES`).

    Sizes are the smallest that still exercise each family's structure:
    4 layers (3 linear-attention + 1 full-attention) for hybrids, 2 layers
    for pure SSMs and llama; ``vocab_size`` and special ids follow
    :func:`~nnterp.testing.tiny_tokenizer`.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return _build_config(model_type)


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
        if config.model_type in ("qwen3_5", "qwen3_5_moe"):
            # The hub ships Qwen3.5 (and its MoE) as the vision-language composite;
            # save that layout so loaders see the real key names (model.language_model.*).
            composite = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
            model = getattr(transformers, composite[config.model_type])(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    _sharpen(model, torch.Generator().manual_seed(SEED))
    return model.to(torch.float32).eval()


def tiny_checkpoint(model_type: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a saved tiny checkpoint (model + tokenizer) of ``model_type``.

    Built on first use, then reused: the folder name carries the model type
    and a hash of (config, transformers version, BUILD_VERSION, tokenizer), so
    a stale folder is never picked up.  ``cache_dir`` defaults to
    ``$NNTERP_CACHE`` or ``~/.cache/nnterp/tiny``.
    """
    config = tiny_config(model_type)
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = parent / f"{model_type}-{_fingerprint(config)}"
    if not final.is_dir():  # folders only ever appear complete (publish_dir)

        def write(tmp: Path) -> None:
            _build_model(config).save_pretrained(tmp)
            tiny_tokenizer().save_pretrained(tmp)

        publish_dir(final, write)
    return final
