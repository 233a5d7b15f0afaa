"""The error taxonomy: a wrong value raises an NnterpError that is also the builtin Python code catches.

Each case is a real wrong write or read on a tiny model, caught by the builtin
alone (``pytest.raises(ValueError)``), then checked to be the nnterp class and
to name what was expected and what came.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import (
    DeviceError,
    DtypeError,
    EmptyPrompt,
    NnterpError,
    OutOfVocabulary,
    PositionError,
    ShapeError,
    WrongType,
)
from tests.components.test_gated_deltanet import donor_state

PROMPT = "The Eiffel Tower is in the city of"

TAXONOMY = [
    (WrongType, TypeError),
    (ShapeError, ValueError),
    (DtypeError, TypeError),
    (DeviceError, ValueError),
    (PositionError, IndexError),
    (EmptyPrompt, ValueError),
    (OutOfVocabulary, ValueError),
]


@pytest.mark.parametrize("error, builtin", TAXONOMY, ids=[e.__name__ for e, _ in TAXONOMY])
def test_each_class_is_an_nnterp_error_and_the_builtin(error, builtin):
    assert issubclass(error, NnterpError) and issubclass(error, builtin)
    assert not issubclass(error, AttributeError)  # a property raising it must not fall through to __getattr__
    assert getattr(nnterp, error.__name__) is error and error.__name__ in nnterp.__all__
    assert error.__name__ in nnterp.core.errors.__doc__


@pytest.fixture(scope="module")
def qwen(load):
    return load("qwen3_5_text")


@pytest.fixture
def routed(qwen):
    with nnterp.route_kernels(qwen.family, "torch"):
        yield qwen


def _raised(model, builtin, action):
    """Run ``action(mixer)`` inside a trace of PROMPT; return the error, caught as ``builtin``."""
    with pytest.raises(builtin) as caught:
        with torch.no_grad(), model.trace(PROMPT):
            action(model.layers[0].linear_attn)
    return caught.value


def test_set_state_after_with_a_wrong_value(routed):
    good = donor_state(routed, 0)
    shape = tuple(good.shape)
    n = len(routed.tokenizer(PROMPT).input_ids)
    cases = [
        (ValueError, ShapeError, lambda mix: mix.set_state_after(1, good[:, :1]), [f"expects shape {shape}", f"got {(1, 1) + shape[2:]}"]),
        (TypeError, DtypeError, lambda mix: mix.set_state_after(1, good.to(torch.bfloat16)), ["expects dtype torch.float32", "got torch.bfloat16"]),
        (TypeError, WrongType, lambda mix: mix.set_state_after(1, 0.5), [f"takes a tensor of shape {shape}", "got float"]),
        (ValueError, DeviceError, lambda mix: mix.set_state_after(1, good.to("meta")), ["expects a tensor on cpu", "got one on meta"]),
        (IndexError, PositionError, lambda mix: mix.set_state_after(n, good), [f"position {n} is outside this call's {n} tokens"]),
        (IndexError, PositionError, lambda mix: mix.state_after(-n - 1), ["outside"]),
        (TypeError, WrongType, lambda mix: mix.state_after(1.0), ["takes a token position (an int)", "got float"]),
    ]
    for builtin, error, action, words in cases:
        raised = _raised(routed, builtin, action)
        assert type(raised) is error, (error, raised)
        for word in words:
            assert word in str(raised), (word, str(raised))


def test_an_assigned_value_of_the_wrong_shape_or_kind(load):
    model = load("llama")
    n = len(model.tokenizer(PROMPT).input_ids)
    with pytest.raises(ValueError) as caught:
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].layer_output = torch.zeros(1, 1, 64)
    assert type(caught.value) is ShapeError
    assert f"expects shape (1, {n}, 64), got (1, 1, 64)" in str(caught.value)
    with pytest.raises(TypeError) as caught:
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].layer_output = 1.0
    assert type(caught.value) is WrongType and "got float" in str(caught.value)


def test_a_setting_or_a_constructor_given_the_wrong_kind_of_object(qwen):
    with pytest.raises(TypeError, match="takes a StandardizedTransformer, got str"):
        nnterp.chunk_per_token("mamba2")
    with pytest.raises(TypeError, match="got int") as caught:
        nnterp.StandardizedTransformer(3)
    assert isinstance(caught.value, NnterpError)


@pytest.mark.parametrize("model_type", ["llama", "mamba2"])
def test_an_empty_prompt_says_so_in_trace_and_generate(load, model_type):
    model = load(model_type)
    assert model.tokenizer("").input_ids == []  # the tiny tokenizers add no BOS: "" is no token at all
    for prompt in ("", [""], [[]], torch.zeros(1, 0, dtype=torch.long)):
        for run, kwargs in (("trace", {}), ("generate", {"max_new_tokens": 2})):
            with pytest.raises(ValueError, match="the prompt is empty") as caught:
                with torch.no_grad(), getattr(model, run)(prompt, **kwargs):
                    model.logits.save()
            assert isinstance(caught.value, EmptyPrompt), (prompt, run, caught.value)
    # one empty row of a batch would run on padding alone: refused too, naming the row
    for prompt in (["Paris is", ""], [[5, 6], []]):
        with pytest.raises(EmptyPrompt, match=r"batch row \[1\] is empty"):
            with torch.no_grad(), model.trace(prompt):
                model.logits.save()
    with pytest.raises(EmptyPrompt, match=r"batch row \[1\] is empty"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke("Paris is"):
                pass
            with tracer.invoke(""):
                model.logits.save()
    with torch.no_grad(), model.trace("Paris is"):  # and the model runs on afterwards
        logits = model.logits.save()
    assert logits.shape[:2] == (1, len(model.tokenizer("Paris is").input_ids))
