"""The paper's RG-LRU (tests/reference/rg_lru.py) against transformers' module, and its oracles against themselves."""

from __future__ import annotations

import torch
from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

from tests.reference import rg_lru as ref

TOL = dict(rtol=1e-4, atol=2e-5)


def _lru(seed: int = 0) -> RecurrentGemmaRglru:
    config = RecurrentGemmaConfig(hidden_size=32, lru_width=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=16)
    generator = torch.Generator().manual_seed(seed)
    lru = RecurrentGemmaRglru(config)
    with torch.no_grad():
        for p in lru.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return lru.eval()


def test_the_paper_recurrence_reproduces_the_module_from_a_reset_and_from_a_state():
    lru = _lru()
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():
        lru.recurrent_states = None
        y = lru(x, positions)
        states, _ = ref.rg_lru(x, lru, positions)
        torch.testing.assert_close(y, states, **TOL)
        torch.testing.assert_close(lru.recurrent_states, states[:, -1], **TOL)
        # Continuing (positions past 0): the module reads the state it kept, and so does the paper's.
        later = positions + 7
        kept = lru.recurrent_states.clone()
        y2 = lru(x, later)
        states2, _ = ref.rg_lru(x, lru, later, initial_state=kept)
        torch.testing.assert_close(y2, states2, **TOL)
        assert not torch.allclose(states2, states, atol=1e-3), "the entering state matters"


def test_oracles_agree_with_one_plain_forward():
    config = RecurrentGemmaConfig(
        hidden_size=32, lru_width=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
        num_hidden_layers=3, vocab_size=50, attention_window_size=4,
    )
    torch.manual_seed(0)
    model = RecurrentGemmaForCausalLM(config).eval()
    ids = torch.randint(3, 50, (1, 6))
    states = ref.prefix_states(model, ids, 1)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
    torch.testing.assert_close(states[:, -1], model.model.layers[1].temporal_block.rg_lru.recurrent_states)
    # Replacing the state by the one the model computed changes nothing.
    torch.testing.assert_close(ref.continue_from_state(model, ids, 2, 1, states[:, 2]), full, **TOL)
    assert not torch.allclose(ref.continue_from_state(model, ids, 2, 1, states[:, 2] * 3), full, atol=1e-4)
