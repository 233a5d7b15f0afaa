"""One order check for every recurrent kind: a read the run has passed raises nnterp's `OrderError` with the hint.

On every kind's representative (the per-token path its prompts take), a read
the run can still serve is served (the state after token 0 read again, or
`states` after it: equal to each read alone), and one it has passed
(`states` or `state_after` after the mixer's output) raises `OrderError`
naming the order to use, never nnsight's raw ``OutOfOrderError``.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import OrderError
from tests.recurrent.test_per_token import KINDS, PROMPT, _mixer, per_token

HINT = "a worker reads in the order the model runs"


def _alone(model, read):
    with torch.no_grad(), model.trace(PROMPT):
        got = read(_mixer(model)).save()
    return got


@pytest.mark.parametrize("model_type", KINDS)
def test_state_after_then_states_and_twice_are_served(load, model_type):
    model = load(model_type)
    with per_token(model):
        states = _alone(model, lambda mix: mix.states)
        with torch.no_grad(), model.trace(PROMPT):
            mix = _mixer(model)
            first = mix.state_after(0).save()
            again = mix.state_after(0).save()
        with torch.no_grad(), model.trace(PROMPT):
            mix = _mixer(model)
            before = mix.state_after(0).save()
            after = mix.states.save()
    torch.testing.assert_close(first, states[:, 0])
    torch.testing.assert_close(again, states[:, 0])
    torch.testing.assert_close(before, states[:, 0])
    torch.testing.assert_close(after, states)


@pytest.mark.parametrize("model_type", KINDS)
@pytest.mark.parametrize(
    "late", [lambda mix: mix.states, lambda mix: mix.state_after(0)], ids=["states", "state_after"]
)
def test_a_state_after_the_mixer_output_is_an_order_error(load, model_type, late):
    model = load(model_type)
    with per_token(model):
        with pytest.raises(OrderError, match=HINT), torch.no_grad(), model.trace(PROMPT):
            mix = _mixer(model)
            mix.attention_output.save()
            late(mix).save()
