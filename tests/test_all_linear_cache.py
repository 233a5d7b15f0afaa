"""A Qwen3.5 text model without an attention layer, which transformers cannot run with a cache (nnterp.recurrent.no_cache).

On every supported release (5.18-5.24) the cache of such a model raises "can only be called on Attention layers"
from ``get_seq_length``, in the causal mask and in generate's prefill. These tests check, on the shipped ``deltanet``
toy and on a random all-linear tiny checkpoint built here: that nnterp never answers "run it with use_cache=True"
there, that a default trace and a default generate raise nnterp's `InvalidArgument` naming ``use_cache=False``, and
that what ``use_cache=False`` serves is right (the states against the reference recurrence on the kernel arguments
of a plain transformers forward without a cache; generate against transformers' own). Where a release runs such a
model with a cache, the trap tests skip and the probe must say so.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as QWEN3_5
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer
from nnterp.core.errors import InvalidArgument, Unavailable
from nnterp.families import REGISTRY, families
from nnterp.families.base import TINY
from nnterp.families.qwen3_5_text import Qwen3_5Text
from nnterp.sweep import patch_sweep, per_token_states
from nnterp.testing import tiny_checkpoint, tiny_tokenizer, toy_checkpoint, toy_task
from tests.reference.recurrences import gated_delta_rule

#: The words transformers' error says.
TRAP = "can only be called on Attention layers"
#: The advice that fails on such a model.
WRONG = "use_cache=True"
#: The values only a cache keeps.
CACHE_ONLY = ("linear_attn.state_output", "linear_attn.conv_state_input", "linear_attn.conv_state_output")
#: The text model types of the families built on Qwen3.5's (Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid, LFM2, ...): the ones
#: whose ``config.layer_types`` may name no attention layer.
HYBRIDS = sorted(family.MODEL_TYPES[0] for family in families() if issubclass(family, Qwen3_5Text))


def all_linear_config(model_type: str, layers: int = 2, **tokens):
    family = REGISTRY[model_type]
    sizes = dict(family.tiny_sizes(), **TINY, **tokens)
    linear = next(kind for kind, part in family.LAYER_TYPES.items() if part == "linear_attn")
    sizes.update(num_hidden_layers=layers, layer_types=[linear] * layers)
    return family.CONFIG(**sizes)


def plain_raises(model, ids) -> bool:
    """Whether a plain transformers forward with a cache fails with the trap's error (the oracle of the probe)."""
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    except ValueError as error:
        assert TRAP in str(error)
        return True
    return False


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_the_probe_agrees_with_a_plain_forward(model_type):
    family = REGISTRY[model_type]
    try:
        config = all_linear_config(model_type, vocab_size=16)
        with torch.random.fork_rng(devices=[]):
            plain = AutoModelForCausalLM.from_config(config).eval()
    except Exception:  # noqa: BLE001  (OLMo-Hybrid's config refuses such a model; others need other sizes)
        assert family.probe_cache() is False
        return
    assert family.cache_refused(config) == plain_raises(plain, torch.tensor([[1, 2, 3]]))
    hybrid = family.tiny_config(model_type, vocab_size=16)
    assert not family.cache_refused(hybrid)


def test_the_families_of_the_trap():
    assert "qwen3_5_text" in HYBRIDS and "qwen3_next" in HYBRIDS


@pytest.fixture(scope="module")
def tiny_all_linear(tmp_path_factory):
    """A random all-linear Qwen3.5 text checkpoint (two DeltaNet layers), saved with the tiny tokenizer."""
    tokenizer = tiny_tokenizer()
    config = all_linear_config(
        "qwen3_5_text", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp("all_linear")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, "The quick brown fox jumps over"


@pytest.fixture(scope="module", params=["toy", "tiny"])
def trapped(request, tiny_all_linear):
    """``(model, plain, ids, prompt)``: nnterp's and a plain transformers model of one all-linear checkpoint."""
    if request.param == "toy":
        folder, prompt = toy_checkpoint("deltanet"), next(toy_task("deltanet").samples(1, seed=7)).prompt
    else:
        folder, prompt = tiny_all_linear
    model = StandardizedTransformer(str(folder), dispatch=True, device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    if not plain_raises(plain, ids):
        pytest.skip("this transformers release runs a model without an attention layer with a cache")
    return model, plain, ids, prompt


def flat(table) -> list[str]:
    reasons = []
    for value in table.values():
        rows = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        reasons += [reason for reason in rows if reason]
    return reasons


def test_support_says_what_works(trapped):
    model = trapped[0]
    assert model.family.cache_refused(model._module.config)
    table = model.support()
    assert not [reason for reason in flat(table) if WRONG in reason]
    for name in CACHE_ONLY:
        rows = table[name]
        assert rows is not None and len(rows) == len(model.layers), name
        for reason in rows:
            assert "use_cache=False" in reason and "attention layer" in reason
    # What use_cache=False serves stays served.
    for name in ("linear_attn.state_input", "linear_attn.attention_output", "linear_attn.effective_attention"):
        assert table[name] is None, name


def test_a_default_trace_raises_naming_use_cache_false(trapped):
    model, _, _, prompt = trapped
    with pytest.raises(InvalidArgument, match="use_cache=False") as caught:
        with torch.no_grad(), model.trace(prompt):
            model.logits.save()
    assert isinstance(caught.value, ValueError)  # `except ValueError` catches it as it caught transformers' own
    assert TRAP in str(caught.value.__cause__)
    assert WRONG not in str(caught.value)


def test_a_default_generate_raises_and_generate_without_a_cache_works(trapped):
    model, plain, ids, prompt = trapped
    with pytest.raises(InvalidArgument, match="use_cache=False"):
        with torch.no_grad(), model.generate(prompt, max_new_tokens=2):
            pass
    with torch.no_grad(), model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False) as tracer:
        tokens = tracer.result.save()
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(tokens.cpu(), expected)


@pytest.mark.parametrize("name", ["state_output", "conv_state_output", "conv_state_input"])
def test_a_value_only_a_cache_keeps_says_what_works(trapped, name):
    model, _, _, prompt = trapped
    with pytest.raises(Unavailable) as caught:
        with torch.no_grad(), model.trace(prompt, use_cache=False):
            getattr(model.layers[0].linear_attn, name).save()
    assert "use_cache=False" in str(caught.value) and WRONG not in str(caught.value)


def kernel_arguments(plain, ids, monkeypatch) -> list[dict]:
    """The chunked kernel's arguments in each layer of a plain transformers forward without a cache."""
    calls, kernel = [], QWEN3_5.torch_chunk_gated_delta_rule

    def recording(query, key, value, **kwargs):
        calls.append(dict(q=query, k=key, v=value, **kwargs))
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(QWEN3_5, "torch_chunk_gated_delta_rule", recording)
    with torch.no_grad():
        logits = plain(input_ids=ids, use_cache=False).logits
    monkeypatch.undo()
    return calls, logits


def test_use_cache_false_serves_the_states_of_the_recurrence(trapped, monkeypatch):
    model, plain, ids, prompt = trapped
    calls, logits = kernel_arguments(plain, ids, monkeypatch)
    assert len(calls) == len(model.layers)
    saved = []
    with per_token_states(model), torch.no_grad(), model.trace(prompt, use_cache=False):
        for layer in model.layers:
            saved.append(layer.linear_attn.states.save())
        served_logits = model.logits.save()
    torch.testing.assert_close(served_logits, logits)
    for call, states in zip(calls, saved):
        assert call["initial_state"] is None and not call["output_final_state"]
        _, expected = gated_delta_rule(call["q"], call["k"], call["v"], call["g"], call["beta"], None, call["use_qk_l2norm_in_kernel"])
        torch.testing.assert_close(states.float(), expected, rtol=1e-4, atol=1e-5)


def test_patch_sweep_runs_without_a_cache(trapped):
    """The sweep traces with use_cache=False here: its clean probability is the plain forward's, and patching the
    clean prompt's own states back in changes no cell."""
    model, plain, ids, prompt = trapped
    with torch.no_grad():
        probs = torch.softmax(plain(ids, use_cache=False).logits[0, -1].float(), -1)
    target = int(probs.argmax())
    result = patch_sweep(model, prompt, prompt, target, positions=[0, 2, -2], progress=False)
    assert result.complete
    torch.testing.assert_close(result.clean, float(probs[target]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.probs, torch.full_like(result.probs, result.clean), rtol=1e-5, atol=1e-6)


def test_a_hybrid_still_says_run_it_with_a_cache():
    """The advice stays where it works: a hybrid's call without a cache still says use_cache=True."""
    model = StandardizedTransformer(str(tiny_checkpoint("qwen3_5_text")), dispatch=True, device="cpu")
    assert not model.family.cache_refused(model._module.config)
    assert model.support()["linear_attn.state_output"] is None
    with pytest.raises(Unavailable, match="use_cache=True"):
        with torch.no_grad(), model.trace("Hello world", use_cache=False):
            model.layers[0].linear_attn.state_output.save()
