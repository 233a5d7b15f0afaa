"""Fixtures: tiny checkpoints built offline (`nnterp.testing`), loaded the way a user loads them.

Routing is process-wide, so every test leaves each family's kernels bound as
transformers bound them at import; the autouse fixture checks it.
"""

from __future__ import annotations

import signal

import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.families import families
from nnterp.recurrent.kernels import STASH
from nnterp.testing import tiny_checkpoint

torch.set_num_threads(1)  # the CI machine has two cores; one per process keeps timings sane


@pytest.fixture(scope="session")
def checkpoint():
    """``checkpoint(model_type) -> path`` of a tiny saved model."""
    return tiny_checkpoint


@pytest.fixture(scope="module")
def load():
    """``load(model_type) -> StandardizedTransformer``, loaded with weights, cached per module."""
    cache: dict = {}

    def get(model_type: str, fresh: bool = False) -> StandardizedTransformer:
        if fresh or model_type not in cache:
            cache[model_type] = StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device="cpu")
        return cache[model_type]

    return get


@pytest.fixture(scope="module")
def eager_models():
    """``eager_models(model_type) -> StandardizedTransformer`` with eager attention and its weights served
    (``enable_attention_probs=True``), cached per module."""
    cache: dict = {}

    def get(model_type: str) -> StandardizedTransformer:
        if model_type not in cache:
            cache[model_type] = StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device="cpu", enable_attention_probs=True)
        return cache[model_type]

    return get


@pytest.fixture(scope="module")
def plains():
    """``plains(model_type, **from_pretrained_kwargs)`` -> the plain transformers model (the oracle), cached per module."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(model_type: str, **kwargs):
        key = (model_type, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), **kwargs).eval()
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def sigint_handler():
    """Ctrl-C's handler is as before each test after it (a hold left installed would swallow every later Ctrl-C)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"the test left SIGINT's handler {after!r} installed (it was {before!r})")


@pytest.fixture(autouse=True)
def default_kernels():
    """Every family's kernels are bound as at import after each test."""
    yield
    for family in families():
        stash = family.MODELING.__dict__.get(STASH, {})
        for name, original in stash.items():
            bound = family.MODELING.__dict__[name]
            if bound is not original:
                setattr(family.MODELING, name, original)
                pytest.fail(f"{family.NAME}: {name} was left routed by the test")
