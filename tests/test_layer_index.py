"""A layer index outside ``[-n, n)`` raises `PositionError` (an ``IndexError``) naming the range, wherever one is taken.

Before, the toolkit wrapped it (``layers=[n + 1]`` read layer 1). Each entry
point is called with ``n``, ``n + 1`` and ``-n - 1``; an in-range negative
index still reads the layer it counts to from the end (oracle: the same read
with the non-negative index).
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import PositionError, WrongType
from nnterp.attribution import state_attribution
from nnterp.interventions import collect_token_activations_batched, get_token_activations, patchscope_lens
from nnterp.sweep import patch_sweep

PROMPT = "The Eiffel Tower is in the city of"


def out_of_range(count: int) -> list[int]:
    return [count, count + 1, -count - 1]


def refused(count: int):
    return pytest.raises(PositionError, match=rf"out of range for the model's {count} layers; a layer index is in \[-{count}, {count}\)")


def test_the_error_is_an_index_error_and_a_float_or_bool_is_a_wrong_type(load):
    model = load("llama")
    n = model.num_layers
    with pytest.raises(IndexError):
        get_token_activations(model, PROMPT, layers=[n])
    for bad in ([1.0], [True]):
        with pytest.raises(WrongType, match="a layer index is an int"):
            get_token_activations(model, PROMPT, layers=bad)


def test_the_toolkit_refuses_an_out_of_range_layer_instead_of_wrapping(load):
    model = load("llama")
    n = model.num_layers
    for layer in out_of_range(n):
        with refused(n):
            get_token_activations(model, PROMPT, layers=[layer])
        with refused(n):
            get_token_activations(model, PROMPT, layers=layer)
        with refused(n):
            get_token_activations(model, PROMPT, layers=[layer], values="layer_output")
        with refused(n):
            collect_token_activations_batched(model, [PROMPT, PROMPT], batch_size=1, layers=[layer])
        with refused(n):
            patchscope_lens(model, PROMPT, layers=layer)
    # In range, a negative index counts from the end, as before.
    last = get_token_activations(model, PROMPT, layers=[-1])
    torch.testing.assert_close(last, get_token_activations(model, PROMPT, layers=[n - 1]), rtol=0, atol=0)
    torch.testing.assert_close(patchscope_lens(model, PROMPT, layers=-1), patchscope_lens(model, PROMPT, layers=n - 1), rtol=0, atol=0)


def test_the_plot_logit_lens_refuses_an_out_of_range_layer(load):
    pytest.importorskip("matplotlib")
    from nnterp.plot import logit_lens

    model = load("llama")
    n = model.num_layers
    for layer in out_of_range(n):
        with refused(n):
            logit_lens(model, PROMPT, layers=[layer])


@pytest.mark.parametrize(
    "name", ["layers_input", "layers_output", "attentions", "attentions_output", "mlps", "mlps_output"]
)
def test_the_layer_accessors_refuse_an_out_of_range_layer(load, name):
    model = load("llama")
    n = model.num_layers
    for layer in out_of_range(n):
        with refused(n), model.trace(PROMPT):
            getattr(model, name)[layer]
    with refused(n), model.trace(PROMPT):
        model.layers_output[n] = model.layers_output[0]


def test_steer_and_skip_refuse_an_out_of_range_layer_and_take_negative_ones_in_forward_order(load):
    model = load("llama")
    n = model.num_layers
    vector = torch.ones(model.hidden_size)
    for layer in out_of_range(n):
        with refused(n), model.trace(PROMPT):
            model.steer(layers=[0, layer], steering_vector=vector)
        with refused(n), model.trace(PROMPT):
            model.skip_layer(layer)
        with refused(n), model.trace(PROMPT):
            model.skip_layers(0, layer)
        with refused(n), model.trace(PROMPT):
            model.skip_layers(layer, n - 1)
    # [-1, 0]: layer 0 first in the forward, then the last layer (sorting the raw indices put -1 first).
    with torch.no_grad(), model.trace(PROMPT):
        model.steer(layers=[-1, 0], steering_vector=vector)
        negative = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.steer(layers=[0, n - 1], steering_vector=vector)
        positive = model.logits.save()
    torch.testing.assert_close(negative, positive, rtol=0, atol=0)
    with torch.no_grad(), model.trace(PROMPT):
        model.skip_layers(-n, -1)
        skipped = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.skip_layers(0, n - 1)
        expected = model.logits.save()
    torch.testing.assert_close(skipped, expected, rtol=0, atol=0)


def test_the_state_tools_refuse_an_out_of_range_layer(load):
    model = load("qwen3_5_text")  # 4 layers: 0-2 gated DeltaNet, 3 attention
    n = model.num_layers
    for layer in out_of_range(n):
        with nnterp.fast_states(model), refused(n), model.trace(PROMPT):
            model.states_of(layers=[0, layer])
        with refused(n):
            patch_sweep(model, PROMPT, PROMPT, 0, layers=[layer], progress=False)
        with refused(n):
            state_attribution(model, PROMPT, PROMPT, 0, layers=[layer])
        with refused(n):  # a corrupt state's layer too
            state_attribution(model, PROMPT, {layer: torch.zeros(1)}, 0, layers=[0])
