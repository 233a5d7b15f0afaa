"""``nnterp.long_context_profile``: state norms, decays and effective memory over a sequence of any length.

Mental model. The sequence runs in chunks of ``chunk_size`` tokens, one trace
each, every chunk continuing from what the one before left (`nnterp.chunked_prefill`):
the model's own cache (``cache``; RWKV-4's ``state``), holding each recurrent
layer's state and convolution window and a hybrid's attention keys and
values, and where transformers' forward does not continue exactly from it
(`Family.CHUNKS_DIFFER`), what nnterp writes instead. Per family:

* the DeltaNets, Mamba-2, LFM2, RWKV-4, the xLSTM: the cache carries it all;
* Mamba-1 (``mamba``, ``falcon_mamba``) and Jamba: the cache carries the
  convolution window (and Jamba's keys and values), but the prompt kernel
  restarts the state from zeros; nnterp writes each layer's ``state_input``
  from the ``state_output`` the chunk before read, under `nnterp.fast_states`
  (turned on here), whose split kernel adds what the written state
  contributes (exact: the scan is linear in its start state);
* MiniMax: the cache carries the lightning states and the keys, but the
  forward places a continued chunk's causal mask as if the cache were empty
  (it reads the length from block 0, a lightning block): nnterp hands each
  softmax layer the mask transformers' mask function builds at its index;
* RecurrentGemma: the forward returns no cache and its prefill convolves over
  zeros: nnterp passes the first chunk a cache (for the attention blocks) and
  writes each block's ``conv_state_input`` and ``state_input`` per chunk
  (from transformers 5.23; before, its cache misplaces a continued chunk's
  attention mask, and it runs in one chunk).

A family whose chunks nothing mends is refused beyond one chunk. So
memory holds one chunk's values, the model and its cache (and a state per
recurrent layer where nnterp writes it): constant on a recurrent-only model,
while a hybrid's attention cache grows with the length (as in ``generate``).

Per chunk, for each requested layer, the trace reduces inside itself: the
norm of each head's state after each kept token (``states_of`` at those
tokens: a chunk's states, never the sequence's) and the mean of the log
decay (``decays``) over the state's other axes. Nothing with a token axis
longer than the profile's own output is kept.

Effective memory, after Buitrago & Gu's Effective Remembrance (2507.02782):
``EffRem_T(t) = d(p(. | x_0..x_T), p(. | x_t..x_T))``, how much the
prediction at ``T`` changes when the context before ``t`` is taken away (near
0: the prediction no longer depends on it). Here the context is taken away by
resetting the recurrent state (and convolution window) entering token ``t``
to zeros, which on a recurrent-only model is running ``x_t..x_T`` from a
fresh state (on RWKV-4, the reset zeroes the WKV state, the time mix's
token shift, nnterp's ``conv_state_input``, and the channel mix's token
shift in the state list, `Family.zero_carried_context`). ``d`` here is ``KL(p_full || p_reset)`` of the two
next-token distributions (natural log), so that it reads like nnterp's patch
effects; the paper takes a bounded distance between them (total variation, as
we read it), so compare shapes of curves with the paper's, not values. Two
more differences, both deliberate: ``memory[layer]`` resets that one layer only (which layer keeps
the context; the paper resets the whole model, which is ``memory_all``:
every recurrent layer at once), and on a hybrid the attention layers keep
their cache of ``x_0..x_{t-1}`` (the recurrent state's memory, not the
attention's). ``t`` runs over ``T - lag`` for each lag in ``lags``.

Failure mode worth knowing: every chunk runs with a cache, so a model
transformers cannot run with one (a Qwen3.5 text model whose layers are all
linear attention, `nnterp.recurrent.no_cache`) is refused with `Unavailable`.

Costs: one forward of the sequence, plus, per position ``T`` in
``memory_at`` and lag, one forward of ``lag + 1`` tokens per requested layer
and one for ``memory_all`` (and, on a hybrid, a copy of the attention cache).
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from typing import Any

import nnsight
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .chunked_prefill import ChunkedPrefill, zero_window
from .core.dims import BATCH, CHANNELS, CONV_CHANNELS, LRU_WIDTH, MIXER_HEADS, SEQ
from .core.errors import EmptyPrompt, InvalidArgument, Unavailable, WrongType
from .core.indices import layer_indices
from .profile_result import LongContextProfile
from .recurrent.no_cache import needs_a_cache
from .recurrent.settings import fast_states
from .selection import recurrent_layers

__all__ = ["long_context_profile", "LongContextProfile"]

WHAT = "long_context_profile"
#: The axis a state's norm and a decay's mean are kept per: a head, or a channel where the kind has no heads.
HEAD_AXES = (MIXER_HEADS, CHANNELS, LRU_WIDTH, CONV_CHANNELS)


def long_context_profile(
    model: Any, ids: Any, chunk_size: int = 2048, layers: Any = None, every: int = 1, memory_at: Any = None,
    lags: Any = None, progress: bool = True,
) -> LongContextProfile:
    """Run ``ids`` (``[seq]`` or ``[1, seq]`` token ids) in chunks and profile its recurrent layers (module docstring).

    ``layers``: model layer indices with a recurrent mixer (``None``: all of them). ``every``: keep the norms and
    decays of tokens ``0, every, 2 * every, ...`` only (``.positions``). ``memory_at``: the positions ``T`` at which
    effective memory is measured (``None``: four, evenly spaced, the last token among them); ``lags``: the distances
    ``T - t`` (``None``: 0 and the powers of two up to 4096 below the length). Returns a
    `LongContextProfile`: ``.state_norm[layer]`` and ``.decay[layer]`` ``[tokens, heads]`` (Mamba-1, RG-LRU, RWKV,
    the short convolution: channels; no ``decay`` entry for a short convolution, which has no forget gate),
    ``.memory[layer]`` and ``.memory_all`` ``[len(memory_at), len(lags)]`` (NaN where ``lag > T``).
    """
    ids = _ids(ids)
    n = ids.numel()
    for name, value in (("chunk_size", chunk_size), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"`{WHAT}`: {name} is a positive int (a number of tokens), got {value!r}")
    chosen = _layers(model, layers)
    family = model.family
    cacheless = needs_a_cache(model)
    if cacheless is not None:
        raise Unavailable(f"`{WHAT}`", f"every chunk continues the cache the one before left, and {cacheless}")
    carries = family.continues_chunks()
    if n > chunk_size and not carries:
        raise Unavailable(
            f"`{WHAT}` in chunks of {chunk_size} on {family.NAME}",
            f"{family.CHUNKS_DIFFER}; pass chunk_size >= len(ids) ({n}) to run it in one chunk (memory then grows with the length)",
        )
    if not carries and memory_at not in (None, []):
        raise Unavailable(
            f"`{WHAT}`(memory_at=...) on {family.NAME}",
            f"a reset at t continues the sequence from the cache at t, and {family.CHUNKS_DIFFER}; pass memory_at=[] (the default here)",
        )
    targets = _memory_at(memory_at, n) if carries else []
    distances = _lags(lags, n)
    run = ProfileRun(model, ids, chunk_size, chosen, every, targets, distances)
    mixers = [model.layers[i].linear_attn for i in recurrent_layers(model)]
    fast = any(getattr(type(mixer), "FAST", None) is not None for mixer in mixers)
    with torch.no_grad(), (fast_states(model) if fast else nullcontext()):
        with tqdm(total=n, disable=not progress, desc=WHAT, unit="tok") as bar:
            run.main(bar)
    return run.result()


def _ids(ids: Any) -> torch.Tensor:
    if isinstance(ids, str):
        raise WrongType(f"`{WHAT}` takes token ids, not text: pass model.tokenizer(text, return_tensors='pt').input_ids")
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.tensor(ids, dtype=torch.long)
        except (TypeError, ValueError) as error:
            raise WrongType(f"`{WHAT}` takes token ids as a 1-d tensor or list of ints ({error})") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise InvalidArgument(
            f"`{WHAT}` takes one sequence of token ids, [seq] or [1, seq] integers, got a {ids.dtype} tensor of shape "
            f"{tuple(ids.shape)}: run one sequence per call (ids[i] for row i)"
        )
    if ids.numel() == 0:
        raise EmptyPrompt(f"`{WHAT}`: the sequence has no tokens")
    return ids.long()


def _layers(model: Any, layers: Any) -> list[int]:
    recurrent = recurrent_layers(model)
    if not recurrent:
        raise InvalidArgument(f"`{WHAT}`: {model.family.NAME} has no recurrent mixer on any layer: there is no state to profile")
    if layers is None:
        return recurrent
    found = set(layer_indices(layers, len(model.layers), f"`{WHAT}`(layers=...)"))
    missing = sorted(found - set(recurrent))
    if missing:
        raise InvalidArgument(
            f"`{WHAT}`(layers=...): layer(s) {missing} of {model.family.NAME} have no recurrent mixer; pass some of {recurrent}"
        )
    return sorted(found)


def _memory_at(memory_at: Any, n: int) -> list[int]:
    if memory_at is None:
        return sorted({max(0, math.ceil(n * k / 4) - 1) for k in (1, 2, 3, 4)})
    chosen = [memory_at] if isinstance(memory_at, int) else list(memory_at)
    found = []
    for position in chosen:
        if isinstance(position, bool) or not isinstance(position, int) or not -n <= position < n:
            raise InvalidArgument(f"`{WHAT}`: memory_at holds positions of the sequence's {n} tokens (ints), got {position!r}")
        found.append(position % n)
    return sorted(set(found))


def _lags(lags: Any, n: int) -> list[int]:
    if lags is None:
        return [0] + [1 << k for k in range(13) if 1 << k < n]
    chosen = [lags] if isinstance(lags, int) else list(lags)
    if any(isinstance(lag, bool) or not isinstance(lag, int) or lag < 0 for lag in chosen):
        raise InvalidArgument(f"`{WHAT}`: lags are distances back from T, ints >= 0, got {lags!r}")
    return sorted(set(chosen))


def head_axis(dims: list[str], what: str) -> int:
    """The index in ``dims`` (a value's documented axes) of the axis kept per head (or channel)."""
    for name in HEAD_AXES:
        if name in dims:
            return dims.index(name)
    raise InvalidArgument(f"`{WHAT}`: {what} has no head or channel axis among {dims}")


def reduce(value: torch.Tensor, dims: list[str], how: str) -> torch.Tensor:
    """``value`` (axes ``dims``, batch of 1) as ``[tokens, heads]``: the norm (``how="norm"``) or the mean over the
    other axes. A value without a token axis (RWKV-4's decays, one per channel) is one row."""
    head = head_axis(dims, how)
    others = [i for i, name in enumerate(dims) if i != head and name not in (BATCH, SEQ)]
    order = [i for i in (dims.index(BATCH) if BATCH in dims else None, dims.index(SEQ) if SEQ in dims else None) if i is not None]
    x = value.float().permute(*order, head, *others)
    if BATCH in dims:
        x = x[0]
    if SEQ not in dims:
        x = x[None]
    x = x.reshape(x.shape[0], x.shape[1], -1)
    return x.norm(dim=-1) if how == "norm" else x.mean(dim=-1)


class ProfileRun:
    """One profile's state while it runs: the carried cache, the values kept so far, the pending memory probes."""

    def __init__(self, model: Any, ids: torch.Tensor, chunk_size: int, layers: list[int], every: int, targets: list, lags: list) -> None:
        self.model, self.ids, self.chunk_size, self.layers, self.every = model, ids, chunk_size, layers, every
        self.n = ids.numel()
        self.recurrent = recurrent_layers(model)
        self.targets, self.lags = targets, lags
        self.prefill = ChunkedPrefill(model)
        self.carry = self.prefill.first()
        self.norms: dict = {layer: [] for layer in layers}
        self.decays: dict = {layer: [] for layer in layers}
        self.full: dict = {}
        self.reset: dict = {}
        declared = {layer: type(model.layers[layer].linear_attn).values() for layer in self.recurrent}
        # Each value's documented axes, which say where its head (or channel) and token axes are.
        self.dims = {
            layer: {name: declared[layer][name].annotation.dim_str.split() for name in ("states", "decays") if name in declared[layer]}
            for layer in layers
        }
        # Whether a reset zeroes a convolution window too: where the kind has one (not lightning attention).
        self.conv = {
            layer: "conv_state_input" in declared[layer] and declared[layer]["conv_state_input"].reason(model.layers[layer].linear_attn) is None
            for layer in self.recurrent
        }
        # Where the reset probes start (t = T - lag > 0); t = 0 resets nothing, so its KL is 0 by definition.
        self.probes: dict[int, list] = {}
        for i, T in enumerate(targets):
            for j, lag in enumerate(lags):
                if lag <= T and T - lag > 0:
                    self.probes.setdefault(T - lag, []).append((i, j, T))

    def boundaries(self) -> list[int]:
        cuts = set(range(0, self.n, self.chunk_size)) | set(self.probes)
        return sorted(cuts) + [self.n]

    def main(self, bar: Any) -> None:
        cuts = self.boundaries()
        for start, end in zip(cuts[:-1], cuts[1:]):
            if start in self.probes:
                self.probe(start)
            self.chunk(start, end)
            bar.update(end - start)

    # -- one chunk of the sequence ------------------------------------------------------

    def chunk(self, start: int, end: int) -> None:
        model, layers = self.model, self.layers
        kept = [t - start for t in range(start, end) if t % self.every == 0]
        wanted = [T - start for T in self.targets if start <= T < end]
        prefill, cache = self.prefill, self.carry.cache
        with model.trace(self.ids[None, start:end], **prefill.kwargs(start, end, cache)):
            saved = nnsight.save({})
            for layer in prefill.layers(prefill.masks(start, end, cache)):
                prefill.enter_window(layer, self.carry)
                mixer = model.layers[layer].linear_attn
                if layer in layers and kept and "decays" in self.dims[layer]:
                    saved[("decay", layer)] = reduce(mixer.decays, self.dims[layer]["decays"], "mean")
                prefill.enter_state(layer, self.carry)
                if layer in layers and kept:
                    saved[("norm", layer)] = reduce(mixer.states_of(kept), self.dims[layer]["states"], "norm")
                prefill.leave(layer, saved)
            if wanted:
                saved["logprobs"] = F.log_softmax(model.logits[0, wanted].float(), dim=-1)
            output = model.output.save()
        self.carry = prefill.carry(output, cache, saved)
        for layer in layers:
            if ("norm", layer) in saved:
                self.norms[layer].append(saved[("norm", layer)])
            if ("decay", layer) in saved:
                decay = saved[("decay", layer)]
                self.decays[layer].append(decay[kept] if decay.shape[0] == end - start else decay.expand(len(kept), -1))
        for T, logprobs in zip([T for T in self.targets if start <= T < end], saved.get("logprobs", [])):
            self.full[T] = logprobs

    # -- effective memory: reset probes starting at t ------------------------------------------

    def probe(self, t: int) -> None:
        """Every probe starting at ``t``: the prediction at its ``T`` with the state entering ``t`` zeroed."""
        for i, j, T in self.probes[t]:
            for reset in [*self.layers, None]:
                self.reset[(reset, i, j)] = self.continued(t, T, self.recurrent if reset is None else [reset])

    def continued(self, t: int, T: int, zeroed: list[int]) -> torch.Tensor:
        """The next-token log-probabilities at ``T`` from the cache at ``t``, the ``zeroed`` layers' states zeroed."""
        model, prefill = self.model, self.prefill
        carry = copy.deepcopy(self.carry)
        for layer in zeroed:
            model.family.zero_carried_context(carry.cache, layer)
        first = True
        for start in range(t, T + 1, self.chunk_size):
            end = min(start + self.chunk_size, T + 1)
            with model.trace(self.ids[None, start:end], **prefill.kwargs(start, end, carry.cache)):
                saved = nnsight.save({})
                for layer in prefill.layers(prefill.masks(start, end, carry.cache)):
                    mixer = model.layers[layer].linear_attn
                    if first and layer in zeroed:
                        if self.conv[layer]:
                            zero_window(mixer)
                        # Mamba-1's prompt kernel takes no cached state (None): its carried state has the shape.
                        mixer.state_input = torch.zeros_like(carry.states[layer] if layer in carry.states else mixer.state_input)
                    else:
                        prefill.enter(layer, carry)
                    prefill.leave(layer, saved)
                if end == T + 1:
                    saved["logprobs"] = F.log_softmax(model.logits[0, -1].float(), dim=-1)
                output = model.output.save()
            carry, first = prefill.carry(output, carry.cache, saved), False
        return saved["logprobs"]

    # -- the result -------------------------------------------------------------------------

    def result(self) -> LongContextProfile:
        shape = (len(self.targets), len(self.lags))
        memory = {layer: torch.full(shape, float("nan")) for layer in [*self.layers, None]}
        for key, table in memory.items():
            for i, T in enumerate(self.targets):
                for j, lag in enumerate(self.lags):
                    if lag > T:
                        continue
                    reset = self.reset.get((key, i, j))
                    table[i, j] = 0.0 if reset is None else kl(self.full[T], reset)
        return LongContextProfile(
            state_norm={layer: torch.cat(parts) for layer, parts in self.norms.items()},
            decay={layer: torch.cat(parts) for layer, parts in self.decays.items() if parts},
            memory={layer: memory[layer] for layer in self.layers}, memory_all=memory[None],
            positions=torch.arange(0, self.n, self.every), memory_at=list(self.targets), lags=list(self.lags),
        )


def kl(full: torch.Tensor, reset: torch.Tensor) -> float:
    """``KL(p_full || p_reset)`` of two log-probability vectors (natural log)."""
    return float((full.exp() * (full - reset)).sum().clamp_min(0.0))
