"""The taxonomy over the whole package: every error nnterp raises is an `NnterpError` and the builtin a user catches.

(a) every class of `nnterp.core.errors` but the base derives from a builtin
other than `Exception` (and never from `AttributeError`); (b) no ``raise
NnterpError(...)`` of the bare base class anywhere in ``nnterp/`` (an AST
scan); (c) public calls with bad input, each caught by the builtin alone
(``pytest.raises(ValueError)``), then checked to be an `NnterpError`.
"""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pytest
import torch

import nnterp
from nnterp import NnterpError, StandardizedTransformer, chunk_per_token, fast_states, route_kernels
from nnterp.attribution import state_attribution
from nnterp.core import errors
from nnterp.interventions import get_token_activations, patchscope_lens
from nnterp.sweep import patch_sweep

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"
PACKAGE = Path(nnterp.__file__).parent
CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, NnterpError) and c is not NnterpError]
BUILTINS = {c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, BaseException)} - {Exception, BaseException}


@pytest.mark.parametrize("error", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_every_class_is_also_a_builtin(error):
    assert any(issubclass(error, b) for b in BUILTINS), f"{error.__name__} derives from no builtin but Exception"
    assert not issubclass(error, AttributeError)  # a property raising it must not fall through to __getattr__
    assert getattr(nnterp, error.__name__) is error and error.__name__ in nnterp.__all__
    assert error.__name__ in errors.__doc__  # the taxonomy is written once, in the module's docstring
    assert error.__name__ in (PACKAGE.parent / "docs" / "reference" / "errors.md").read_text()


def test_no_module_raises_the_bare_base_class():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(target, (ast.Name, ast.Attribute)) and getattr(target, "id", getattr(target, "attr", None)) == "NnterpError":
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found


# -- (c): public calls with bad input --------------------------------------------


def _in_trace(model, action, prompt=PROMPT):
    def run():
        with torch.no_grad(), model.trace(prompt):
            action(model)

    return run


def _steer(vector, **kwargs):
    return lambda m: m.steer(0, vector(m) if callable(vector) else vector, **kwargs)


def _routed_qwen_attribution(layers, metric_shape=False):
    def run(m):
        metric = (lambda model: model.logits[0, -1]) if metric_shape else " Paris"
        with route_kernels(m.family, "torch"):
            state_attribution(m, PROMPT, OTHER, metric, layers=layers)

    return run


def _corrupt(bad):
    def run(m):
        with route_kernels(m.family, "torch"):
            with torch.no_grad(), m.trace(OTHER):
                states = m.layers[0].linear_attn.states.save()
            state_attribution(m, PROMPT, {0: bad(states)}, " Paris", layers=[0])

    return run


def _inference_mode(m):
    with torch.inference_mode(), route_kernels(m.family, "torch"):
        state_attribution(m, PROMPT, OTHER, " Paris", layers=[0])


CASES = [
    # (id, model type or None for the checkpoint path, builtin, call)
    ("unknown-constructor-keyword", "llama", TypeError, lambda path: StandardizedTransformer(path, not_a_keyword=1)),
    ("probs-with-sdpa", "llama", ValueError, lambda path: StandardizedTransformer(path, enable_attention_probs=True, attn_implementation="sdpa")),
    ("a-folder-without-config", None, OSError, lambda path: StandardizedTransformer(path)),
    ("steer-positions-and-token-positions", "llama", ValueError, lambda m: _in_trace(m, _steer(lambda m: torch.zeros(m.hidden_size), positions=1, token_positions=1))()),
    ("steer-wrong-shape", "llama", ValueError, lambda m: _in_trace(m, _steer(lambda m: torch.zeros(m.hidden_size + 1)))()),
    ("steer-one-element", "llama", ValueError, lambda m: _in_trace(m, _steer(torch.ones(1)))()),
    ("steer-list", "llama", TypeError, lambda m: _in_trace(m, _steer(lambda m: [0.0] * m.hidden_size))()),
    ("steer-meta", "llama", ValueError, lambda m: _in_trace(m, _steer(lambda m: torch.zeros(m.hidden_size, device="meta")))()),
    ("steer-rows-not-the-batch", "llama", ValueError, lambda m: _in_trace(m, _steer(lambda m: torch.zeros(3, 1, m.hidden_size)))()),
    ("skip-layers-backwards", "llama", ValueError, lambda m: _in_trace(m, lambda m: m.skip_layers(1, 0))()),
    ("skip-layers-negative-first", "llama", ValueError, lambda m: _in_trace(m, lambda m: m.skip_layers(-1, 0))()),
    ("states-of-an-attention-layer", "qwen3_5_text", ValueError, lambda m: _in_trace(m, lambda m: m.states_of(layers=[3]))()),
    ("attribution-of-an-attention-layer", "qwen3_5_text", ValueError, _routed_qwen_attribution(layers=[3])),
    ("attribution-list-of-prompts", "qwen3_5_text", TypeError, lambda m: state_attribution(m, [PROMPT, OTHER], OTHER, " Paris")),
    ("attribution-non-scalar-metric", "qwen3_5_text", ValueError, _routed_qwen_attribution(layers=[0], metric_shape=True)),
    ("attribution-under-inference-mode", "qwen3_5_text", RuntimeError, _inference_mode),
    ("attribution-corrupt-sliced", "qwen3_5_text", ValueError, _corrupt(lambda s: s[..., :1])),
    ("attribution-corrupt-batch-2", "qwen3_5_text", ValueError, _corrupt(lambda s: torch.cat([s, s]))),
    ("attribution-multi-token-target", "qwen3_5_text", ValueError, lambda m: state_attribution(m, PROMPT, OTHER, " Paris Eiffel Tower")),
    ("sweep-multi-token-target", "qwen3_5_text", ValueError, lambda m: patch_sweep(m, PROMPT, OTHER, " Paris Eiffel Tower", progress=False)),
    ("route-kernels-unknown-mode", "qwen3_5_text", ValueError, lambda m: route_kernels(m.family, "fast")),
    ("route-kernels-a-string", None, TypeError, lambda path: route_kernels("qwen3_5_text", "torch")),
    ("fast-states-without-its-mixers", "llama", ValueError, lambda m: fast_states(m)),
    ("chunk-per-token-without-its-mixers", "llama", ValueError, lambda m: chunk_per_token(m)),
    ("padded-rwkv-batch", "rwkv", ValueError, lambda m: _in_trace(m, lambda m: m.logits.save(), [PROMPT, "Hi"])()),
    ("padded-xlstm-batch", "xlstm", ValueError, lambda m: _in_trace(m, lambda m: m.logits.save(), [PROMPT, "Hi"])()),
    ("patchscope-without-sources", "llama", TypeError, lambda m: patchscope_lens(m)),
    ("token-activations-unknown-value", "llama", ValueError, lambda m: get_token_activations(m, PROMPT, values=["bogus"])),
]


@pytest.mark.parametrize("model_type, builtin, call", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_raises_the_builtin(load, checkpoint, tmp_path, model_type, builtin, call):
    if model_type is None:
        subject = str(tmp_path)
    elif call.__code__.co_varnames[:1] == ("path",):
        subject = str(checkpoint(model_type))
    else:
        subject = load(model_type)
    with pytest.raises(builtin) as raised:
        call(subject)
    assert isinstance(raised.value, NnterpError), f"{type(raised.value).__module__}.{type(raised.value).__name__}: {raised.value}"
    assert not isinstance(raised.value, AttributeError)
