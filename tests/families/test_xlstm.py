"""xLSTM: the mLSTM oracle suite (tests/components/test_mlstm.py), and what the family adds: a block's parts, no padding mask."""

import pytest
import torch

import nnterp
from tests.components.test_mlstm import MLSTMSuite
from tests.suites.checkpoint import OTHER, PROMPT


class TestXLSTM(MLSTMSuite):
    MODEL_TYPE = "xlstm"

    def test_a_block_is_the_mlstm_layer_and_the_feed_forward(self, model):
        blocks = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            assert layer.linear_attn._module is blocks[index]._module.mlstm_layer, f"layer {index}"
            assert layer.mlp._module is blocks[index]._module.ffn, f"layer {index}"
            assert layer.self_attn is None

    def test_a_padded_batch_is_refused_and_one_length_runs(self, model):
        with pytest.raises(nnterp.NnterpError, match="takes no attention mask"), torch.no_grad(), model.trace([PROMPT, OTHER]):
            model.logits.save()
        with torch.no_grad(), model.trace([PROMPT, PROMPT]):
            batch = model.logits.save()
        torch.testing.assert_close(batch[0], batch[1])

    def test_a_trace_leaves_the_config_and_the_kernels_as_they_were(self, model, ids):
        config = model._module.config.to_dict()
        backend = model.layers[0].linear_attn._module.mlstm_backend
        fns = (backend._inference_fn, backend._train_fn)
        with torch.no_grad(), model.trace(ids):
            model.layers[0].linear_attn.set_state_after(2, model.layers[0].linear_attn.state_after(1))
        assert model._module.config.to_dict() == config
        assert (backend._inference_fn, backend._train_fn) == fns
