"""Kimi's delta attention (`KimiDeltaAttention`): the gated DeltaNet with a decay per key channel.

`KimiDeltaAttentionSuite` is `GatedDeltaNetSuite` with Kimi's recurrence
(tests/reference/recurrences.py ``kimi_delta_attention``) and what the per-channel
decay adds; Kimi-Linear and Bailing-Hybrid subclass it.
"""

from __future__ import annotations

import torch

from tests.components.test_gated_deltanet import GatedDeltaNetSuite, assert_kernel_arguments_reproduce_states
from tests.reference.recurrences import gated_delta_rule, kimi_delta_attention
from tests.suites.checkpoint import PROMPT


class KimiDeltaAttentionSuite(GatedDeltaNetSuite):
    """Set ``MODEL_TYPE``."""

    RECURRENCE = staticmethod(kimi_delta_attention)

    def test_decays_are_one_per_key_channel_and_reproduce_the_states(self, routed):
        args = assert_kernel_arguments_reproduce_states(routed, 0, kimi_delta_attention)
        g, dims = args["g"], routed.layers[0].linear_attn.dims()
        assert g.shape[2:] == (dims["mixer_heads"], dims["key_dim"])
        assert (g.std(dim=-1) > 0).all(), "the channels of a head decay differently"
        # A scalar decay per head (the mean, or any channel) does not give Kimi's states.
        _, scalar = gated_delta_rule(args["q"], args["k"], args["v"], g.mean(-1), args["beta"])
        assert not torch.allclose(scalar, args["states"], atol=1e-3)

    def test_decays_write_back_change_the_model_as_the_kernel_says(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            g = mix.decays.save()
            baseline = model.next_token_probs.save()
        with torch.no_grad(), model.trace(PROMPT):
            mix.decays = torch.zeros_like(mix.decays)  # no forgetting at all
            probs = model.next_token_probs.save()
        assert g.shape[-1] == mix.dims()["key_dim"]
        assert not torch.allclose(probs, baseline, atol=1e-4)
