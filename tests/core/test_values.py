"""EProperty / DerivedEProperty on a toy module, independent of any family (per_call and pinned: test_calls.py)."""

from __future__ import annotations

import pytest
import torch
from nnsight import NNsight

from nnterp import NotInTrace, ReadOnlyValue, Unavailable
from nnterp.core.calls import mediator
from nnterp.core.standard import Standard
from nnterp.core.values import DerivedEProperty, EProperty, Key, Unwrap


class Pair(torch.nn.Module):
    """Returns (2x, x + 1), called with (x, scale=...)."""

    def forward(self, x, scale=1.0):
        return 2 * x * scale, x + 1


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair()
        self.head = torch.nn.Identity()

    def forward(self, x):
        doubled, shifted = self.pair(x, scale=3.0)
        return self.head(doubled + shifted)


CLOSED = {"flag": None}


class PairComponent(Standard):
    KIND = "pair"
    doubled = EProperty("output", select=0, description="2x")
    shifted = EProperty("output", select=Unwrap(), description="first element via Unwrap")
    scale = EProperty("input", select="scale", description="the scale keyword")
    moved = EProperty(Key(lambda envoy: "input" if envoy.where == "input" else "output", "where"), select=0, description="per access")
    closed = EProperty("output", select=1, description="may be unavailable", unavailable=lambda envoy: CLOSED["flag"])

    def _total(self):
        return self.doubled.sum()

    total = DerivedEProperty(_total, description="sum of doubled")
    where = "input"


@pytest.fixture
def toy():
    return NNsight(Toy(), envoys={Pair: PairComponent})


def test_select_reads_elements_and_a_write_rebuilds_the_container(toy):
    x = torch.ones(2)
    with toy.trace(x):
        doubled = toy.pair.doubled.save()
        toy.pair.doubled = torch.zeros(2)
        out = toy.output.save()
    assert torch.equal(doubled, 6 * x)
    assert torch.equal(out, x + 1)  # 0 + (x + 1)


def test_a_keyword_is_selected_and_written_back(toy):
    with toy.trace(torch.ones(2)):
        scale = toy.pair.scale.save()
        toy.pair.scale = 0.5
        out = toy.output.save()
    assert scale == 3.0
    assert torch.equal(out, torch.full((2,), 1.0 + 2.0))


def test_the_key_is_computed_per_access(toy):
    component = toy.pair
    with toy.trace(torch.ones(2)):
        first = component.moved.save()  # at the input: args[0]
    object.__setattr__(component, "where", "output")
    with toy.trace(torch.ones(2)):
        second = component.moved.save()  # at the output: element 0
    assert torch.equal(first, torch.ones(2)) and torch.equal(second, torch.full((2,), 6.0))
    assert repr(PairComponent.moved.key) == "<where>"


def test_an_unavailable_value_raises_its_reason_and_support_reports_it(toy):
    CLOSED["flag"] = "closed for the test; open it to read"
    try:
        assert toy.pair.support()["closed"] == "closed for the test; open it to read"
        with pytest.raises(Unavailable) as raised, toy.trace(torch.ones(2)):
            toy.pair.closed
        assert raised.value.reason == "closed for the test; open it to read"
        assert not isinstance(raised.value, AttributeError)
    finally:
        CLOSED["flag"] = None
    assert toy.pair.support()["closed"] is None


def test_a_derived_value_is_computed_and_read_only(toy):
    with toy.trace(torch.ones(2)):
        total = toy.pair.total.save()
    assert float(total) == 12.0
    with pytest.raises(ReadOnlyValue, match="cannot be assigned"), toy.trace(torch.ones(2)):
        toy.pair.total = 1.0


def test_outside_a_trace_a_value_says_where_to_read_it(toy):
    with pytest.raises(NotInTrace):
        toy.pair.doubled
    with pytest.raises(NotInTrace):
        mediator()


def test_values_are_listed_in_declaration_order_with_descriptions():
    names = list(PairComponent.values())
    assert names[:3] == ["doubled", "shifted", "scale"] and "total" in names
    assert str(PairComponent.doubled) == "(doubled): 2x"


def test_a_value_none_on_a_fresh_prompt_is_declared_not_described():
    """The contract suite reads the declared flag; the description is prose for people."""
    from nnterp.components.gated_deltanet import LinearAttention
    from nnterp.components.selective_scan import SelectiveScan

    for cls in (LinearAttention, SelectiveScan):
        flagged = {name for name, value in cls.values().items() if value.none_on_fresh_prompt}
        assert flagged == {"state_input", "conv_state_input", "state_input_readout"}
