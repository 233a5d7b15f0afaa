"""nnterp 1.x's attention-probability sources: where each architecture's softmax weights are read, and the accessor over them.

In 1.x a model's attention probabilities are the output of one operation in its
attention module's ``.source`` (nnsight's source tracing), found per architecture:

* `AttnProbFunction`: 1.x's type of such a finder, ``fn(attention_envoy,
  return_module_source=False)`` returning the source envoy whose output they
  are (or, with ``return_module_source``, the whole function's source);
* `default_attention_prob_source` (the dropout after the softmax in
  transformers' eager attention function), `bloom_attention_prob_source`,
  `gpt2_attention_prob_source`, `gptj_attention_prob_source`;
* `AttentionProbabilitiesAccessor`: ``accessor[i]`` reads (and writes) layer
  i's weights through the finder, with 1.x's ``disable``, ``check_source`` and
  ``print_source``; on a `StandardizedTransformer` it reads each layer's
  ``self_attn.attention_probabilities``, which the component serves.

All are importable from ``nnterp.rename_utils``, their 1.x path; a
``RenameConfig``'s ``attn_prob_source`` is one of these finders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch as th

from . import utils
from .core.errors import RenamingError
from .standardized import StandardizedTransformer
from .utils import display_markdown, dummy_inputs, is_notebook, try_with_scan

if TYPE_CHECKING:
    from .rename_utils import RenameConfig


class AttnProbFunction:
    """Where a model's attention probabilities are computed: ``fn(attention_envoy)`` returns the envoy whose output they are."""

    def get_attention_prob_source(self, attention_module: Any, return_module_source: bool = False) -> Any:
        """The source envoy of the probabilities (``return_module_source``: the whole function's source they are computed in).

        Each subclass defines it (1.x declared it abstract; no decorator here, since a server rebuilds the bare function).
        """
        raise NotImplementedError(f"{type(self).__name__} does not define get_attention_prob_source")

    def __call__(self, attention_module: Any, return_module_source: bool = False) -> Any:
        return self.get_attention_prob_source(attention_module, return_module_source)


def _eager_call(attention_module: Any) -> Any:
    """The call of the attention function in an attention module's source (transformers 5 binds it first, then calls it)."""
    from nnsight.intervention.source import SourceNotAvailable

    source = attention_module.source
    for index in range(3):
        try:
            return getattr(source, f"attention_interface_{index}").source
        except SourceNotAvailable:
            continue
    raise RenamingError(f"no call of the attention function in {type(attention_module._module).__name__}'s source")


def bloom_attention_prob_source(attention_module: Any, return_module_source: bool = False) -> Any:
    return attention_module.source if return_module_source else attention_module.source.self_attention_dropout_0


def default_attention_prob_source(attention_module: Any, return_module_source: bool = False) -> Any:
    call = _eager_call(attention_module)
    return call if return_module_source else call.nn_functional_dropout_0


def gpt2_attention_prob_source(attention_module: Any, return_module_source: bool = False) -> Any:
    call = _eager_call(attention_module)
    if return_module_source:
        return call
    try:
        return call.module_attn_dropout_0  # transformers 4
    except AttributeError:
        return call.nn_functional_dropout_0  # transformers 5: the shared eager function


def gptj_attention_prob_source(attention_module: Any, return_module_source: bool = False) -> Any:
    call = attention_module.source.self__attn_0.source
    return call if return_module_source else call.self_attn_dropout_0


class AttentionProbabilitiesAccessor:
    """1.x's ``attention_probabilities``: ``accessor[i]`` reads (and ``[i] = p`` writes) layer i's ``[batch, heads, seq, seq]`` softmax weights.

    On a `StandardizedTransformer` it is layer i's
    ``self_attn.attention_probabilities`` (served under eager attention);
    on another model, or with ``rename_config.attn_prob_source``, the output
    of the source envoy that function names (1.x's ``.source`` paths).
    """

    def __init__(self, model: Any, rename_config: RenameConfig | None = None, initialized_with_enable: bool = False) -> None:

        self.model = model
        self.initialized_with_enable = initialized_with_enable
        self.source_attr: Any = None
        if rename_config is not None and rename_config.attn_prob_source is not None:
            self.source_attr = rename_config.attn_prob_source
        elif isinstance(model, StandardizedTransformer):
            self.source_attr = None  # the component serves them
        elif isinstance(model._module, utils.BloomForCausalLM):
            self.source_attr = bloom_attention_prob_source
        elif isinstance(model._module, utils.GPT2LMHeadModel):
            self.source_attr = gpt2_attention_prob_source
        elif isinstance(model._module, utils.GPTJForCausalLM):
            self.source_attr = gptj_attention_prob_source
        else:
            self.source_attr = default_attention_prob_source
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def _check_enabled(self) -> None:
        if not self.enabled:
            hint = "" if self.initialized_with_enable else " Set enable_attention_probs=True when loading the model to enable them."
            raise RenamingError("Attention probabilities are disabled for this model." + hint)

    def __getitem__(self, layer: int) -> Any:
        self._check_enabled()
        if self.source_attr is None:
            return self.model.layers[layer].self_attn.attention_probabilities
        return self.source_attr(self.model.layers[layer].self_attn).output

    def __setitem__(self, layer: int, value: Any) -> None:
        self._check_enabled()
        if self.source_attr is None:
            self.model.layers[layer].self_attn.attention_probabilities = value
        else:
            self.source_attr(self.model.layers[layer].self_attn).output = value

    def check_source(self, layer: int = 0, allow_dispatch: bool = True, use_trace: bool = True) -> None:
        """Check layer ``layer``'s probabilities: shape ``[batch, heads, seq, seq]``, rows summing to 1, and (``use_trace``) a write changing the logits.

        Raises `RenamingError` naming the first check that fails.
        """
        if self.model.num_heads is None:
            raise RenamingError("Can't check the attention probabilities: the model's number of attention heads is not known.")

        def test_prob_source() -> None:
            batch_size, seq_len = self.model.input_size
            probs = self[layer]
            expected = (batch_size, self.model.num_heads, seq_len, seq_len)
            if tuple(probs.shape) != expected:
                raise RenamingError(f"Attention probabilities have shape {tuple(probs.shape)} != {expected} (batch_size, n_head, seq_len, seq_len).")
            rnd = th.randn_like(probs).abs()
            self[layer] = rnd / rnd.sum(dim=-1, keepdim=True)
            if probs.device != th.device("meta"):
                sums = probs.sum(dim=-1)
                if not th.allclose(sums, th.ones_like(sums), atol=1e-4):
                    raise RenamingError("Attention probabilities do not sum to 1.")

        if use_trace:
            with th.no_grad():
                with self.model.trace(dummy_inputs()):
                    test_prob_source()
                    corrupted = self.model.output.logits.save()
                with self.model.trace(dummy_inputs()):
                    clean = self.model.output.logits.save()
            if th.allclose(corrupted, clean):
                raise RenamingError("Changing the attention probabilities did not change the logits: they are not the ones the model uses.")
            return
        try_with_scan(
            self.model, test_prob_source, RenamingError("Can't access attention probabilities on this architecture."),
            allow_dispatch=allow_dispatch, errors_to_raise=(RenamingError,),
        )

    def print_source(self, layer: int = 0, allow_dispatch: bool = True) -> None:
        """Print (in a notebook: show as Markdown) where layer ``layer``'s probabilities are read, and the source around them."""
        if self.source_attr is None:
            attention = self.model.layers[layer].self_attn
            parts = [("Accessing attention probabilities from", f"{type(attention).__name__}.attention_probabilities of {attention.path}"),
                     ("Full module source", str(attention.source))]
        else:
            parts = []
            for title, whole in (("Accessing attention probabilities from", False), ("Full module source", True)):
                parts.append((title, str(self.source_attr(self.model.layers[layer].self_attn, return_module_source=whole))))
        if is_notebook():
            display_markdown("\n\n".join(f"## {title}:\n```py\n{text}\n```" for title, text in parts))
        else:
            print("\n\n".join(f"{title}:\n{text}" for title, text in parts))
