"""A kernel argument that is one tensor for the whole batch reaches every invoke whole, whatever the batch size.

nnsight's batcher takes every tensor whose leading dim equals the batch size
for batch rows. A parameter the kernel takes (Mamba's ``A``, ``D``,
``dt_bias``, RWKV's ``time_decay``, a convolution's weight) of that leading
size (4 heads, 4 invokes) would reach each invoke as one row of itself, and
every value computed from it (the decays, the effective attention, a
knockout) would be wrong or raise. On every kind that has one, a trace with as
many invokes as the parameter's leading dim serves, in every invoke, what a
trace of the prompt alone serves (itself checked against transformers'
forward by the kinds' suites), and a write of it refuses with the fix.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable
from nnterp.families import REGISTRY
from nnterp.recurrent.arguments import PARAMETER
from tests.recurrent.test_per_token import KINDS, _mixer

#: The kinds whose kernel takes a parameter, and their parameters' names.
PARAMETERS = {
    t: names
    for t in KINDS
    if (names := [name for name, (_, layout) in REGISTRY[t].MIXER.CHUNK_ARGUMENTS.items() if layout is PARAMETER])
}


def _served(model, ids, invokes):
    """Per invoke: the parameters as served, the mixer's decays (where it has them) and the last row of its effective attention."""
    found = []
    with torch.no_grad(), model.trace(use_cache=False) as tracer:
        for _ in range(invokes):
            with tracer.invoke(ids):
                mix = _mixer(model)
                served = mix.record().serve_all()
                found.append((
                    {name: served[name].clone() for name in PARAMETERS[model.family.NAME] if served[name] is not None},
                    mix.effective_attention_of(positions=[-1]).save(),
                ))
    return found


@pytest.mark.parametrize("model_type", sorted(PARAMETERS))
def test_a_parameter_is_served_whole_when_the_batch_matches_its_leading_dim(load, model_type):
    model = load(model_type)
    ids = torch.arange(3, 3 + 7)[None]
    (alone, row), = _served(model, ids, 1)
    size = max(value.shape[0] for value in alone.values())
    assert size > 1
    for parameters, effective in _served(model, ids, size):
        assert parameters.keys() == alone.keys()
        for name, value in parameters.items():
            assert value.shape == alone[name].shape, (name, value.shape, alone[name].shape)
            torch.testing.assert_close(value, alone[name], rtol=0, atol=0)
        torch.testing.assert_close(effective, row)


@pytest.mark.parametrize("model_type", sorted(PARAMETERS))
def test_writing_a_parameter_the_batcher_would_splice_refuses(load, model_type):
    model = load(model_type)
    ids = torch.arange(3, 3 + 7)[None]
    (alone, _), = _served(model, ids, 1)
    name, value = max(alone.items(), key=lambda item: item[1].shape[0])
    with pytest.raises(Unavailable, match="batch size differs"):
        with torch.no_grad(), model.trace(use_cache=False) as tracer:
            for _ in range(value.shape[0]):
                with tracer.invoke(ids):
                    _mixer(model).record().assign(name, value)
