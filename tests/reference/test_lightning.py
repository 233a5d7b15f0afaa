"""The lightning recurrence in ``lightning.py`` against transformers' MiniMax module (its block loop, its token loop)."""

from __future__ import annotations

import torch
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

from tests.reference.hf_oracles import cache_kwarg
from tests.reference.lightning import lightning_recurrence, slope_rates

HEADS, DIM, HIDDEN, LAYERS = 4, 8, 32, 4


def module(layer=1, block_size=4):
    config = MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=DIM, num_hidden_layers=LAYERS, block_size=block_size,
                           layer_types=["linear_attention"] * LAYERS, num_key_value_heads=2, intermediate_size=16)
    torch.manual_seed(0)
    mixer = MiniMaxLightningAttention(config, layer).eval()
    for parameter in mixer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return mixer


def qkv(mixer, x):
    """q, k, v as the module makes them (silu of one projection, split per head), ``[B, T, H, D]``."""
    return torch.split(torch.nn.functional.silu(mixer.qkv_proj(x)).view(*x.shape[:2], HEADS, 3 * DIM), DIM, dim=3)


def readout(mixer, x, o):
    """The module's norm, gate and output projection of the recurrence's outputs ``[B, T, H, D]``."""
    return mixer.out_proj(torch.sigmoid(mixer.output_gate(x)) * mixer.norm(o.flatten(2)))


@torch.no_grad()
def test_slopes_are_the_papers():
    mixer = module(layer=2)
    torch.testing.assert_close(mixer.slope_rate.flatten(), slope_rates(HEADS, 2, LAYERS))


@torch.no_grad()
def test_recurrence_reproduces_the_block_loop_and_its_final_state():
    mixer = module()
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(1))  # 11 tokens: 3 blocks, the last one short
    cache = MiniMaxCache()
    out, final = mixer(x, None, None, **{cache_kwarg(mixer): cache})
    q, k, v = qkv(mixer, x)
    o, states = lightning_recurrence(q, k, v, mixer.slope_rate.flatten())
    torch.testing.assert_close(readout(mixer, x, o), out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states[:, -1], final, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.get_linear_cache(mixer.layer_idx), final)


@torch.no_grad()
def test_recurrence_reproduces_the_token_loop_from_a_cached_state():
    mixer = module()
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
    initial = torch.randn(1, HEADS, DIM, DIM, generator=torch.Generator().manual_seed(3))
    cache = MiniMaxCache()
    cache.set_linear_cache(mixer.layer_idx, initial)
    out, final = mixer(x, None, None, **{cache_kwarg(mixer): cache})
    q, k, v = qkv(mixer, x)
    o, states = lightning_recurrence(q, k, v, mixer.slope_rate.flatten(), initial)
    torch.testing.assert_close(readout(mixer, x, o), out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states[:, -1], final, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_a_wrong_decay_fails():
    mixer = module()
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(4))
    out, _ = mixer(x, None, None)
    q, k, v = qkv(mixer, x)
    o, _ = lightning_recurrence(q, k, v, 2 * mixer.slope_rate.flatten())
    assert not torch.allclose(readout(mixer, x, o), out, atol=1e-4)
