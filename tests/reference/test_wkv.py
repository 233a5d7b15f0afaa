"""The WKV written from the paper (tests/reference/wkv.py) reproduces transformers' own kernel and module."""

from __future__ import annotations

import torch
from transformers import RwkvConfig
from transformers.models.rwkv import modeling_rwkv

from tests.reference.wkv import FRESH_MAX, true_sums, wkv

TOL = dict(rtol=1e-4, atol=1e-5)


def _inputs(seed: int = 0, batch: int = 2, length: int = 7, channels: int = 5):
    g = torch.Generator().manual_seed(seed)
    decay = torch.randn(channels, generator=g)
    first = torch.randn(channels, generator=g)
    k = 3 * torch.randn(batch, length, channels, generator=g)  # spread, so the running max changes hands
    v = torch.randn(batch, length, channels, generator=g)
    return decay, first, k, v


def _per_token(decay, first, k, v, state=None):
    """transformers' kernel over each prefix: the state it returns after every token, [B, T, 3, C]."""
    entering = None if state is None else tuple(state.unbind(1))
    out, final = modeling_rwkv.rwkv_linear_attention_cpu(decay, first, k, v, state=entering, return_state=True)
    states = []
    for t in range(1, k.shape[1] + 1):
        _, after = modeling_rwkv.rwkv_linear_attention_cpu(decay, first, k[:, :t], v[:, :t], state=entering, return_state=True)
        states.append(torch.stack(after, 1))
    return out, torch.stack(states, 1), torch.stack(final, 1)


def test_outputs_and_states_equal_transformers_kernel_from_a_fresh_state():
    decay, first, k, v = _inputs()
    fresh = torch.zeros(2, 3, 5)
    fresh[:, 2] = FRESH_MAX
    out, states, final = _per_token(decay, first, k, v, fresh)
    ours, our_states = wkv(decay, first, k, v)
    torch.testing.assert_close(ours, out, **TOL)
    torch.testing.assert_close(our_states, states, **TOL)
    assert torch.equal(states[:, -1], final)
    # The scaled triple's meaning: the true sums agree, and the maximum is the largest exponent so far.
    torch.testing.assert_close(true_sums(our_states), true_sums(states), rtol=1e-4, atol=1e-6)


def test_continuing_from_an_entering_state():
    decay, first, k, v = _inputs(seed=1)
    _, _, prefix = _per_token(decay, first, k[:, :3], v[:, :3])
    out, states, _ = _per_token(decay, first, k[:, 3:], v[:, 3:], prefix)
    ours, our_states = wkv(decay, first, k[:, 3:], v[:, 3:], prefix)
    torch.testing.assert_close(ours, out, **TOL)
    torch.testing.assert_close(our_states, states, **TOL)
    whole, _ = wkv(decay, first, k, v)
    torch.testing.assert_close(ours, whole[:, 3:], **TOL, msg="split at 3 = the whole sequence")


def test_the_module_output_is_the_gated_projection_of_the_recurrence():
    config = RwkvConfig(hidden_size=8, num_hidden_layers=1, attention_hidden_size=8, intermediate_size=16, vocab_size=11)
    torch.manual_seed(0)
    module = modeling_rwkv.RwkvSelfAttention(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
        hidden = torch.randn(1, 6, 8)
        out, _ = module(hidden)
        receptance, k, v, _ = module.extract_key_value(hidden)
        ours, _ = wkv(module.time_decay, module.time_first, k, v)
        torch.testing.assert_close(out, module.output(receptance * ours), **TOL)
