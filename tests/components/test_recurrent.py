"""`RecurrentMixer`'s own machinery, whatever the mixer: which kernel a call runs.

Per-call records and pins are tested in tests/core/test_calls.py, routing in
tests/recurrent/test_routing.py. Oracle: the plain HF model's cache.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from tests.reference import hf_oracles as hf

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def mamba2(load):
    return load("mamba2")


def test_kernel_is_the_prompts_for_several_tokens_over_a_cache_and_the_updates_for_one(mamba2, checkpoint):
    """Mamba-2 continues a cache with several tokens through its prompt kernel, from the cached state."""
    mix = mamba2.layers[1].linear_attn
    cls = type(mix)
    ids = mamba2.tokenizer(PROMPT, return_tensors="pt").input_ids
    head, rest = ids[:, :5], ids[:, 5:]
    with torch.no_grad(), mamba2.trace(head):
        out = mamba2.output.save()
    cache = hf.output_cache(out)
    prefix_final = hf.recurrent_state(cache, 1).clone()
    chosen, entering = [], []
    with nnterp.chunk_per_token(mamba2), torch.no_grad(), mamba2.trace(rest, **{hf.cache_kwarg(mamba2._module): cache}):
        chosen.append(cls.KERNEL(mix))
        entering.append(mix.state_input.save())
        states = mix.states.save()
    with torch.no_grad(), mamba2.trace(ids[:, 5:6], **{hf.cache_kwarg(mamba2._module): hf.output_cache(out)}):
        chosen.append(cls.KERNEL(mix))
    assert chosen == [cls.CHUNK_KERNEL, cls.RECURRENT_KERNEL]
    torch.testing.assert_close(entering[0], prefix_final, rtol=0, atol=0, msg="the prompt kernel starts from the cache")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(checkpoint("mamba2")).eval()
    torch.testing.assert_close(states[0], hf.prefix_states(plain, ids, 1)[0, 5:], rtol=1e-4, atol=1e-5)
