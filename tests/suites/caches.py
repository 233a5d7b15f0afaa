"""Where each kind's state sits in the plain transformers model: the oracles' side of the state contract.

An adapter reads and replaces one layer's state in what the plain model
carries between calls (its cache, its returned state list, its modules), and
drives it by its own forward: a prompt call (``prefill``) and one-token calls
(``step``). From those four the oracles follow, the same for every kind: the
state after each prefix (``prefix_states``, one independent forward per
prefix), a forward whose state is replaced after token ``T`` and the rest fed
one token at a time (``continue_from``), and a greedy loop with a state
replaced before a decode step (``greedy``). None of it uses nnterp; a value
nnterp serves goes through ``to_cache`` on the way in and ``served`` on the
way out, which only re-lay the same numbers.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

from tests.reference import hf_oracles as hf
from tests.reference import mlstm as mlstm_ref
from tests.reference import rg_lru as rg_lru_ref


class Cache:
    """transformers' cache object, ``recurrent_states[0]`` of each layer (DeltaNet, Kimi, Mamba-1 and -2)."""

    def prefill(self, plain, ids):
        out = self._call(plain, ids, None, 0)
        return out.logits, hf.output_cache(out)

    def step(self, plain, token, position: int, cache):
        return self._call(plain, token, cache, position).logits, cache

    def _call(self, plain, ids, cache, start: int):
        # Positions as generate passes them (Bamba's forward counts from 0 on every call without them).
        kwargs = {"use_cache": True}
        if cache is not None:
            kwargs[hf.cache_kwarg(plain)] = cache
        if "position_ids" in inspect.signature(plain.forward).parameters:
            kwargs["position_ids"] = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
        return plain(input_ids=ids, **kwargs)

    def read(self, cache, layer: int):
        return hf.recurrent_state(cache, layer).clone()

    def write(self, cache, layer: int, value) -> None:
        hf.set_recurrent_state(cache, layer, self.to_cache(value))

    def to_cache(self, value):
        return value

    def served(self, value):
        return value

    # -- the oracles, from the four above ----------------------------------------------

    @torch.no_grad()
    def prefix_states(self, plain, ids, layer: int):
        """The state after each prefix ``ids[:, :t+1]`` (stacked on axis 1), from independent forwards."""
        found = [self.read(self.prefill(plain, ids[:, : t + 1])[1], layer) for t in range(ids.shape[1])]
        return _stack(found)

    @torch.no_grad()
    def continue_from(self, plain, ids, T: int, layer: int, value) -> tuple:
        """``(logits of each token after T, the state after each)`` once the state after ``T`` is ``value``.

        With ``T`` the last token nothing runs after the write: ``(None, None)``.
        """
        _, cache = self.prefill(plain, ids[:, : T + 1])
        self.write(cache, layer, value)
        logits, states = [], []
        for i in range(T + 1, ids.shape[1]):
            out, cache = self.step(plain, ids[:, i : i + 1], i, cache)
            logits.append(out[:, -1])
            states.append(self.read(cache, layer))
        return (torch.stack(logits, 1), _stack(states)) if logits else (None, None)

    @torch.no_grad()
    def greedy(self, plain, ids, new: int, patch: Callable | None = None) -> torch.Tensor:
        """A plain greedy loop (EOS never chosen, as generate's ``min_new_tokens``); ``patch(step, cache)`` before
        decode step ``step`` (1 is the first one-token call)."""
        eos = plain.config.get_text_config().eos_token_id
        logits, cache = self.prefill(plain, ids)
        for step in range(1, new + 1):
            last = logits[:, -1].clone()
            last[:, [eos] if isinstance(eos, int) else list(eos or ())] = float("-inf")
            token = last.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], 1)
            if step == new:
                return ids
            if patch is not None:
                patch(step, cache)
            logits, cache = self.step(plain, token, ids.shape[1] - 1, cache)
        return ids


class ConvCache(Cache):
    """transformers' cache, the convolution window of each layer (LFM2's gated short convolution)."""

    def read(self, cache, layer: int):
        return hf.conv_state(cache, layer).clone()

    def write(self, cache, layer: int, value) -> None:
        hf.set_conv_state(cache, layer, value)


class LinearCache(Cache):
    """MiniMax's cache, ``linear_cache[layer]`` (lightning attention)."""

    def _call(self, plain, ids, cache, start: int):
        kwargs = {"use_cache": True, "position_ids": torch.arange(start, start + ids.shape[1])[None]}
        if cache is not None:
            kwargs[hf.cache_kwarg(plain)] = cache
        return plain(input_ids=ids, **kwargs)

    def read(self, cache, layer: int):
        return cache.linear_cache[layer].clone()

    def write(self, cache, layer: int, value) -> None:
        cache.set_linear_cache(layer, value.clone())


class XLSTMCache(Cache):
    """xLSTM's cache, ``rnn_state[layer] = (C, n, m)``; nnterp packs the three in one tensor (the mLSTM)."""

    def __init__(self, unpack: Callable):
        self.unpack = unpack  # the packed layout's split (`MLSTM.unpack`): a re-lay of the same numbers

    def _call(self, plain, ids, cache, start: int):
        kwargs = {"use_cache": True} if cache is None else {"use_cache": True, hf.cache_kwarg(plain): cache}
        return plain(ids, **kwargs)

    def fresh(self, plain, batch: int):
        """The empty cache a prompt starts from, to write an entering state in."""
        return sys.modules[type(plain).__module__].xLSTMCache(plain.config, batch, dtype=torch.float32)

    def read(self, cache, layer: int):
        c, n, m = (x.clone() for x in cache.rnn_state[layer])
        return c, n, m[..., 0]

    def write(self, cache, layer: int, value) -> None:
        mlstm_ref.set_layer_state(cache, layer, self.to_cache(value))

    def to_cache(self, value):
        return self.unpack(value)

    def served(self, value):
        c, n, m = self.unpack(value)
        return c, n, m[..., 0]


class PackedXLSTMCache(XLSTMCache):
    """xLSTM's cache read as the one packed tensor nnterp serves (``C``, ``n``, ``m`` side by side), for the tests
    run over every kind with a fast path, which compare one tensor per state."""

    def __init__(self, pack: Callable, unpack: Callable):
        super().__init__(unpack)
        self.pack = pack  # the packed layout's join (`MLSTM.pack`): a re-lay of the same numbers

    def read(self, cache, layer: int):
        return self.pack(*(x.clone() for x in cache.rnn_state[layer]))

    def served(self, value):
        return value


class WKVState(Cache):
    """RWKV-4's returned ``state``: five ``[batch, hidden, layers]`` tensors, 2 / 3 / 4 the WKV numerator,
    denominator and maximum (0 and 1 the token shifts); it carries no cache object."""

    PARTS = (2, 3, 4)

    def prefill(self, plain, ids):
        out = plain(ids, use_cache=True)
        return out.logits, out.state

    def step(self, plain, token, position: int, state):
        out = plain(token, state=state, use_cache=True)
        return out.logits, out.state

    def read(self, state, layer: int):
        return torch.stack([state[i][:, :, layer] for i in self.PARTS], 1).clone()

    def write(self, state, layer: int, value) -> None:
        for i, part in zip(self.PARTS, value.unbind(1)):
            state[i][:, :, layer] = part

    def fresh(self, plain, batch: int) -> list:
        """The state list the model starts a prompt from (as its forward builds it): zeros, the maximum at -1e30."""
        config = plain.config
        state = [torch.zeros(batch, config.hidden_size, config.num_hidden_layers) for _ in range(5)]
        state[4] -= 1e30
        return state


class ModuleState(Cache):
    """RecurrentGemma keeps the RG-LRU's state on its modules (``temporal_block.rg_lru.recurrent_states``)."""

    def prefill(self, plain, ids):
        logits, cache = rg_lru_ref.prefill(plain, ids)
        return logits, (plain, cache)

    def step(self, plain, token, position: int, cache):
        return rg_lru_ref.step(plain, token, position, cache[1])[:, None], cache

    def read(self, cache, layer: int):
        return rg_lru_ref.block(cache[0], layer).rg_lru.recurrent_states.clone()

    def write(self, cache, layer: int, value) -> None:
        rg_lru_ref.block(cache[0], layer).rg_lru.recurrent_states = value.clone()


def _stack(states: list):
    if isinstance(states[0], tuple):
        return tuple(torch.stack(parts, 1) for parts in zip(*states))
    return torch.stack(states, 1)


def of_kind(mixer: type) -> Cache:
    """The adapter of a kind with a fast path, for the tests run over every such kind (its suite's ``CACHE``)."""
    from nnterp.components.lightning_attention import LightningAttention
    from nnterp.components.mlstm import MLSTM
    from nnterp.components.rg_lru import RGLRU
    from nnterp.components.short_convolution import ShortConvolution
    from nnterp.components.wkv import WKV

    if issubclass(mixer, MLSTM):
        return PackedXLSTMCache(MLSTM.pack, MLSTM.unpack)
    if issubclass(mixer, ShortConvolution):
        return ConvCache()
    if issubclass(mixer, LightningAttention):
        return LinearCache()
    return ModuleState() if issubclass(mixer, RGLRU) else WKVState() if issubclass(mixer, WKV) else Cache()
