"""`per_call` and `pinned` (nnterp.core.calls): one record per call of a module, and a worker's pin.

On a toy module first, then on a tiny Mamba-1 checkpoint, where invokes and
``generate`` steps are separate calls of the same mixer.
"""

from __future__ import annotations

import pytest
import torch
from nnsight import NNsight

from nnterp.core.calls import mediator, per_call, pinned
from tests.core.test_values import Pair, PairComponent, Toy

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"


@pytest.fixture
def toy():
    return NNsight(Toy(), envoys={Pair: PairComponent})


@pytest.fixture(scope="module")
def mamba(load):
    return load("mamba")


def test_per_call_computes_once_per_call_and_pinned_restores_the_pin(toy):
    calls, results = [], []  # bound outside: a list first bound in the block does not survive it
    with toy.trace(torch.ones(2)):
        results.append(per_call(toy.pair, "k", lambda: calls.append(1) or len(calls)))
        results.append(per_call(toy.pair, "k", lambda: calls.append(1) or len(calls)))
        results.append(mediator().iteration)
        with pinned(5):
            results.append(mediator().iteration)
        results.append(mediator().iteration)
    assert results == [1, 1, 0, 5, 0]


def test_per_call_keeps_one_record_per_invoke_and_per_call(mamba):
    mix = mamba.layers[0].linear_attn
    computed, seen = [], []

    def compute():
        computed.append(len(computed))
        return object()

    with torch.no_grad(), mamba.trace() as tracer:
        for prompt in (PROMPT, OTHER):
            with tracer.invoke(prompt):
                first = per_call(mix, "probe", compute)
                again = per_call(mix, "probe", compute)
                seen.append((first is again, first))
    assert [same for same, _ in seen] == [True, True], "asked twice in one call: computed once"
    assert seen[0][1] is not seen[1][1] and len(computed) == 2, "each invoke has its own worker and record"

    kernels_seen = []
    with torch.no_grad(), mamba.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[:3]:
            kernels_seen.append(type(mix).KERNEL(mix))
    cls = type(mix)
    assert kernels_seen == [cls.CHUNK_KERNEL, cls.RECURRENT_KERNEL, cls.RECURRENT_KERNEL], "a new record in every call"


def test_pinned_sets_the_workers_pin_and_restores_it(mamba):
    observed = []
    with torch.no_grad(), mamba.trace(PROMPT):
        med = mediator()
        before = med.iteration
        with pinned(5):
            observed.append(med.iteration)
            with pinned(None):
                observed.append(med.iteration)
            observed.append(med.iteration)
        try:
            with pinned(7):
                raise KeyError("inside")
        except KeyError:
            pass
        observed.append(med.iteration == before)
    assert observed == [5, None, 5, True]
