"""Hypothesis strategies shared by the property tests: a model variant and a left-padded batch of prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from tests.properties.models import batch, build, chunk, recurrent_layers, variants_of

#: Longest prompt drawn: "a few chunks" of Mamba-2's small chunks; past one of the DeltaNets' 64-token chunks
#: (the oracle runs one forward per prefix, so the ``long`` profile goes further).
LONGEST = 200 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 70


@dataclass
class Prompts:
    rows: list[list[int]]
    inputs: dict  # input_ids, attention_mask: left-padded

    @property
    def width(self) -> int:
        return self.inputs["input_ids"].shape[1]

    def pad(self, row: int) -> int:
        return self.width - len(self.rows[row])

    def row_ids(self, row: int) -> torch.Tensor:
        return torch.tensor([self.rows[row]])


def variants(model_type: str):
    return st.integers(0, len(variants_of(model_type)) - 1)


@st.composite
def prompts(draw, model_type: str, variant: int, max_rows: int = 3, shortest: int = 1) -> Prompts:
    """1-3 prompts of 1 to a few chunks of the family's prompt kernel, left-padded into one batch."""
    longest = min(3 * chunk(model_type, variant) + 1, LONGEST)
    lengths = draw(st.lists(st.integers(shortest, max(shortest, longest)), min_size=1, max_size=max_rows))
    seed = draw(st.integers(0, 2**16))
    model = build(model_type, variant).model
    tokenizer = model.tokenizer
    special = max(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) if i is not None)
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(special + 1, len(tokenizer), (n,), generator=generator).tolist() for n in lengths]
    return Prompts(rows, batch(model, rows))


def layers(model_type: str, variant: int):
    return st.sampled_from(recurrent_layers(build(model_type, variant).model))
