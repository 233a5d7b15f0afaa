"""``fast_states(model, dtype=torch.bfloat16)``: per-token states stored in bfloat16, each rounded once from float32.

Oracle: the plain transformers model's own cache after each prefix of the prompt (independent forwards), in
float32. The stated tolerance (`nnterp.fast.scan.BF16_RTOL`): every entry within 2⁻⁸ of its magnitude, plus
float32's own error (1e-5 of the largest entry).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import InvalidArgument, fast_states
from nnterp.families import REGISTRY, present
from nnterp.fast.scan import BF16_RTOL
from nnterp.testing import tiny_checkpoint
from tests.suites.caches import of_kind

#: One family per kind with a fast path (the first registered), from the registry.
KINDS = list({REGISTRY[t].MIXER: t for t in reversed(present()) if REGISTRY[t].MODEL_TYPES[0] == t
              and getattr(REGISTRY[t].MIXER, "FAST", None) is not None}.values())


def within_bf16(found: torch.Tensor, expected: torch.Tensor) -> None:
    excess = (found.double() - expected.double()).abs() - BF16_RTOL * expected.double().abs() - 1e-5 * expected.abs().max()
    assert excess.max() <= 0, f"beyond one bfloat16 rounding by {excess.max().item():.3g}"


@pytest.mark.parametrize("model_type", KINDS)
def test_bfloat16_states_are_the_caches_states_rounded_once(model_type, load):
    model = load(model_type)
    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type)).eval()
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    ids = torch.randint(3, 60, (1, 37), generator=torch.Generator().manual_seed(0))
    expected = of_kind(model.family.MIXER).prefix_states(plain, ids, layer)
    chosen = [0, 17, 36]
    with fast_states(model, dtype=torch.bfloat16), torch.no_grad(), model.trace(ids):
        mix = model.layers[layer].linear_attn
        states = mix.states.save()
    with fast_states(model, dtype=torch.bfloat16), torch.no_grad(), model.trace(ids):
        selected = model.layers[layer].linear_attn.states_of(chosen).save()
    assert states.dtype == selected.dtype == torch.bfloat16
    within_bf16(states, expected)
    within_bf16(selected, expected[:, chosen])
    assert not torch.equal(states.float(), expected)  # stored rounded: not the float32 states
    # On exit the setting and its dtype come back: float32 states, equal to the cache's within float32.
    with fast_states(model), torch.no_grad(), model.trace(ids):
        again = model.layers[layer].linear_attn.states.save()
    assert again.dtype == torch.float32
    torch.testing.assert_close(again, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


def test_a_dtype_states_cannot_be_stored_in_names_the_choices(load):
    with pytest.raises(InvalidArgument, match="torch.bfloat16"):
        fast_states(load(KINDS[0]), dtype=torch.int8)
    with pytest.raises(InvalidArgument, match="torch.bfloat16"):
        fast_states(load(KINDS[0]), dtype="bfloat16")
