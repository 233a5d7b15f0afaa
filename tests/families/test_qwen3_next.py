"""Qwen3-Next: the gated-DeltaNet oracle suite (tests/families/gdn.py), and what the family adds."""

import pytest
import transformers.models.qwen3_next.modeling_qwen3_next as modeling

from tests.families.gdn import *  # noqa: F401,F403  (the shared suite, run for this family)
from tests.families.gdn import assert_layer_map_follows_the_config


@pytest.fixture(scope="module")
def model_type():
    return "qwen3_next"


def test_mlp_is_the_sparse_block(model):
    for layer in model.layers:
        assert isinstance(layer.mlp._module, modeling.Qwen3NextSparseMoeBlock)


def test_a_dense_layer_is_still_mlp():
    from nnterp.testing import tiny_config

    config = tiny_config("qwen3_next")
    assert config.mlp_only_layers == []
    assert_layer_map_follows_the_config("qwen3_next", list(config.layer_types))
