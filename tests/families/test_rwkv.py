"""RWKV-4 (`nnterp.families.rwkv`): the WKV suite, and what the family adds (the rescaling, the padding refusal)."""

from __future__ import annotations

import pytest
import torch

from nnterp import NnterpError
from tests.suites.checkpoint import OTHER, PROMPT
from tests.suites.wkv import WKVSuite


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model._module.named_parameters()}


def _same(before: dict, model) -> bool:
    return all(torch.equal(before[name], p) for name, p in model._module.named_parameters())


class TestRwkv(WKVSuite):
    MODEL_TYPE = "rwkv"

    def test_the_tiny_config_rescales_a_weight(self, model):
        # rescale_every=1 on 2 blocks: transformers' eval forward divides block 1's weights by 2 in place.
        assert model._module.config.rescale_every == 1 and len(model.layers) == 2

    def test_a_trace_and_generate_leave_the_weights_as_they_were(self, model, plain, ids):
        rwkv = model._module.rwkv
        before = _weights(model)
        assert not rwkv.layers_are_rescaled
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        assert _same(before, model) and not rwkv.layers_are_rescaled
        with torch.no_grad():
            expected = plain(ids).logits  # transformers rescales its own model on this first eval forward
        assert plain.rwkv.layers_are_rescaled, "the oracle ran rescaled, as transformers does"
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
            out = tracer.result.save()
        assert _same(before, model) and not rwkv.layers_are_rescaled
        assert out.shape[1] == ids.shape[1] + 3

    def test_a_model_the_user_rescaled_stays_rescaled(self, model, ids):
        rwkv = model._module.rwkv
        before = _weights(model)
        with torch.no_grad():
            model._module(ids)  # the user's own forward: transformers rescales in place
        assert rwkv.layers_are_rescaled and not _same(before, model)
        rescaled = _weights(model)
        try:
            with torch.no_grad(), model.trace(ids):
                model.logits.save()
            assert rwkv.layers_are_rescaled and _same(rescaled, model)
        finally:
            rwkv.train()
            with torch.no_grad():
                model._module(ids)  # a training forward undoes it, as transformers does
            rwkv.eval()
        assert not rwkv.layers_are_rescaled and _same(before, model)

    def test_a_padded_batch_is_refused_before_it_runs(self, model):
        reached = []
        with pytest.raises(NnterpError, match="ignores the attention mask"):
            with torch.no_grad(), model.trace([PROMPT, OTHER]):
                reached.append(True)
                model.logits.save()
        assert reached == []
        with torch.no_grad(), model.trace([PROMPT, PROMPT]):
            batch = model.logits.save()
        assert torch.equal(batch[0], batch[1]), "one length: no padding, served"

    def test_blocks_have_a_mixer_and_a_channel_mixing_mlp(self, model):
        for layer in model.layers:
            assert set(layer.parts()) == {"linear_attn", "mlp"}
            assert type(layer.mlp._module).__name__ == "RwkvFeedForward"
