"""Prompt pairs, grouped by length: the batches every circuits call runs.

Mental model. A call takes ``clean`` and ``corrupt`` prompts, pair ``i`` being ``(clean[i], corrupt[i])``. A patch
moves a node's output at token ``t`` of the corrupt run into token ``t`` of the clean run, so the two prompts of a
pair have one token count; pairs may differ in length from each other. The pairs are grouped by length and each
group runs as its own batches, with no padding: a score or a metric averaged over the pairs is the pair-weighted
average of the runs of each length, exactly. The ``pairs`` a metric receives (``metric(logits, pairs)``) are the
pairs' indices in the call's lists, whatever group they ran in.

What a position means across lengths:

* ``positional=True``: an edge ``(u, v, s)`` names source position ``s`` of prompts of one length, so over pairs of
  several lengths it raises `ShapeError`, naming the fix (one call per length);
* ``ablation="mean"``: a clean prompt's patched edges take their mean over the corrupt prompts *of its own length*,
  per position (a length with no corrupt prompt raises; corrupt prompts of a length no clean prompt has take no
  part).

Prompts: a string, a list of strings, token ids ``[n, seq]`` or ``[seq]``, or a list of token id lists or 1-D tensors
(of any lengths).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import InvalidArgument, ShapeError, WrongType

__all__ = ["Group", "prompt_rows", "group_pairs", "one_length"]


@dataclass
class Group:
    """The pairs of one length.

    Attributes:
        pairs: ``[k]``, the pairs' indices in the call's lists (LongTensor), increasing.
        clean: ``[k, seq]``, their clean token ids.
        corrupt: ``[k, seq]``, their corrupt token ids; with ``ablation="mean"``, every corrupt prompt of this length
            ``[m, seq]`` (the ones the mean is over).
        paired: whether ``corrupt[i]`` is pair ``pairs[i]``'s (``ablation="corrupt"``).
    """

    pairs: torch.Tensor
    clean: torch.Tensor
    corrupt: torch.Tensor
    paired: bool = True

    @property
    def seq(self) -> int:
        return int(self.clean.shape[1])

    def batches(self, size: int | None) -> Iterator[tuple]:
        """``(pairs, clean, corrupt)`` of at most ``size`` pairs each (``None``: the whole group), in order; ``corrupt``
        is the batch's own corrupt prompts where the group pairs them (``ablation="corrupt"``), else all of them."""
        step = size or len(self.pairs)
        for start in range(0, len(self.pairs), step):
            rows = slice(start, start + step)
            yield self.pairs[rows], self.clean[rows], self.corrupt[rows] if self.paired else self.corrupt


def prompt_rows(model: Any, prompts: Any, what: str) -> list:
    """Each prompt's token ids, a 1-D LongTensor per prompt (lengths may differ)."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts.unsqueeze(0) if prompts.dim() == 1 else prompts
        if ids.dim() != 2 or ids.is_floating_point():
            raise ShapeError(f"{what}: token ids are an integer tensor [n, seq], got {tuple(prompts.shape)} {prompts.dtype}")
        return list(ids.long())
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise WrongType(f"{what}: a prompt, a list of prompts, ids [n, seq] or a list of id lists, got {type(prompts).__name__}")
    rows = []
    for prompt in prompts:
        if isinstance(prompt, str):
            prompt = model.tokenizer(prompt).input_ids
        row = torch.as_tensor(prompt)
        if row.dim() != 1 or row.is_floating_point() or row.dtype == torch.bool:
            raise WrongType(f"{what}: each prompt is a string or a list / 1-D tensor of token ids, got {prompt!r:.80}")
        if not len(row):
            raise ShapeError(f"{what}: prompt {len(rows)} has no tokens")
        rows.append(row.long())
    return rows


def group_pairs(model: Any, clean: Any, corrupt: Any, ablation: str = "corrupt") -> list:
    """The pairs of ``clean`` and ``corrupt`` grouped by length (`Group`, by increasing length): the groups' ``pairs``
    together are ``0 .. len(clean) − 1``. ``ablation="mean"``: each group holds the corrupt prompts of its length."""
    if ablation not in ("corrupt", "mean"):
        raise InvalidArgument(f"ablation is 'corrupt' or 'mean', got {ablation!r}")
    clean_rows, corrupt_rows = prompt_rows(model, clean, "clean"), prompt_rows(model, corrupt, "corrupt")
    lengths = sorted({len(row) for row in clean_rows})
    if ablation == "corrupt":
        if len(clean_rows) != len(corrupt_rows):
            raise ShapeError(f"{len(clean_rows)} clean and {len(corrupt_rows)} corrupt prompts: pass one corrupt prompt per clean one (pair i is clean[i], corrupt[i])")
        for i, (a, b) in enumerate(zip(clean_rows, corrupt_rows)):
            if len(a) != len(b):
                raise ShapeError(
                    f"pair {i}: the clean prompt is {len(a)} tokens long and the corrupt one {len(b)}; a patch moves token t of the "
                    "corrupt run to token t of the clean one, so pass pairs of prompts of one length (reword or pad the shorter "
                    "of the two; different pairs may have different lengths)"
                )
    groups = []
    for length in lengths:
        chosen = [i for i, row in enumerate(clean_rows) if len(row) == length]
        if ablation == "corrupt":
            donors = [corrupt_rows[i] for i in chosen]
        else:
            donors = [row for row in corrupt_rows if len(row) == length]
            if not donors:
                raise ShapeError(
                    f"ablation='mean' takes the mean over the corrupt prompts of each clean prompt's length, and no corrupt "
                    f"prompt is {length} tokens long (clean prompts {chosen}): add corrupt prompts of that length"
                )
        groups.append(Group(torch.tensor(chosen), torch.stack([clean_rows[i] for i in chosen]), torch.stack(donors), ablation == "corrupt"))
    return groups


def one_length(groups: list, what: str) -> int:
    """The one length of ``groups``' prompts; `ShapeError` naming ``what`` needs it where they have several."""
    if len(groups) != 1:
        raise ShapeError(
            f"{what} names source positions of prompts of one length, and these pairs are {[g.seq for g in groups]} tokens "
            "long: run one call per length (the pairs of each length apart)"
        )
    return groups[0].seq
