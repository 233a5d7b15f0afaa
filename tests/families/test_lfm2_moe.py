"""LFM2-MoE: the gated short convolution suite, and its dense-then-sparse feed-forward blocks."""

import torch

from nnterp import Unavailable
from tests.components.test_short_convolution import ShortConvolutionSuite
from tests.suites.checkpoint import PROMPT


class TestLfm2Moe(ShortConvolutionSuite):
    MODEL_TYPE = "lfm2_moe"

    def test_the_first_blocks_are_dense_and_the_rest_sparse(self, model, plain, ids):
        dense = model._module.config.num_dense_layers
        assert 0 < dense < len(model.layers)
        support = model.support()["mlp.router_logits"]
        for index, layer in enumerate(model.layers):
            reason = support if isinstance(support, str) or support is None else support[index]
            assert (reason is None) == (index >= dense), f"layer {index}"
        # The oracle: each router's logits (its output's first element), hooked on the plain model; what 5.20+
        # returns as output_router_logits, which 5.18's Lfm2MoeForCausalLM does not record.
        expected = []
        routers = [module for module in plain.modules() if type(module).__name__ == "Lfm2MoeTopKRouter"]
        handles = [router.register_forward_hook(lambda module, args, out: expected.append(out[0])) for router in routers]
        try:
            with torch.no_grad():
                plain(ids)
        finally:
            for handle in handles:
                handle.remove()
        logits = []
        with torch.no_grad(), model.trace(PROMPT):
            for i in range(dense, len(model.layers)):
                logits.append(model.layers[i].mlp.router_logits.save())
        assert len(logits) == len(expected), "transformers returns the sparse blocks' router logits only"
        for got, want in zip(logits, expected):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6)
        try:
            with torch.no_grad(), model.trace(PROMPT):
                model.layers[0].mlp.router_logits
        except Unavailable as error:
            assert "dense" in error.reason
        else:
            raise AssertionError("a dense block has no router")
