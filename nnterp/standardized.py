"""`StandardizedTransformer`: one interface over every supported family.

    model.embed_tokens                    the token embedding
    model.layers[i]                       a decoder block (`Layer`)
        .layer_input / .layer_output      the residual stream entering / leaving it
        .self_attn                        softmax attention (`Attention`), or None
        .linear_attn                      the recurrent mixer (`RecurrentMixer`), or None
        .mlp                              the feed-forward block, or None
    model.ln_final                        the final norm
    model.lm_head                         the unembedding
    model.logits                          [batch, seq, vocab]
    model.next_token_probs                [batch, vocab], at each row's last token

It is nnsight's ``TransformersModel`` (``trace``, ``generate``,
``tracer.iter`` behave as there), built with one component per HF module
class, as the family (``model.family``) declares. ``model.support()`` says,
for every value on every layer, whether it can be served now and why not.
"""

from __future__ import annotations

import os
from functools import reduce
from typing import Any

import torch
from nnsight import TransformersModel
from torch._guards import detect_fake_mode

from .accessors import OneXInterface, check_standard_names, constructor_keywords
from .core.dims import Logits, Probs
from .core.errors import EmptyPrompt, NnterpError, RoutingError, WrongType
from .core.values import DerivedEProperty, EProperty, Unwrap
from .families import family_for
from .recurrent.routing import refused_device
from .support import describe, support_table


def _config(model: Any) -> Any:
    from transformers import AutoConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model.config
    if not isinstance(model, (str, os.PathLike)):
        raise WrongType(
            f"StandardizedTransformer takes a hub id, a folder saved with save_pretrained, or a loaded "
            f"PreTrainedModel; got {type(model).__name__}"
        )
    path = os.fspath(model)
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1  # a hub id is "owner/name"
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:
        where = "no folder exists at that path" if looks_local else "the hub could not serve it"
        raise NnterpError(
            f"could not load {path!r}: {where} ({type(error).__name__}: {error}). Pass a folder saved with "
            "save_pretrained, a hub id this machine can reach, or a loaded model with tokenizer="
        ) from error


def _no_tokens(data: Any) -> bool:
    """Token ids with nothing in them: ``[]``, ``[[]]``, a tensor of no elements (a string is judged once tokenized)."""
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, (list, tuple)):
        return all(isinstance(row, (list, tuple)) and len(row) == 0 for row in data)
    return False


def _standard_aliases(family: Any) -> dict:
    """nnsight ``rename`` aliases for the standard parts: ``model.layers`` (the blocks' ``ModuleList``),
    ``embed_tokens``, ``ln_final``, ``lm_head``; envoys, so ``tracer.cache()`` navigates them too."""
    return {family.LAYERS: "layers", family.EMBED_TOKENS: "embed_tokens", family.LN_FINAL: "ln_final", family.LM_HEAD: "lm_head"}


class _OutputLogits(Unwrap):
    """The ``logits`` field of the model's output, and the output rebuilt around a written one.

    Read from the model's own output, as nnterp 1.x does, so ``model.logits``
    may be read after ``model.output`` in the same trace.
    """

    def get(self, value: Any) -> Any:
        return value.logits if hasattr(value, "logits") else value[0]

    def put(self, value: Any, element: Any) -> Any:
        if hasattr(value, "logits"):
            return type(value)(**{**value, "logits": element})
        return (element, *value[1:])


class StandardizedTransformer(OneXInterface, TransformersModel):
    """A causal language model under standard names (see the module docstring).

    Args:
        model: a hub id, a local folder saved with ``save_pretrained``, or a
            loaded ``PreTrainedModel`` (then pass ``tokenizer=``).
        dispatch: load the weights now (``True``) or at the first trace.
        device: where to put the weights (``"cpu"``, ``"cuda:0"``, ...).
        tokenizer: a tokenizer to use instead of the checkpoint's own.
        enable_attention_probs: load eager attention, so every softmax attention
            serves ``attention_probabilities`` (nnterp 1.x's keyword).
        check_renaming: run one forward at load and check every standard
            value's shape (nnterp 1.x's keyword; off by default here).
        **kwargs: passed to ``from_pretrained`` through nnsight; a keyword that
            is neither a ``from_pretrained`` argument nor a config field is refused.
    """

    def __init__(
        self,
        model: Any,
        *,
        dispatch: bool = False,
        device: str | None = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> None:
        from transformers import AutoTokenizer, PreTrainedModel

        config = _config(model)
        family = family_for(config)
        enable_attention_probs, check_renaming = constructor_keywords(family.text_config(config), kwargs)
        if tokenizer is None:
            if isinstance(model, PreTrainedModel):
                raise NnterpError("a loaded model comes without its tokenizer: pass tokenizer=AutoTokenizer.from_pretrained(...)")
            # nnsight cannot guess a local folder's tokenizer on its lazy path (transformers 5
            # names the pipeline class as a string), so load it here for every source.
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(model))
        if device is not None and not isinstance(model, PreTrainedModel):
            kwargs.setdefault("device_map", device)
        object.__setattr__(self, "_family", family)
        kwargs["rename"] = {**_standard_aliases(family), **(kwargs.get("rename") or {})}
        super().__init__(model, task="text-generation", tokenizer=tokenizer, dispatch=dispatch, envoys=family.envoys(), **kwargs)
        if device is not None and isinstance(model, PreTrainedModel):
            self._module.to(device)
        if check_renaming:
            check_standard_names(self)

    @property
    def family(self) -> Any:
        """The family class (``nnterp.families.<model_type>``, e.g. ``Qwen3_5Text``); ``family.MODELING`` is the transformers module it wraps."""
        return self._family

    def _at(self, path: str) -> Any:
        return reduce(getattr, path.split("."), self)


    logits = EProperty(
        "output",
        select=_OutputLogits(),
        description="the logits: the causal LM's output logits (the unembedding's output, scaled or soft-capped where the family does), [batch, seq, vocab]",
        annotation=Logits,
    )

    def _next_token_probs(self) -> Probs:
        # nnsight left-pads a batch, so the last position is every row's last real token.
        return torch.softmax(self.logits[:, -1].float(), dim=-1)

    next_token_probs = DerivedEProperty(
        _next_token_probs,
        description="softmax over the vocabulary at each row's last token, [batch, vocab]",
        annotation=Probs,
    )

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's driver of every trace, refusing first a run a compiled kernel would refuse.

        With ``mamba_ssm`` / ``causal-conv1d`` bound, the kernel rejects CPU
        tensors from deep inside the forward; checked here, after the weights
        are dispatched, the error names `route_kernels`.
        """
        if not self.dispatched and detect_fake_mode() is None:
            self.dispatch()
        reason = refused_device(self)
        if reason is not None:
            raise RoutingError(reason)
        return super().interleave(fn, *args, **kwargs)

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """nnsight's rows of one invoke, refusing first an input that holds no token at all."""
        if inputs and _no_tokens(inputs[0]):
            raise EmptyPrompt(f"the prompt is empty ({inputs[0]!r}): a language model needs at least one token to run on")
        return super()._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's one model input from every invoke, refusing a prompt, or a row, the tokenizer left without tokens.

        transformers would fail deep inside the first layer with a reshape
        error; an empty row of a padded batch would run on padding alone and
        give logits that mean nothing.
        """
        args, kwargs = super()._batch(invokes, fn)
        key = next((key for key in ("input_ids", "inputs_embeds") if kwargs.get(key) is not None), None)
        ids = kwargs[key] if key is not None else args[0] if args and isinstance(args[0], torch.Tensor) else None
        if isinstance(ids, torch.Tensor) and (ids.dim() < 2 or ids.shape[1] == 0):
            raise EmptyPrompt(
                f"the prompt is empty: it tokenized to no tokens ({key or 'input'} of shape {tuple(ids.shape)}), and a language "
                "model needs at least one token to run on; pass a non-empty prompt"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and kwargs.get("past_key_values") is None:
            empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
            if empty:
                raise EmptyPrompt(
                    f"the prompt of batch row{'s' if len(empty) > 1 else ''} {empty} is empty: it tokenized to no "
                    "tokens, and the row would run on padding alone; pass a non-empty prompt"
                )
        return args, kwargs

    def support(self) -> dict:
        """Every declared value, per layer: ``None`` where every layer serves it, else the reason per layer.

        Keyed ``"<component>.<value>"`` (``"linear_attn.states"``). A value's
        entry is ``None`` when every layer that has its component serves it;
        otherwise a list indexed by layer when every layer has the component,
        or a dict keyed by layer index when only some do (a hybrid), each
        entry ``None`` or a sentence saying why and what to do. Computed now,
        from the live state of the process (routing, installed kernels).
        """
        return support_table(self)

    def __repr__(self) -> str:
        return describe(self)
