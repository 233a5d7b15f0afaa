"""A read out of the forward's order raises the same error on every trace of a model, its first included."""

from __future__ import annotations

import pytest
import torch

from nnterp import OrderError, StandardizedTransformer
from tests.properties.models import MODEL_TYPES, build


@pytest.mark.xfail(
    strict=True,
    reason="bug: on a model's first trace, reading a kernel argument (linear_attn.attention_queries) after "
    "linear_attn.conv_state_output raises nnsight's OutOfOrderError ('...source.<kernel>_0.input.i0 was "
    "requested but the model already ran past it'); every later trace raises nnterp.OrderError with the "
    "order hint. conv_state_output does not touch `.source`, so on the first trace the mixer's forward runs "
    "before nnsight instruments it: the kernel's input occurrences stay 0 and Call.check_not_started "
    "(recurrent/call.py) lets the read through to nnsight",
)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_kernel_argument_read_after_the_mixer_output_raises_order_error_on_every_trace(model_type):
    model = StandardizedTransformer(str(build(model_type).path), dispatch=True, device="cpu")  # never traced
    mix = model.layers[0].linear_attn
    raised = []
    for _ in range(2):
        with pytest.raises(Exception) as error, torch.no_grad(), model.trace("The Eiffel Tower is in"):
            mix.conv_state_output
            mix.attention_queries
        raised.append(type(error.value).__name__)
    assert raised == ["OrderError", "OrderError"], raised
    assert issubclass(OrderError, Exception)
