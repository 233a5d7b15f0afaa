"""Nothing left behind: after every trace, one that ends in an exception or a KeyboardInterrupt raised inside it
included, the weights, the config, the kernel bindings, the model's per-token settings and ``support()`` are as
they were, and a following trace gives the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nnterp import NnterpError
from nnterp.recurrent.settings import per_token_setting
from tests.properties.models import CASES, assert_unchanged, build, recurrent_layers, serving, snapshot
from tests.properties.strategies import layers, prompts, variants

#: Where a trace stops: before anything, after reading the states, after a write, on a decode step of generate.
WHERE = ("start", "read", "write", "decode")
#: How: it returns, a user's exception, Ctrl-C, or an error nnterp raises itself (a wrongly shaped write).
HOW = ("none", "exception", "interrupt", "nnterp")


class Boom(Exception):
    pass


def settings_of(model) -> list:
    return [per_token_setting(model.layers[i].linear_attn) for i in recurrent_layers(model)]


def body(model, mix, inputs, where: str, how: str, T: int, value: torch.Tensor) -> None:
    def stop():
        if how == "exception":
            raise Boom("raised inside the trace")
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "nnterp":
            mix.state_output = torch.zeros(1, 1)  # wrongly shaped: nnterp raises

    if where == "decode":
        with torch.no_grad(), model.generate(inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                entering = mix.state_input
                mix.state_input = entering
                stop()
            tracer.result.save()
        return
    with torch.no_grad(), model.trace(inputs):
        if where == "read":
            mix.states.save()
        elif where == "write":
            mix.set_state_after(T, value)
        stop()
        model.logits.save()


@pytest.mark.parametrize(("model_type", "strategy"), CASES)
@given(data=st.data())
def test_a_trace_leaves_weights_config_bindings_and_settings_as_they_were(model_type, strategy, data):
    variant = data.draw(variants(model_type), label="variant")
    batch = data.draw(prompts(model_type, variant), label="prompts")
    layer = data.draw(layers(model_type, variant), label="layer")
    T = data.draw(st.integers(0, batch.width - 1), label="T")
    model = build(model_type, variant).model
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(batch.inputs):
        final = mix.state_output.save()
        clean = model.logits.save()
    value = 2 * final + 1
    outside = (snapshot(model), settings_of(model), model.support())
    with serving(model, strategy):
        inside = (snapshot(model), settings_of(model), model.support())
        for where in WHERE:  # every stop, each after the others (what one leaves behind shows in the next)
            for how in HOW:
                when = f"after a trace stopped at {where!r} by {how!r}"
                try:
                    body(model, mix, batch.inputs, where, how, T, value)
                except (Boom, KeyboardInterrupt, NnterpError) as raised:
                    expected = {"exception": Boom, "interrupt": KeyboardInterrupt, "nnterp": NnterpError}.get(how)
                    assert expected is not None and isinstance(raised, expected), f"{when}: raised {raised!r}"
                else:
                    assert how == "none", f"{when}: nothing was raised"
                assert_unchanged(model, inside[0], when)
                assert settings_of(model) == inside[1], f"{when}: the model's per-token settings changed"
                assert model.support() == inside[2], f"{when}: support() changed"
    assert_unchanged(model, outside[0], "after the strategy's block")
    assert settings_of(model) == outside[1] and model.support() == outside[2]
    with torch.no_grad(), model.trace(batch.inputs):
        again = model.logits.save()
    assert torch.equal(again, clean), "a following trace gives the same logits"
