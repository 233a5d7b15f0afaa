"""``model.knockout``: token-to-token knockout on every mixer and attention layer of a model at once.

The knockout itself is each part's: ``linear_attn.knockout``
(`nnterp.recurrent.knockout`) and ``self_attn.knockout``
(`nnterp.components.attention.Attention.knockout`), which this module's
docstring describes for attention:

Mental model. An attention head's output at ``t`` is ``Σ_s a[t, s] · v_s``
with ``a`` its softmax weights; knocking out the flow from source ``s`` to
target ``t`` is editing ``a[t, s]``, in the eager forward (load the model
with ``StandardizedTransformer(..., enable_attention_probs=True)``):

* ``mode="value"``: the term ``a[t, s] · v_s`` removed, every other weight as
  it was (no renormalization): the exact analogue of a recurrent mixer's
  ``knockout(mode="value")``, which removes ``A[t, s] · v_s`` from its
  effective attention (`nnterp.recurrent.knockout`);
* ``mode="mask"``: the pre-softmax score of ``(t, s)`` set to ``-inf`` and the
  row renormalized (Geva et al. 2023's attention knockout), computed as
  ``a[t, s] = 0`` and the row divided by what is left of it (an attention
  sink's share, where the family has one, stays in the denominator, as the
  softmax keeps it).

Positions are positions of this call (negative ones count from the end), as
the recurrent mixers take them; on a decode step with a cache the keys before
the call are not positions of it. Every head is knocked out.

`model_knockout` is ``model.knockout``: the same knockout on the mixer and
the attention layer of each listed layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .core.errors import InvalidArgument, WrongType
from .core.indices import layer_indices
from .plot import patch_effect
from .recurrent.knockout import as_positions


def model_knockout(model: Any, sources: Any, targets: Any = None, layers: Any = None, mode: str = "value") -> None:
    """``model.knockout``: the knockout on every mixer and attention layer of ``layers`` (default: all), in layer order.

    ``mode="value"`` acts on both kinds; ``"skip"`` on the mixers only and ``"mask"`` on the attention layers
    only (a layer that has neither part for the mode raises).
    """
    what = "model.knockout"
    if mode not in ("value", "skip", "mask"):
        raise InvalidArgument(f"`{what}`: mode must be 'value', 'skip' (recurrent mixers) or 'mask' (attention layers), got {mode!r}")
    chosen = layer_indices(layers, len(model.layers), what) if layers is not None else range(len(model.layers))
    acted = False
    for index in chosen:
        layer = model.layers[index]
        mixer, attention = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        if mixer is not None and mode != "mask":
            mixer.knockout(sources, targets=targets, mode=mode)
            acted = True
        if attention is not None and mode != "skip":
            attention.knockout(sources, targets=targets, mode=mode)
            acted = True
    if not acted:
        part = {"skip": "a recurrent mixer", "mask": "an attention layer"}.get(mode, "a mixer or an attention layer")
        raise InvalidArgument(f"`{what}`: none of layers {list(chosen)} has {part} for mode={mode!r}")


@dataclass
class KnockoutSweepResult:
    """What `knockout_sweep` gathered.

    Attributes:
        layers: the knocked-out layers (rows).
        positions: the source positions (columns), from 0.
        tokens: the prompt's tokens (``convert_ids_to_tokens``).
        clean: the metric on the prompt with nothing knocked out.
        values: ``[len(layers), len(positions)]``, the metric with that cell's knockout; NaN where not run.
        complete: ``False`` when the sweep was interrupted (Ctrl-C).
    """

    layers: list
    positions: list
    tokens: list
    clean: float
    values: torch.Tensor
    complete: bool

    @property
    def effects(self) -> torch.Tensor:
        """``values - clean``, ``[layers, sources]``: how much knocking out each (layer, source) moved the metric."""
        return self.values - self.clean

    effect = effects  # the name `nnterp.plot.patch_effect` reads, as on a patch sweep's result

    @property
    def done(self) -> int:
        """How many cells were run."""
        return int(torch.isfinite(self.values).sum())

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` cells with the largest ``|effect|``: ``[(layer, source, effect)]``, largest first."""
        flat = torch.nan_to_num(self.effects.abs(), nan=-1.0).reshape(-1)
        order = flat.argsort(descending=True)[: min(k, self.done)]
        width = len(self.positions)
        return [(self.layers[i // width], self.positions[i % width], float(self.effects.reshape(-1)[i])) for i in order.tolist()]

    def plot(self, label: str = "Δ metric", title: str = "Effect of a knockout on the metric") -> Any:
        """A heatmap, layers × source positions (`nnterp.plot.patch_effect`), beside `patch_sweep`'s."""
        return patch_effect(self, label=label, title=title, xlabel="knocked-out source position")


def _metric_of(metric: Callable, logits: torch.Tensor, what: str) -> float:
    value = metric(logits)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidArgument(f"`{what}`: metric(logits) must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongType(f"`{what}`: metric(logits) must return a number, got {type(value).__name__}")
    return float(value)


def knockout_sweep(
    model: Any, prompt: str, metric: Callable, sources: Any = None, layers: Any = None, targets: Any = -1,
    mode: str = "value", batch_size: int | None = None, progress: bool = True, **trace_kwargs: Any,
) -> KnockoutSweepResult:
    """One ``model.knockout(s, targets, layers=[layer], mode)`` per (layer, source) cell, and the metric of each.

    ``metric(logits)`` takes one run's logits ``[seq, vocab]`` (float32) and returns a number (``lambda l:
    l[-1].log_softmax(-1)[token]``). ``sources``: positions of the prompt (default: every one); ``layers``:
    model layers (default: every layer with a part this ``mode`` acts on now: see ``support()``'s
    ``knockout`` rows); ``targets``: as `knockout` takes them (default: the last token). The cells of one layer
    run batched, a batch row per source (one ``tracer.invoke`` each, ``batch_size`` at a time; ``None``: all
    sources in one batch), so each cell equals its single knockout run alone within float32 rounding; the rows
    of a batch share the knocked-out layer's effective-attention rows (computed once, where their inputs are
    equal: `nnterp.recurrent.knockout.shared_in_run`). A tqdm
    bar counts the cells; Ctrl-C returns what was gathered with ``complete=False`` (cells not run are NaN).
    ``trace_kwargs`` go to every ``model.trace`` (``use_cache=False`` on a model with no attention layer).
    """
    what = "knockout_sweep"
    if not callable(metric):
        raise WrongType(f"`{what}` takes a metric callable (logits [seq, vocab] -> number), got {type(metric).__name__}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidArgument(f"`{what}`: batch_size is a positive int or None, got {batch_size!r}")
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    seq = ids.shape[1]
    positions = list(range(seq)) if sources is None else as_positions(sources, seq, f"`{what}` sources")
    chosen = _sweep_layers(model, layers, mode, what)
    with torch.no_grad(), model.trace(ids, **trace_kwargs):
        clean_logits = model.logits.save()
    clean = _metric_of(metric, clean_logits[0].float(), what)
    values = torch.full((len(chosen), len(positions)), float("nan"))
    step = batch_size or len(positions)
    from tqdm.auto import tqdm

    complete = True
    with tqdm(total=values.numel(), disable=not progress, desc=what) as bar:
        try:
            for row, layer in enumerate(chosen):
                for start in range(0, len(positions), step):
                    batch = positions[start : start + step]
                    saved: list = []
                    with torch.no_grad(), model.trace(**trace_kwargs) as tracer:
                        for s in batch:
                            with tracer.invoke(ids):
                                model.knockout(s, targets=targets, layers=[layer], mode=mode)
                                saved.append(model.logits.save())
                    for column, logits in enumerate(saved, start):
                        values[row, column] = _metric_of(metric, logits[0].float(), what)
                    bar.update(len(batch))
        except KeyboardInterrupt:
            complete = False
    tokens = model.tokenizer.convert_ids_to_tokens(ids[0])
    return KnockoutSweepResult(chosen, positions, tokens, clean, values, complete)


def _sweep_layers(model: Any, layers: Any, mode: str, what: str) -> list[int]:
    """The listed layers, or every layer with a part ``mode`` acts on now."""
    if layers is not None:
        return list(layer_indices(layers, len(model.layers), what))
    found = []
    for index, layer in enumerate(model.layers):
        parts = [getattr(layer, "linear_attn", None) if mode != "mask" else None, getattr(layer, "self_attn", None) if mode != "skip" else None]
        reasons = [part.interventions()["knockout.skip" if mode == "skip" else "knockout"] for part in parts if part is not None]
        if reasons and all(reason is None for reason in reasons):
            found.append(index)
    if not found:
        raise InvalidArgument(f"`{what}`: no layer can be knocked out with mode={mode!r} now: see model.support()'s knockout rows")
    return found
