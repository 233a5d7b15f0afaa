"""`ChunkedPrefill`: a sequence run in chunks, each continuing exactly from what the one before left.

Mental model. transformers continues a prompt from the cache an earlier call
returned (``cache``; RWKV-4's ``state``): each recurrent layer's state and
convolution window and a hybrid's attention keys and values. Where its
forward does not continue exactly (`Family.CHUNKS_DIFFER`), the family
declares what nnterp mends, and a chunk carries it to the next (`Carry`):

* ``CHUNK_STATE_INPUT`` (Mamba-1, Jamba, RecurrentGemma): each recurrent
  layer's ``state_input`` written from the ``state_output`` the chunk before
  read (Mamba-1's prompt kernel takes none: `nnterp.fast_states` must be on);
* ``CHUNK_WINDOW_INPUT`` (RecurrentGemma, whose prefill convolves over zeros):
  its ``conv_state_input`` from ``conv_state_output``, a zero window first;
* ``CHUNK_MASK`` (MiniMax): each softmax layer given the causal mask
  transformers' own mask function builds at that layer's index;
* ``first_cache`` (RecurrentGemma, whose forward returns none): the cache
  the first chunk is passed and every later one continues.

Positions (``position_ids``, ``cache_position``) and, on a hybrid, the
attention mask over every token so far are passed as ``generate`` passes them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .selection import recurrent_layers

__all__ = ["Carry", "ChunkedPrefill", "cache_keyword"]


@dataclass
class Carry:
    """What a chunk hands the next: the model's cache, and per recurrent layer the state and window nnterp writes."""

    cache: Any = None
    states: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)


class ChunkedPrefill:
    """One model's chunks: the forward's keywords, the masks, and the writes at a chunk's start (module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model, family = model, model.family
        self.recurrent = recurrent_layers(model)
        parameters = inspect.signature(model._module.forward).parameters
        self.positioned = "position_ids" in parameters
        self.cache_positions = "cache_position" in parameters
        self.softmax = [i for i, layer in enumerate(model.layers) if getattr(layer, "self_attn", None) is not None]
        self.attends = len(self.recurrent) < len(model.layers) or bool(self.softmax)
        self.argument = cache_keyword(parameters, family.CACHE_ARGUMENT)
        self.writes_state, self.writes_window = bool(family.CHUNK_STATE_INPUT), bool(family.CHUNK_WINDOW_INPUT)
        config = model._module.config
        # transformers' mask function for the softmax layers (CHUNK_MASK), and the keyword it takes the cache by
        self.mask = create_causal_mask if getattr(config, "sliding_window", None) is None else create_sliding_window_causal_mask
        self.mask_argument = cache_keyword(inspect.signature(self.mask).parameters, "past_key_values")

    def first(self) -> Carry:
        """What the first chunk starts from: the family's first cache (usually none), nothing written."""
        return Carry(cache=self.model.family.first_cache(self.model._module.config))

    def kwargs(self, start: int, end: int, cache: Any) -> dict:
        """The forward's keywords for tokens ``[start, end)`` continuing ``cache``."""
        kwargs: dict = {"use_cache": True}
        if self.positioned:
            kwargs["position_ids"] = torch.arange(start, end)[None]  # as generate passes them (Bamba counts from 0 without)
        if cache is not None:
            kwargs[self.argument] = cache
        if self.attends:
            # The mask over every token so far, as generate passes it: a chunk's own would hide the cached keys from some
            # families' attention (Bamba's). Only a hybrid gets one; it grows with the length, like its attention cache.
            kwargs["attention_mask"] = torch.ones(1, end, dtype=torch.long)
        if self.cache_positions:
            kwargs["cache_position"] = torch.arange(start, end)
        return kwargs

    def masks(self, start: int, end: int, cache: Any) -> dict:
        """``{layer: mask}``: each softmax layer's causal mask over the cached tokens and the chunk's, built by
        transformers' own mask function at that layer's index, where the family needs it (``CHUNK_MASK``); else ``{}``."""
        if cache is None or not self.model.family.CHUNK_MASK:
            return {}
        config = self.model._module.config
        embeds = torch.empty(1, end - start, config.hidden_size, dtype=self.model._module.dtype)  # its shape and dtype
        common = {"config": config, "inputs_embeds": embeds, "attention_mask": torch.ones(1, end, dtype=torch.long), self.mask_argument: cache}
        return {layer: self.mask(**common, position_ids=torch.arange(start, end)[None], layer_idx=layer) for layer in self.softmax}

    def layers(self, masks: dict) -> Any:
        """Inside a trace: the recurrent layers in the order the model runs, each softmax layer's mask in ``masks``
        written on the way."""
        for layer in sorted({*self.recurrent, *masks}):
            if layer not in masks:
                yield layer
                continue
            attention = self.model.layers[layer].self_attn
            args, kwargs = attention.inputs
            attention.inputs = (args, {**kwargs, "attention_mask": masks[layer]})

    def enter_window(self, layer: int, carry: Carry) -> None:
        """Inside a trace, before any other value of ``layer``'s call: the window ``carry`` holds written where the
        family needs it (a zero window where it holds none yet: a sequence's start)."""
        mixer = self.model.layers[layer].linear_attn
        if self.writes_window:
            if layer in carry.windows:
                mixer.conv_state_input = carry.windows[layer]
            else:
                zero_window(mixer)

    def enter_state(self, layer: int, carry: Carry) -> None:
        """Inside a trace, before the state's first read (and after the values computed before the recurrence, such
        as the RG-LRU's gates): the state ``carry`` holds written where the family needs it."""
        if self.writes_state and layer in carry.states:
            self.model.layers[layer].linear_attn.state_input = carry.states[layer]

    def enter(self, layer: int, carry: Carry) -> None:
        """`enter_window`, then `enter_state`."""
        self.enter_window(layer, carry)
        self.enter_state(layer, carry)

    def leave(self, layer: int, saved: dict) -> None:
        """Inside a trace, after ``layer``'s other values: what the next chunk needs of it, into ``saved``."""
        mixer = self.model.layers[layer].linear_attn
        if self.writes_state:
            saved[("state", layer)] = mixer.state_output
        if self.writes_window:
            saved[("window", layer)] = mixer.conv_state_output

    def carry(self, output: Any, passed: Any, saved: dict) -> Carry:
        """What the chunk just run hands the next: the cache its output returned (or the one it was passed, where the
        forward returns none) and the states and windows ``leave`` saved."""
        cache = getattr(output, self.argument, None)
        return Carry(
            cache=passed if cache is None else cache,
            states={layer: saved[("state", layer)] for layer in self.recurrent if ("state", layer) in saved},
            windows={layer: saved[("window", layer)] for layer in self.recurrent if ("window", layer) in saved},
        )


def cache_keyword(parameters: Any, declared: str) -> str:
    """The keyword a forward (or mask function) of the installed transformers takes its cache by, and the field its
    output returns it in: transformers 5.24 renamed them all to ``cache`` (before: ``past_key_values``, Mamba's
    ``cache_params``); a name the signature lacks would be swallowed by ``**kwargs`` and the cache silently dropped."""
    for name in ("cache", declared, "cache_params", "past_key_values"):
        if name in parameters:
            return name
    return declared


def zero_window(mixer: Any) -> None:
    """Inside a trace: ``mixer``'s convolution window entering its call zeroed, where it has one (``None``: a
    prompt's, which transformers already convolves over zeros)."""
    window = mixer.conv_state_input
    if window is not None:
        mixer.conv_state_input = torch.zeros_like(window)
