"""StandardizedTransformer: loading paths, standard names, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nnterp
from nnterp import NnterpError, NotInTrace, StandardizedTransformer, Unavailable, UnsupportedModel
from nnterp.families import REGISTRY

PROMPT = "Hello world there"


def test_a_local_folder_loads_lazily_and_on_first_trace(checkpoint):
    path = checkpoint("qwen3_5_text")
    model = StandardizedTransformer(str(path))  # dispatch=False: nnsight's meta path
    assert next(model._module.parameters()).device.type == "meta"
    with torch.no_grad(), model.trace(PROMPT):
        probs = model.next_token_probs.save()
    assert next(model._module.parameters()).device.type == "cpu"
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = torch.softmax(plain(ids).logits[:, -1], -1)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


def test_a_loaded_model_needs_its_tokenizer_and_then_works(checkpoint):
    path = checkpoint("mamba")
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    with pytest.raises(NnterpError, match="tokenizer="):
        StandardizedTransformer(plain)
    model = StandardizedTransformer(plain, tokenizer=AutoTokenizer.from_pretrained(path))
    assert model._module is plain
    with torch.no_grad(), model.trace(PROMPT):
        out = model.layers[0].layer_output.save()
    assert out.shape[-1] == plain.config.hidden_size


def test_loading_raises_no_deprecation_warning(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        model = StandardizedTransformer(str(checkpoint("llama")), dispatch=True)
        with torch.no_grad(), model.trace(PROMPT):
            model.logits.save()


def test_the_composite_checkpoint_loads_as_the_text_model(checkpoint, load):
    model = load("qwen3_5")
    assert type(model._module).__name__ == "Qwen3_5ForCausalLM"
    assert model.family is REGISTRY["qwen3_5_text"] is REGISTRY["qwen3_5"]
    assert model.family.NAME == "qwen3_5_text"
    assert model.family.MODELING.__name__ == "transformers.models.qwen3_5.modeling_qwen3_5"


def test_standard_names_reach_the_modules_the_family_names(load):
    model = load("mamba")
    assert model.lm_head._module is model._module.lm_head
    assert model.embed_tokens._module is model._module.backbone.embeddings
    assert model.ln_final._module is model._module.backbone.norm_f
    assert len(model.layers) == model._module.config.num_hidden_layers
    assert [layer._module for layer in model.layers] == list(model._module.backbone.layers)
    layer = model.layers[0]
    assert layer.linear_attn._module is model._module.backbone.layers[0].mixer
    assert layer.self_attn is None and layer.mlp is None


def test_print_shows_the_standard_tree_with_descriptions(load):
    text = repr(load("qwen3_5_text"))
    assert "linear_attn: LinearAttention" in text and "self_attn: Attention" in text
    assert "(states)" in text and "The recurrent state after every token" in text
    assert "(next_token_probs)" in text


def test_support_is_none_where_served_and_a_reason_per_layer_otherwise(load):
    model = load("qwen3_5_text")
    support = model.support()
    assert support["layer.layer_output"] is None and support["self_attn.attention_output"] is None
    states = support["linear_attn.states"]
    assert isinstance(states, dict) and sorted(states) == [0, 1, 2]  # a hybrid: only the recurrent blocks
    assert all("route_kernels" in reason for reason in states.values())
    with nnterp.route_kernels(model.family, "torch"):
        assert model.support()["linear_attn.states"] is None


def test_a_missing_folder_says_so(tmp_path):
    with pytest.raises(NnterpError, match="no folder exists at that path"):
        StandardizedTransformer(str(tmp_path / "nowhere"))


def test_an_unknown_family_lists_the_supported_ones_and_how_to_add_one(tmp_path):
    from transformers import BertConfig  # a model_type nnterp has no family for

    BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel) as raised:
        StandardizedTransformer(str(tmp_path))
    message = str(raised.value)
    assert "'bert'" in message and all(model_type in message for model_type in REGISTRY)
    assert "nnterp/families/bert.py" in message and "tests/families/test_bert.py" in message


def test_a_value_read_outside_a_trace_says_where_to_read_it(load):
    model = load("llama")
    with pytest.raises(NotInTrace, match="inside `with model.trace"):
        model.layers[0].layer_output
    with pytest.raises(NotInTrace):
        model.next_token_probs


def test_a_write_of_the_wrong_shape_to_layer_output_raises_before_the_model_runs_on(load):
    model = load("llama")
    with pytest.raises(NnterpError, match=r"`layer.layer_output` expects shape \(1, \d+, 64\), got \(1, 1, 64\)"):
        with model.trace(PROMPT):
            model.layers[0].layer_output = torch.zeros(1, 1, 64)


def test_layer_output_write_reaches_the_next_layer(load):
    model = load("llama")
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[0].layer_output = torch.zeros_like(model.layers[0].layer_output)
        entering = model.layers[1].layer_input.save()
    assert torch.count_nonzero(entering) == 0


def test_errors_are_not_attribute_errors():
    for error in (Unavailable, NotInTrace, UnsupportedModel, nnterp.OrderError, nnterp.ReadOnlyValue):
        assert not issubclass(error, AttributeError)
