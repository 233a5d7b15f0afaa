"""Tests for nnterp.testing: the offline tokenizer and tiny checkpoints.

These fixtures underpin the rest of the suite, so the checks here are about
the properties other tests silently rely on: exact round-trips, determinism,
loadability through the Auto classes with no re-initialised weights, and
outputs that actually depend on the prompt.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import nnterp.testing.checkpoints as checkpoints
import nnterp.testing.tokenizer as tokenizer_mod
from nnterp.families import REGISTRY
from nnterp.families.qwen3_5_text import Qwen3_5Text
from nnterp.testing import MODEL_TYPES, default_cache_dir, tiny_checkpoint, tiny_config, tiny_tokenizer
from tests.suites.checkpoint import model_type_params

TEXTS = [
    "The Eiffel Tower is in the city of Paris",
    "My favourite food is pizza with",
    "Hello world there",
    "Numbers 12345 and 3.14159!!",
    "  leading   spaces\n\n\tand tabs  ",
    "Ünïcødé 日本語 😀 café",
    "<|endoftext|>it's you're I'll<|endoftext|>",
]
PROMPT_A = "The Eiffel Tower is in the city of Paris"
PROMPT_B = "My favourite food is pizza with"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nnterp-tiny")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# --------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_specials():
    tok = tiny_tokenizer()
    assert 400 <= len(tok) <= 600
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id
    assert tok.padding_side == "left"
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # The special token is atomic, and common words are merged, not bytes.
    assert tok("<|endoftext|>")["input_ids"] == [tok.eos_token_id]
    assert len(tok("Hello world there")["input_ids"]) <= 4


def test_tokenizer_left_pads():
    tok = tiny_tokenizer()
    batch = tok(["Hello", PROMPT_A], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    assert batch["input_ids"][0, 0] == tok.pad_token_id


def test_tokenizer_training_is_deterministic():
    first = tokenizer_mod._trained_json.__wrapped__()
    second = tokenizer_mod._trained_json.__wrapped__()
    assert first == second
    assert tiny_tokenizer().get_vocab() == tiny_tokenizer().get_vocab()


def test_tokenizer_cache_dir_loads_back(tmp_path):
    tok = tiny_tokenizer(cache_dir=tmp_path)
    (folder,) = [p for p in tmp_path.iterdir()]
    assert folder.name.startswith("tokenizer-")
    loaded = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]


# ----------------------------------------------------------------- configs


@pytest.mark.parametrize("model_type", model_type_params(MODEL_TYPES))
def test_tiny_config_common_fields(model_type):
    tok = tiny_tokenizer()
    cfg = _text_config(tiny_config(model_type))
    assert cfg.vocab_size == len(tok)
    # Untied, but where transformers shares blocks across depths only with tied embeddings
    # (Zamba2: it drops the model's whole tie map otherwise; nnterp/families/zamba2.py).
    assert cfg.tie_word_embeddings is (model_type == "zamba2")
    assert (cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id) == (tok.eos_token_id,) * 3
    assert cfg.hidden_size == 64
    family = REGISTRY[model_type]
    if issubclass(family, Qwen3_5Text):  # a hybrid: Qwen3.5 or a sibling written from it
        assert cfg.num_hidden_layers == 4
        assert {family.LAYER_TYPES[kind] for kind in cfg.layer_types} == {"linear_attn", "self_attn"}
        if family.LAYER_TYPES is Qwen3_5Text.LAYER_TYPES:  # LFM2 names its own kinds, in its own order
            assert list(cfg.layer_types) == ["linear_attention"] * 3 + ["full_attention"]


def test_qwen3_5_dims_are_deliberately_distinct():
    cfg = tiny_config("qwen3_5_text")
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (16, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    composite = tiny_config("qwen3_5")
    assert type(composite).__name__ == "Qwen3_5Config"
    assert composite.vision_config.depth == 1
    assert composite.text_config.to_dict() == cfg.to_dict()


def test_mamba2_prompt_spans_several_chunks():
    cfg = tiny_config("mamba2")
    assert cfg.num_heads * cfg.head_dim == cfg.hidden_size * cfg.expand
    assert len(tiny_tokenizer()(PROMPT_A)["input_ids"]) > 2 * cfg.chunk_size - 8
    assert tiny_config("mamba").use_mambapy is False


def test_unknown_model_type_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="llama.*qwen3_5_text"):
        tiny_config("bert")
    with pytest.raises(ValueError, match="mamba2"):
        tiny_checkpoint("not_a_model", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- checkpoints


def _next_token_probs(model, tok, prompt):
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert torch.isfinite(logits).all()
    return logits[0, -1].softmax(-1)


@pytest.mark.parametrize("model_type", model_type_params(MODEL_TYPES))
def test_checkpoint_loads_and_is_informative(model_type, cache_dir):
    path = tiny_checkpoint(model_type, cache_dir=cache_dir)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(path)
    ours = tiny_tokenizer()
    assert tok.padding_side == "left" and tok.pad_token_id == ours.pad_token_id
    for text in TEXTS:  # every loading route must tokenize like tiny_tokenizer
        assert tok(text)["input_ids"] == ours(text)["input_ids"]

    model.eval()
    p_a = _next_token_probs(model, tok, PROMPT_A)
    p_b = _next_token_probs(model, tok, PROMPT_B)
    vocab = p_a.numel()
    for p in (p_a, p_b):
        assert p.max() > 20 / vocab, "next-token distribution is nearly flat"
        assert p.max() < 0.99, "next-token distribution is saturated"
    total_variation = 0.5 * (p_a - p_b).abs().sum()
    assert total_variation > 0.3, "different prompts give nearly the same prediction"


def test_qwen3_5_composite_loads_as_text_model(cache_dir):
    path = tiny_checkpoint("qwen3_5", cache_dir=cache_dir)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    saved = load_file(path / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in saved)

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    state = model.state_dict()
    # Every text weight must come from the file (model.language_model.* in the
    # composite layout), never from a fresh random init.
    for key, value in state.items():
        saved_key = "model.language_model." + key[len("model.") :] if key.startswith("model.") else key
        assert torch.equal(value, saved[saved_key]), key
    text_keys = {k for k in saved if not k.startswith("model.visual.")}
    assert len(text_keys) == len(state)


def test_second_call_reuses_folder(cache_dir, monkeypatch):
    first = tiny_checkpoint("llama", cache_dir=cache_dir)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(config):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(checkpoints, "_build_model", fail)
    second = tiny_checkpoint("llama", cache_dir=cache_dir)
    assert second == first
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]


def test_folder_name_tracks_build_version(tmp_path, monkeypatch):
    first = tiny_checkpoint("mamba", cache_dir=tmp_path)
    assert first.name.startswith("mamba-")
    monkeypatch.setattr(checkpoints, "BUILD_VERSION", checkpoints.BUILD_VERSION + 1)
    assert tiny_checkpoint("mamba", cache_dir=tmp_path) != first


def test_a_variant_is_its_own_folder_with_the_changed_config(tmp_path):
    # The oracle is the saved config.json, read back without nnterp.
    base = tiny_checkpoint("kimi_linear", cache_dir=tmp_path)
    dense = tiny_checkpoint("kimi_linear", cache_dir=tmp_path, changes={"mlp_layer_types": ["dense"] * 4})
    assert dense != base and dense.name.startswith("kimi_linear-")
    read = [json.loads((path / "config.json").read_text())["mlp_layer_types"] for path in (base, dense)]
    assert read == [tiny_config("kimi_linear").mlp_layer_types, ["dense"] * 4] and read[0] != read[1]
    assert not any("experts" in name for name in load_file(dense / "model.safetensors"))


def test_build_is_reproducible_and_leaves_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_checkpoint("mamba2", cache_dir=tmp_path / "a")
    assert torch.equal(torch.rand(3), expected)
    b = tiny_checkpoint("mamba2", cache_dir=tmp_path / "b")
    assert a.name == b.name
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NNTERP_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("NNTERP_CACHE")
    assert default_cache_dir().parts[-3:] == (".cache", "nnterp", "tiny")
