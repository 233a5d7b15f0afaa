"""Where the ``facts`` toy reads a planted fact: one value of a donor run, written into the clean run at one position.

Mental model: a facts prompt is ``[filler...] a<i> b<j> is`` and its answer is the subject's attribute, which no
token of the prompt names: the model looks it up from the two subject tokens together (64 subjects, 8 attributes,
so neither token alone decides it). A donor prompt has the same filler and another subject with another attribute
(`PlantedFacts.donor`). `patch_from_donor` writes one value of the donor's run (a block's ``layer_output``, its
mixer's ``attention_output``, its ``mlp_output``) into the clean run at one position and reports the model's
answer: where the answer becomes the donor's attribute, that value at that position carries what decides it. The
earliest such site carries the attribute itself once the MLP that reads the fact has run; before it, the subject.

Positions count from the prompt's end (the subject's first token is ``-3``, its second ``-2``, ``is`` ``-1``), and
samples are batched by length (`nnterp.testing.recall.length_groups`), so no row is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nnterp.testing.recall import length_groups
from nnterp.testing.tasks import Sample

__all__ = ["SITES", "patch_from_donor"]

#: The values `patch_from_donor` writes, in a block's forward order: ``site -> (part, value)``.
SITES = {"attention_output": ("linear_attn", "attention_output"), "mlp_output": ("mlp", "mlp_output"),
         "layer_output": (None, "layer_output")}


def _envoy(model: Any, layer: int, site: str) -> Any:
    part, _ = SITES[site]
    block = model.layers[layer]
    return block if part is None else getattr(block, part)


def patch_from_donor(model: Any, samples: Sequence[Sample], donors: Sequence[Sample], site: str, layer: int,
                     position: int, batch: int = 100) -> torch.Tensor:
    """The argmax after each prompt with ``layers[layer]``'s ``site`` at ``position`` (from the end) the donor's, ``[n]`` ids."""
    name = SITES[site][1]
    out = torch.empty(len(samples), dtype=torch.long)
    for rows in length_groups(samples).values():
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            donor = []
            ids = model.tokenizer([donors[i].prompt for i in chunk], return_tensors="pt").input_ids
            with torch.no_grad(), model.trace(ids, use_cache=False):
                donor.append(getattr(_envoy(model, layer, site), name)[:, position].save())
            ids = model.tokenizer([samples[i].prompt for i in chunk], return_tensors="pt").input_ids
            with torch.no_grad(), model.trace(ids, use_cache=False):
                getattr(_envoy(model, layer, site), name)[:, position] = donor[0]
                top = model.logits[:, -1].argmax(-1).save()
            out[chunk] = top
    return out
