"""nnterp 1.x's names on `StandardizedTransformer`, served by the components.

nnterp 1.x (``ndif-team/nnterp``) exposes per-layer values through accessor
objects indexed by layer (``model.layers_output[3]``, read and written) and a
few model-level helpers (``steer``, ``skip_layers``, ``project_on_vocab``).
`OneXInterface` gives `StandardizedTransformer` the same names, with the same
signatures, each one a thin view of a standard value:

=========================  ==================================================
1.x name                   nnterp value it reads / writes
=========================  ==================================================
``layers_input[i]``        ``layers[i].layer_input``
``layers_output[i]``       ``layers[i].layer_output``
``attentions[i]``          layer i's token mixer: ``self_attn``, or the
                           recurrent mixer ``linear_attn`` on a hybrid
``attentions_input[i]``    that mixer's first input
``attentions_output[i]``   that mixer's ``attention_output``
``mlps[i]``                ``layers[i].mlp``
``mlps_input[i]``          the MLP's first input
``mlps_output[i]``         ``layers[i].mlp.mlp_output``
``attention_probabilities  ``layers[i].self_attn.attention_probabilities``
[i]``
=========================  ==================================================

On a hybrid, ``attentions_output[i]`` is the output of layer i's token mixer,
whichever kind it is: softmax attention or a recurrent mixer (gated DeltaNet,
Mamba). A layer without the part (a Mamba block's MLP, a Nemotron-H MLP
block's mixer) raises `InvalidArgument` (a ValueError) naming the layer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .core.errors import (
    DeviceError,
    InvalidArgument,
    ReadOnlyValue,
    ShapeError,
    WrongType,
)
from .core.indices import layer_index, layer_indices


def token_mixer(layer: Any) -> Any:
    """A block's token mixer: its softmax attention, else its recurrent mixer (``None`` on a block with neither)."""
    return layer.self_attn if layer.self_attn is not None else layer.linear_attn


#: Accessor kind -> (the part it reads, the value on it: a standard value name, "input", or None for the envoy).
_KINDS = {
    "layers_input": (None, "layer_input"),
    "layers_output": (None, "layer_output"),
    "attentions": ("mixer", None),
    "attentions_input": ("mixer", "input"),
    "attentions_output": ("mixer", "attention_output"),
    "mlps": ("mlp", None),
    "mlps_input": ("mlp", "input"),
    "mlps_output": ("mlp", "mlp_output"),
    "attention_probabilities": ("self_attn", "attention_probabilities"),
}


class LayerAccessor:
    """``model.<name>[i]``: a per-layer value (or part) indexed by layer, as in nnterp 1.x; ``[i] = x`` writes it."""

    def __init__(self, model: Any, name: str) -> None:
        self.model = model
        self.name = name
        self.part, self.value = _KINDS[name]

    def get_module(self, layer: int) -> Any:
        """The envoy this accessor reads on layer ``layer`` (the block, its mixer, its MLP; ``None`` where the block has no such part)."""
        layer = layer_index(layer, len(self), f"`{self.name}[{layer}]`")
        block = self.model.layers[layer]
        if self.part is None:
            return block
        envoy = token_mixer(block) if self.part == "mixer" else getattr(block, self.part)
        if envoy is None and self.value is not None:
            what = {"mixer": "token mixer (attention or recurrent)", "mlp": "MLP", "self_attn": "softmax attention"}[self.part]
            raise InvalidArgument(f"layer {layer} has no {what} ({self.model.family.NAME}; its parts: {', '.join(block.parts()) or 'none'}), so no `{self.name}[{layer}]`")
        return envoy

    def __getitem__(self, layer: int) -> Any:
        envoy = self.get_module(layer)
        return envoy if self.value is None else getattr(envoy, self.value)

    def __setitem__(self, layer: int, value: Any) -> None:
        if self.value is None:
            raise ReadOnlyValue(f"`{self.name}[{layer}]` is a module, not a value: did you mean `{self.name}_output[{layer}]`?")
        setattr(self.get_module(layer), self.value, value)

    def __call__(self, layer: int) -> Any:
        return self[layer]

    def __len__(self) -> int:
        return len(self.model.layers)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def returns_tuple(self) -> bool:
        """1.x's tuple flag: always ``False``, as every standard value is unwrapped (writes are rewrapped)."""
        return False

    def __repr__(self) -> str:
        return f"LayerAccessor({self.name}, {len(self)} layers)"


class _Accessor:
    """A class attribute building the accessor named like it, once per model."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, model: Any, owner: Any = None) -> Any:
        if model is None:
            return self
        cache = model.__dict__.setdefault("_accessors", {})
        if self.name not in cache:
            cache[self.name] = LayerAccessor(model, self.name)
        return cache[self.name]


class OneXInterface:
    """nnterp 1.x's names and helpers, mixed into `StandardizedTransformer` (see the module docstring)."""

    layers_input = _Accessor()
    layers_output = _Accessor()
    attentions = _Accessor()
    attentions_input = _Accessor()
    attentions_output = _Accessor()
    mlps = _Accessor()
    mlps_input = _Accessor()
    mlps_output = _Accessor()
    # attention_probabilities: `nnterp.attention_probabilities.AttentionProbabilities`, set on StandardizedTransformer

    @property
    def _text_config(self) -> Any:
        return self.family.text_config(self._module.config)

    @property
    def num_layers(self) -> int:
        """The number of decoder blocks."""
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        """The residual stream's width."""
        return self._text_config.hidden_size

    @property
    def num_heads(self) -> int | None:
        """The softmax attention's number of query heads (``None`` on a model without attention, Mamba)."""
        return getattr(self._text_config, "num_attention_heads", None)

    @property
    def vocab_size(self) -> int:
        """The unembedding's output size."""
        return self.lm_head._module.weight.shape[0]

    @property
    def attn_probs_available(self) -> bool:
        """Whether ``attention_probabilities`` can be served: ``attention_probabilities.enabled`` (eager attention, not disabled)."""
        return self.attention_probabilities.enabled

    @property
    def _model(self) -> Any:
        """The wrapped transformers model (nnsight 0.5's name, which 1.x code reads: ``model._model.config``); ``_module`` in nnsight 0.8."""
        return self._module

    def detect_layer_output_type(self) -> None:
        """1.x's detection of whether a block returns a tuple; nothing to detect here: every standard value is unwrapped."""

    @property
    def add_prefix_false_tokenizer(self) -> Any:
        """The model's tokenizer loaded again with ``add_prefix_space=False`` (1.x's; loaded once)."""
        cached = self.__dict__.get("_add_prefix_false_tokenizer")
        if cached is None:
            from transformers import AutoTokenizer

            source = self.repo_id if isinstance(self.repo_id, str) else self.tokenizer.name_or_path
            cached = AutoTokenizer.from_pretrained(source, add_prefix_space=False)
            object.__setattr__(self, "_add_prefix_false_tokenizer", cached)
        return cached

    @property
    def input_ids(self) -> Any:
        """The batch's token ids, inside a trace."""
        return self.inputs[1]["input_ids"]

    @property
    def input_size(self) -> Any:
        """``(batch, seq)`` of the batch, inside a trace."""
        return self.input_ids.shape

    @property
    def attention_mask(self) -> Any:
        """The batch's attention mask, inside a trace."""
        return self.inputs[1]["attention_mask"]

    @property
    def token_embeddings(self) -> Any:
        """The token embedding's output (read and write), ``embed_tokens.output``."""
        return self.embed_tokens.output

    @token_embeddings.setter
    def token_embeddings(self, value: Any) -> None:
        self.embed_tokens.output = value

    def project_on_vocab(self, hidden_state: Any) -> Any:
        """Logits of ``hidden_state`` ``[..., hidden]``: the family's final norm and unembedding, then its logits scale and softcap.

        The model's own ``logits`` are this function of the last layer's
        output. Works inside a trace (on a traced value) and outside (on a tensor).
        """
        config = self._module.config
        logits = self.lm_head(self.ln_final(hidden_state))
        scale = self.family.logits_scale(config)
        if scale != 1:
            logits = logits * scale
        cap = self.family.logits_softcap(config)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def probs_to_dict(self, tokens: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
        """``{token string: probability}`` for token ids and their probabilities."""
        return {token: prob.item() for token, prob in zip(self.tokenizer.convert_ids_to_tokens(tokens), probs)}

    def get_topk_closest_tokens(self, hidden_state: torch.Tensor, k: int = 5) -> dict | list[dict]:
        """The ``k`` tokens ``hidden_state`` (``[hidden]`` or ``[batch, hidden]``) projects most onto, with probabilities."""
        if hidden_state.shape[-1] != self.hidden_size:
            raise ShapeError(f"hidden state shape {tuple(hidden_state.shape)} does not end with the hidden size {self.hidden_size}")
        top = torch.topk(self.project_on_vocab(hidden_state).softmax(-1), k=k, dim=-1)
        if hidden_state.ndim == 1:
            return self.probs_to_dict(top.indices, top.values)
        if hidden_state.ndim == 2:
            return [self.probs_to_dict(top.indices[i], top.values[i]) for i in range(hidden_state.shape[0])]
        raise ShapeError(f"hidden state of shape {tuple(hidden_state.shape)}: expected [hidden] or [batch, hidden]")

    def steer(
        self,
        layers: int | list[int],
        steering_vector: torch.Tensor,
        factor: float = 1,
        positions: int | list[int] | torch.Tensor | None = None,
        token_positions: int | list[int] | torch.Tensor | None = None,
        batch_index: int | list[int] | torch.Tensor | None = None,
    ) -> None:
        """Add ``factor * steering_vector`` to the residual stream after each of ``layers``, inside a trace.

        ``layers_output[layer] += factor * steering_vector``, at
        ``token_positions`` and ``batch_index`` where given, everywhere
        otherwise. ``positions`` is ``token_positions``' deprecated name, and
        warns as in 1.x. In ``generate``, call it inside ``tracer.iter[...]``
        / ``tracer.all()`` to steer every step.
        """
        if positions is not None:
            if token_positions is not None:
                raise InvalidArgument("Cannot specify both `positions` (deprecated) and `token_positions`: pass `token_positions` only")
            warnings.warn("`positions` is deprecated, use `token_positions` instead.", DeprecationWarning, stacklevel=2)
            token_positions = positions
        if not isinstance(steering_vector, torch.Tensor):
            raise WrongType(f"steer takes steering_vector as a tensor of shape [{self.hidden_size}], got {type(steering_vector).__name__}")
        if steering_vector.is_meta:
            raise DeviceError("steer: steering_vector is on the meta device, which holds no values: build it on a real device")
        if steering_vector.dim() == 0 or steering_vector.shape[-1] != self.hidden_size:
            raise ShapeError(
                f"steer: steering_vector has shape {tuple(steering_vector.shape)}; it takes [{self.hidden_size}] (the "
                f"hidden size), or a shape ending in {self.hidden_size} that broadcasts over the steered slice ([batch, 1, "
                f"{self.hidden_size}] per batch row)"
            )
        for layer in sorted(layer_indices(layers, self.num_layers, "steer(layers=...)")):  # in execution order
            output = self.layers_output[layer]
            # Moved to the layer's device and dtype, as 1.x did (a model split across devices).
            vector = factor * steering_vector.to(device=output.device, dtype=output.dtype)
            if batch_index is None and token_positions is None:
                index = (...,)
            elif batch_index is not None and token_positions is not None:
                index = (batch_index, token_positions)
            elif token_positions is not None:
                index = (slice(None), token_positions)
            else:
                index = (batch_index,)
            target = output[index].shape
            if len(vector.shape) > len(target) or any(v not in (1, t) for v, t in zip(reversed(vector.shape), reversed(target))):
                raise ShapeError(
                    f"steer: steering_vector of shape {tuple(steering_vector.shape)} does not broadcast over the steered "
                    f"slice of layer {layer}, of shape {tuple(target)}: pass [{self.hidden_size}], or one value per row of that slice"
                )
            output[index] += vector
            self.layers_output[layer] = output

    def skip_layer(self, layer: int, skip_with: Any = None) -> None:
        """Skip layer ``layer``: its output is ``skip_with`` (its own input by default), inside a trace."""
        layer = layer_index(layer, self.num_layers, "skip_layer(layer=...)")
        self.skip_layers(layer, layer, skip_with)

    def skip_layers(self, start_layer: int, end_layer: int, skip_with: Any = None, layer_returns_tuple: bool | None = None) -> None:
        """Skip layers ``start_layer`` to ``end_layer`` (inclusive): the residual stream leaving ``end_layer`` is ``skip_with``.

        ``skip_with`` defaults to the input of ``start_layer``, so the model
        runs as if those layers were absent. The skipped layers still run
        (nnterp cannot know before the forward whether a family's block
        returns a tuple, which nnsight's ``skip`` would need to rebuild);
        their outputs are replaced, which gives every later value a forward
        without them would give (their own caches still advance).
        ``layer_returns_tuple`` is 1.x's and has no effect: ``skip_with`` is
        the residual stream, and the block's tuple is rebuilt around it.
        """
        start_layer = layer_index(start_layer, self.num_layers, "skip_layers(start_layer=...)")
        end_layer = layer_index(end_layer, self.num_layers, "skip_layers(end_layer=...)")
        if start_layer > end_layer:
            raise InvalidArgument(
                f"skip_layers({start_layer}, {end_layer}) skips nothing: layer {start_layer} comes after layer {end_layer} (of "
                f"{self.num_layers}); pass start_layer <= end_layer, both inclusive (negative indices count from the end)"
            )
        if skip_with is None:
            skip_with = self.layers_input[start_layer]
        for layer in range(start_layer, end_layer + 1):
            self.layers_output[layer] = skip_with
