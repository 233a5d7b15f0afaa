"""A read out of the forward's order raises the same error on every trace of a model, its first included."""

from __future__ import annotations

import pytest
import torch

from nnterp import OrderError, StandardizedTransformer
from tests.properties.models import MODEL_TYPES, build


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_kernel_argument_read_after_the_mixer_output_raises_order_error_on_every_trace(model_type):
    model = StandardizedTransformer(str(build(model_type).path), dispatch=True, device="cpu")  # never traced
    mix = model.layers[0].linear_attn
    # A value at the mixer's output: its convolution window, or its output where it has no convolution.
    late = "conv_state_output" if mix.support().get("conv_state_output") is None else "attention_output"
    raised = []
    for _ in range(2):
        with pytest.raises(Exception) as error, torch.no_grad(), model.trace("The Eiffel Tower is in"):
            getattr(mix, late)
            mix.attention_queries
        raised.append(type(error.value).__name__)
    assert raised == ["OrderError", "OrderError"], raised
    assert issubclass(OrderError, Exception)
