"""Measurements on the associative-recall toys, through nnterp's public values only.

Mental model: in a recall prompt (``k v k v ... k v`` then a queried key) the
context ends at token ``T = 2 * pairs - 1``; what the query can read of it is
what each mixer carries past ``T``: a recurrent layer's state and its
convolution window (the mixer's inputs at the last ``conv_width - 1`` tokens),
an attention layer's keys and values. `swap_memory` replaces the recurrent
layers' part with a *donor* context's (same keys in the same order, other
values, `AssociativeRecall.donor`) and reports which value the model answers:

* on a model whose every layer is recurrent, inside one prompt: each layer's
  ``set_state_after(T, donor_state)`` and, for the window, its ``layer_input``
  at tokens ``T - conv_width + 2 .. T`` written with the donor's (a prompt's
  convolution reads its window from the sequence, not from a cache). Written
  together, everything the query sees is the donor's, so the logits are the
  donor prompt's to float rounding (the tests check it against a plain
  transformers forward of the donor prompt);
* on a hybrid, where the attention layers must keep the clean context, on a
  decode step: the clean context runs with a cache, then the query runs on it
  with ``conv_state_input`` and ``state_input`` of every recurrent layer
  assigned the donor context's ``conv_state_output`` and ``state_output``.

Samples are batched by length (same pair count), so no row is padded.
"""

from __future__ import annotations

import copy
import inspect
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from nnterp.chunked_prefill import cache_keyword
from nnterp.sweep import per_token_states
from nnterp.testing.tasks import VALUES, Sample

__all__ = ["answers", "conv_width", "corrupt_value", "length_groups", "onset", "recurrent_layers", "swap_memory", "knock_out_attention"]


def recurrent_layers(model: Any) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]


def conv_width(model: Any) -> int:
    config = model.config.get_text_config()
    return int(getattr(config, "linear_conv_kernel_dim", None) or config.conv_kernel)


def _ids(model: Any, prompts: Sequence[str]) -> torch.Tensor:
    return model.tokenizer(list(prompts), return_tensors="pt").input_ids


def length_groups(samples: Sequence[Sample]) -> dict[int, list[int]]:
    """``{length: [index, ...]}``: the samples' indices by prompt length (a batch of one length needs no padding)."""
    groups = defaultdict(list)
    for index, sample in enumerate(samples):
        groups[len(sample.words)].append(index)
    return groups


def _token(model: Any, words: Sequence[str]) -> torch.Tensor:
    return torch.tensor(model.tokenizer.convert_tokens_to_ids(list(words)))


def answers(model: Any, samples: Sequence[Sample], batch: int = 64) -> torch.Tensor:
    """The model's argmax after each sample's prompt (one trace per batch of equal-length prompts), ``[n]`` ids."""
    out = torch.empty(len(samples), dtype=torch.long)
    for rows in length_groups(samples).values():
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            with torch.no_grad(), model.trace(_ids(model, [samples[i].prompt for i in chunk]), use_cache=False):
                top = model.logits[:, -1].argmax(-1).save()
            out[chunk] = top
    return out


def _swap_in_prompt(model, ids, donor_ids, T, state, window):
    layers = recurrent_layers(model)
    w = conv_width(model)
    donor_inputs, donor_states, clean_states = [], [], []
    with per_token_states(model):
        with torch.no_grad(), model.trace(donor_ids, use_cache=False):
            for i in layers:  # forward order: a layer's input before its state
                donor_inputs.append(model.layers[i].layer_input[:, T - w + 2:T + 1].save())
                donor_states.append(model.layers[i].linear_attn.state_after(T).save())
        if window and not state:
            with torch.no_grad(), model.trace(ids, use_cache=False):
                for i in layers:
                    clean_states.append(model.layers[i].linear_attn.state_after(T).save())
        with torch.no_grad(), model.trace(ids, use_cache=False):
            for n, i in enumerate(layers):
                if window:
                    model.layers[i].layer_input[:, T - w + 2:T + 1] = donor_inputs[n]
                if state or window:  # window alone: the state the donor's window changed is put back
                    model.layers[i].linear_attn.set_state_after(T, donor_states[n] if state else clean_states[n])
            logits = model.logits[:, -1].save()
    return logits


def _swap_on_decode(model, ids, donor_ids, T, state, window):
    mixes = [model.layers[i].linear_attn for i in recurrent_layers(model)]
    donor_states, donor_windows = [], []
    with torch.no_grad(), model.trace(donor_ids[:, :T + 1]):
        for mix in mixes:  # within a layer the kernel returns (state) before the block does (window)
            donor_states.append(mix.state_output.save())
            donor_windows.append(mix.conv_state_output.save())
    keyword = cache_keyword(inspect.signature(model._module.forward).parameters, model.family.CACHE_ARGUMENT)
    with torch.no_grad(), model.trace(ids[:, :T + 1]):
        cache = getattr(model.output, keyword).save()
    with torch.no_grad(), model.trace(ids[:, T + 1:], **{keyword: copy.deepcopy(cache)}):
        for mix, s, win in zip(mixes, donor_states, donor_windows):
            if window:
                mix.conv_state_input = win  # the convolution runs before the kernel
            if state:
                mix.state_input = s
        logits = model.logits[:, -1].save()
    return logits


def swap_memory(model: Any, samples: Sequence[Sample], donors: Sequence[Sample], *, state: bool = True,
                window: bool = True, batch: int = 64) -> torch.Tensor:
    """The argmax after each sample's query once every recurrent layer's state and/or window after
    the context is the donor's (see the module doc), ``[n]`` ids."""
    hybrid = len(recurrent_layers(model)) < len(model.layers)
    out = torch.empty(len(samples), dtype=torch.long)
    for rows in length_groups(samples).values():
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            ids = _ids(model, [samples[i].prompt for i in chunk])
            donor_ids = _ids(model, [donors[i].prompt for i in chunk])
            T = ids.shape[1] - 2  # the last context token; the query key follows
            swap = _swap_on_decode if hybrid else _swap_in_prompt
            out[chunk] = swap(model, ids, donor_ids, T, state, window).argmax(-1)
    return out


def knock_out_attention(model: Any, samples: Sequence[Sample], layer: int, donors: Sequence[Sample] | None = None,
                        batch: int = 64) -> torch.Tensor:
    """The argmax after each prompt with attention layer ``layer``'s output at the query zeroed
    (or, with ``donors``, replaced by its output on the donor prompt), ``[n]`` ids."""
    out = torch.empty(len(samples), dtype=torch.long)
    attention = model.layers[layer].self_attn
    for rows in length_groups(samples).values():
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            replacement = []
            if donors is not None:
                with torch.no_grad(), model.trace(_ids(model, [donors[i].prompt for i in chunk]), use_cache=False):
                    replacement.append(attention.attention_output[:, -1].save())
            with torch.no_grad(), model.trace(_ids(model, [samples[i].prompt for i in chunk]), use_cache=False):
                value = attention.attention_output
                value[:, -1] = replacement[0] if replacement else 0.0
                top = model.logits[:, -1].argmax(-1).save()
            out[chunk] = top
    return out


def answer_ids(model: Any, samples: Sequence[Sample]) -> torch.Tensor:
    """Each sample's answer as a token id, ``[n]``."""
    return _token(model, [s.answer for s in samples])


def corrupt_value(sample: Sample, rng: random.Random) -> tuple[str, str]:
    """``(prompt, value)``: ``sample``'s prompt with the queried pair's value replaced by a value of no pair of it."""
    taken = {value for _, value in sample.pairs}
    other = rng.choice([v for v in VALUES if v not in taken])
    where = sample.value_positions[sample.queried]
    return " ".join(other if i == where else w for i, w in enumerate(sample.words)), other


def onset(estimate: torch.Tensor, share: float = 0.5) -> int:
    """The first index of a layer's row of estimates ``[positions]`` whose size reaches ``share`` of the row's largest.

    A binding, once written, is in every later state of its layer, so replacing the state after any token from the
    write to the query replaces it: `state_attribution`'s row is a plateau from the write on, and its largest cell
    anywhere on it. Where the plateau starts is the write.
    """
    size = estimate.abs()
    return int((size >= share * size.max()).nonzero()[0])
