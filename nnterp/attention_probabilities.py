"""``model.attention_probabilities``: nnterp 1.x's accessor of the softmax weights, with its switch and checks.

``model.attention_probabilities[i]`` reads and writes layer i's
``self_attn.attention_probabilities`` (``[batch, heads, seq, seq]``, eager
attention only: load with ``enable_attention_probs=True``), as the other
per-layer accessors do. As in 1.x it also carries:

* ``enabled``: whether it serves now (eager attention, and not disabled);
  ``model.attn_probs_available`` is the same answer;
* ``disable()``: refuse every later read and write, with `Unavailable`;
* ``check_source(layer)``: run a prompt and check the weights' shape, that
  each row sums to 1 and that writing them changes the logits;
* ``print_source(layer)``: print where the weights are read (the
  ``torch.matmul(weights, values)`` call of the family's eager attention)
  and the function it sits in.

``layer`` defaults to the first layer with softmax attention: layer 0 on a
transformer, as in 1.x, and the first attention block of a hybrid.
"""

from __future__ import annotations

from typing import Any

import torch

from .accessors import LayerAccessor
from .components.attention import probability_labels
from .core.errors import NnterpError, RenamingError, ShapeError, Unavailable

_CHECK_PROMPT = "Hello world, this is a check"


class AttentionProbabilities(LayerAccessor):
    """``model.attention_probabilities``: see the module docstring."""

    def __init__(self, model: Any) -> None:
        super(AttentionProbabilities, self).__init__(model, "attention_probabilities")
        self._disabled = False

    @property
    def enabled(self) -> bool:
        """Whether the weights are served now: some layer's softmax attention serves them (it runs eager) and
        `disable` was not called. ``False`` on a model without softmax attention (Mamba, RWKV, xLSTM)."""
        if self._disabled:
            return False
        for layer in self.model.layers:
            attention = layer.self_attn
            if attention is not None and type(attention).values()["attention_probabilities"].reason(attention) is None:
                return True
        return False

    def disable(self) -> None:
        """Refuse every later read and write of the weights (1.x's switch; nothing turns it back on)."""
        self._disabled = True

    def _check_enabled(self) -> None:
        if self._disabled:
            raise Unavailable("attention_probabilities", "they were disabled on this model by `model.attention_probabilities.disable()`")

    def __getitem__(self, layer: int) -> Any:
        self._check_enabled()
        return super(AttentionProbabilities, self).__getitem__(layer)

    def __setitem__(self, layer: int, value: Any) -> None:
        self._check_enabled()
        super(AttentionProbabilities, self).__setitem__(layer, value)

    def _layer(self, layer: int | None) -> int:
        if layer is not None:
            return layer
        for index, block in enumerate(self.model.layers):
            if block.self_attn is not None:
                return index
        raise Unavailable("attention_probabilities", f"{self.model.family.NAME} has no softmax attention layer")

    def check_source(self, layer: int | None = None, allow_dispatch: bool = True, use_trace: bool = True) -> None:
        """Check layer ``layer``'s weights on a prompt: ``[batch, heads, seq, seq]``, rows summing to 1, and a write changes the logits.

        ``use_trace=False`` checks the shape only, under ``model.scan`` (no
        weights run), or a trace where the family cannot run on fake tensors
        and ``allow_dispatch`` (as in 1.x). Raises `ShapeError` or
        `RenamingError` (a `ValueError`) naming what is wrong.
        """
        layer = self._layer(layer)
        found: dict = {}  # filled inside the traces: a trace body's own locals do not outlive it unsaved

        def read(probs: Any) -> None:
            found["shape"] = tuple(probs.shape)
            if use_trace:
                found["sums"] = probs.sum(-1).save()
                noise = torch.rand_like(probs) + 0.1
                self[layer] = noise / noise.sum(-1, keepdim=True)
                found["changed"] = self.model.logits.save()

        with torch.no_grad():
            self._run(layer, read, scan=not use_trace, allow_dispatch=allow_dispatch, found=found)
        self._check_shape(found["shape"], *found["input"], layer)
        if not use_trace:
            return
        with torch.no_grad(), self.model.trace(_CHECK_PROMPT):
            clean = self.model.logits.save()
        sums = found["sums"]
        if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
            raise RenamingError(f"attention_probabilities[{layer}]: rows sum to {sums.min().item():.4g}..{sums.max().item():.4g}, not 1")
        if torch.allclose(found["changed"], clean):
            raise RenamingError(f"attention_probabilities[{layer}]: writing other weights left the logits unchanged")

    def _check_shape(self, shape: tuple, batch: int, seq: int, layer: int) -> None:
        expected = (batch, self.model.num_heads, seq, seq)
        if shape != expected:
            raise ShapeError(f"attention_probabilities[{layer}] has shape {shape}, expected (batch, heads, seq, seq) = {expected}")

    def _run(self, layer: int, body: Any, scan: bool, allow_dispatch: bool, found: dict) -> None:
        """``body(layer's probabilities)`` under ``model.scan``, else (or where scan fails and ``allow_dispatch``) a trace."""
        def run(tracer: Any) -> None:
            with tracer:
                found["input"] = tuple(self.model.input_size)  # the input first: nnsight reads in execution order
                body(self[layer])

        if scan:
            try:
                run(self.model.scan(_CHECK_PROMPT))
                return
            except NnterpError:
                raise
            except Exception:  # a family fake tensors cannot run (a grouped-matmul MoE): 1.x's try_with_scan
                if not allow_dispatch:
                    raise
        run(self.model.trace(_CHECK_PROMPT))

    def print_source(self, layer: int | None = None, allow_dispatch: bool = True) -> None:
        """Print the call whose first argument the weights are, then the whole function it is in.

        Read under ``model.scan`` (nnsight serves a called function's source
        only inside a trace), or a trace where scan fails and ``allow_dispatch``.
        """
        self._check_enabled()
        layer = self._layer(layer)
        attention = self.model.layers[layer].self_attn
        if attention is None:
            raise Unavailable("attention_probabilities", f"layer {layer} of {self.model.family.NAME} has no softmax attention")
        interface, matmul = probability_labels(type(attention._module))
        found: dict = {}

        def read(_: Any) -> None:
            source = getattr(self.model.layers[layer].self_attn.source, interface).source
            found["call"], found["function"] = str(getattr(source, matmul)), str(source)

        self._run(layer, read, scan=True, allow_dispatch=allow_dispatch, found=found)
        print("Accessing attention probabilities from:")
        print(found["call"])
        print("\n\nFull module source:")
        print(found["function"])


class AttentionProbabilitiesSlot:
    """The ``attention_probabilities`` class attribute: one `AttentionProbabilities` per model, built at first use."""

    def __get__(self, model: Any, owner: Any = None) -> Any:
        if model is None:
            return self
        cache = model.__dict__.setdefault("_accessors", {})
        if "attention_probabilities" not in cache:
            cache["attention_probabilities"] = AttentionProbabilities(model)
        return cache["attention_probabilities"]
