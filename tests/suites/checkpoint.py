"""`CheckpointFixtures`: the fixtures every suite builds from its family's ``MODEL_TYPE``; it holds no tests.

A test class sets ``MODEL_TYPE`` and gets, once per class, the standardized
model (conftest's ``load``, shared with the module's other tests), the plain
transformers model from the same tiny checkpoint (the oracles' side), the
prompt's ids, and ``routed``: the model with its family's kernels routed to
transformers' pure-torch bodies for one test.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

import nnterp
from nnterp.families import absent

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"


class CheckpointFixtures:
    """Set ``MODEL_TYPE`` (a key of `nnterp.families.REGISTRY`)."""

    MODEL_TYPE = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _present(cls):
        # A family added in a later transformers release is absent from an older one: reported, not failed.
        reason = absent(cls.MODEL_TYPE)
        if reason is not None:
            pytest.skip(reason)

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, load):
        return load(cls.MODEL_TYPE)

    @pytest.fixture(scope="class")
    @classmethod
    def plain(cls, checkpoint):
        return AutoModelForCausalLM.from_pretrained(checkpoint(cls.MODEL_TYPE)).eval()

    @pytest.fixture(scope="class")
    @classmethod
    def ids(cls, model):
        return model.tokenizer(PROMPT, return_tensors="pt").input_ids

    @pytest.fixture
    def routed(self, model):
        with nnterp.route_kernels(model.family, "torch"):
            yield model


def model_type_params(model_types) -> list:
    """``pytest.param`` per model type, skipped with the reason where the installed transformers lacks it."""
    return [pytest.param(t, id=t, marks=pytest.mark.skipif(absent(t) is not None, reason=str(absent(t)))) for t in model_types]
