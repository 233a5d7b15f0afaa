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
``tracer.iter`` behave as there, except that ``tracer.iter`` refuses a slice
with a step, which nnsight drops: `StepCheckedTracer`), built with one
component per HF module class, as the family (``model.family``) declares. ``model.support()`` says,
for every value on every layer, whether it can be served now and why not.
"""

from __future__ import annotations

import json
import os
import re
from functools import reduce
from typing import Any

import torch
from nnsight import TransformersModel
from nnsight.intervention.interleaver import OutOfOrderError
from nnsight.intervention.iterator import Iterations
from nnsight.intervention.tracer import InterleavingTracer
from torch._guards import detect_fake_mode

from .accessors import OneXInterface
from .attention_probabilities import AttentionProbabilitiesSlot
from .core.dims import Logits, Probs
from .core.errors import EmptyPrompt, InvalidArgument, SignatureError, Unavailable
from .core.values import DerivedEProperty, EProperty, Unwrap, served_as
from .families import family_for
from .knockout import model_knockout
from .loading import check_standard_names, constructor_keywords, model_config, standard_aliases
from .recurrent.routing import kernel_error
from .recurrent.settings import mark_remote, marked_generating
from .selection import states_of
from .steering import steer_states
from .support import describe, support_table


def _no_tokens(data: Any) -> bool:
    """Token ids with nothing in them: ``[]``, ``[[]]``, a tensor of no elements (a string is judged once tokenized)."""
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, (list, tuple)):
        return all(isinstance(row, (list, tuple)) and len(row) == 0 for row in data)
    return False


def _gradient_refused(error: Exception) -> Unavailable | None:
    """nnsight's "``<id>.grad`` was requested but the model already ran past it", as the reason `support()` gives, if it has one.

    nnsight names the tensor by its ``id``: a value nnterp served (`served_as`) whose ``.grad`` row in
    ``support()`` has a reason (the chunked kernel's final state, a copy, a value computed for analysis)
    gets that sentence instead.
    """
    found = re.search(r"'(\d+)\.grad", str(error))
    where = served_as(int(found.group(1))) if found else None
    if where is None or not hasattr(where[0], "gradients"):
        return None
    envoy, name = where
    reason = envoy.gradients().get(name)
    return Unavailable(f"{envoy.path}.{name}.grad", reason) if reason is not None else None


#: The model's attribute holding, for a right-padded batch, each row's last real token (``None`` otherwise).
_ROW_ENDS = "_nnterp_row_ends"


def _register_for_remote() -> None:
    """Ship nnterp by value with every remote request: a server has nnsight, torch and transformers, not nnterp."""
    from nnsight.ndif import register

    register(__name__.partition(".")[0])


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


class StepCheckedIterations(Iterations):
    """nnsight's ``tracer.iter[...]``, refusing a slice with a step before it runs every step of the range."""

    def __getitem__(self, key: Any) -> Iterations:
        if isinstance(key, slice) and key.step not in (None, 1):
            start = key.start or 0
            span = f"{start}:{'' if key.stop is None else key.stop}:{key.step}"
            listed = f"tracer.iter[list(range({start}, {key.stop}, {key.step}))]" if key.stop is not None else "a list of steps"
            raise InvalidArgument(
                f"tracer.iter[{span}]: nnsight drops a slice's step and would run every step "
                f"{'from ' + str(start) + ' on' if key.stop is None else f'from {start} to {key.stop - 1}'}; pass the steps "
                f"as a list ({listed}), or test the step inside the loop (`for step in tracer.iter[...]: if step % "
                f"{key.step} == ...`)"
            )
        return super(StepCheckedIterations, self).__getitem__(key)


class StepCheckedTracer(InterleavingTracer):
    """The tracer of a local ``trace`` / ``generate``: nnsight's, with `StepCheckedIterations` as ``tracer.iter``."""

    @property
    def iter(self) -> Iterations:
        return StepCheckedIterations()


class StandardizedTransformer(OneXInterface, TransformersModel):
    """A causal language model under standard names (see the module docstring).

    Args:
        model: a hub id, a local folder saved with ``save_pretrained``, or a
            loaded ``PreTrainedModel`` (then pass ``tokenizer=``).
        dispatch: load the weights now (``True``) or at the first trace.
        device: where to put the weights (``"cpu"``, ``"cuda:0"``, ...).
        tokenizer: a tokenizer to use instead of the checkpoint's own.
        tokenizer_kwargs: ``AutoTokenizer.from_pretrained`` arguments; those
            that are tokenizer attributes (``padding_side``) are set on the
            tokenizer over nnsight's defaults (left padding). A right-padded
            batch is served row by row (``next_token_probs`` at each row's own
            last token); ``generate`` and the lens helpers, which continue or
            read position -1, refuse one.
        remote: run every ``trace``, ``generate`` and ``session`` of this
            model on NDIF unless the call says ``remote=False`` (see
            ``docs/remote.md``): the weights stay unloaded here, nnterp
            travels with each request, and ``support()`` answers for a server
            this process cannot route.
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
        remote: bool = False,
        **kwargs: Any,
    ) -> None:
        from transformers import AutoTokenizer, PreTrainedModel

        kwargs.pop("task", None)  # always a causal LM: a model key names its task, and it is this one
        config = model_config(model, kwargs.get("revision"))
        family = family_for(config)
        tokenizer_kwargs = dict(kwargs.pop("tokenizer_kwargs", None) or {})
        enable_attention_probs, check_renaming = constructor_keywords(family.text_config(config), kwargs)
        if tokenizer is None:
            if isinstance(model, PreTrainedModel):
                raise SignatureError("a loaded model comes without its tokenizer: pass tokenizer=AutoTokenizer.from_pretrained(...)")
            # nnsight cannot guess a local folder's tokenizer on its lazy path (transformers 5
            # names the pipeline class as a string), so load it here for every source.
            tokenizer = AutoTokenizer.from_pretrained(
                os.fspath(model), **{"revision": kwargs.get("revision"), **tokenizer_kwargs}
            )
        # nnsight sets the padding side again whenever it loads the pipeline (left, for a causal LM): the user's wins.
        object.__setattr__(self, "_nnterp_tokenizer_settings", {k: v for k, v in tokenizer_kwargs.items() if hasattr(tokenizer, k)})
        if device is not None and not isinstance(model, PreTrainedModel):
            kwargs.setdefault("device_map", device)
        if remote and dispatch:
            raise InvalidArgument("a remote model runs on NDIF's copy of the weights: leave dispatch=False with remote=True")
        object.__setattr__(self, "_family", family)
        object.__setattr__(self, "_nnterp_remote", bool(remote))
        kwargs["rename"] = {**standard_aliases(family), **(kwargs.get("rename") or {})}
        super(StandardizedTransformer, self).__init__(
            model, task="text-generation", tokenizer=tokenizer, dispatch=dispatch, envoys=family.envoys(), **kwargs
        )
        if device is not None and isinstance(model, PreTrainedModel):
            self._module.to(device)
        if remote:
            mark_remote(self)
            _register_for_remote()
        if check_renaming:
            check_standard_names(self)

    def _configure_tokenizer(self) -> None:
        """nnsight's tokenizer defaults (a pad token, left padding), then the constructor's ``tokenizer_kwargs`` over them."""
        super(StandardizedTransformer, self)._configure_tokenizer()
        for key, value in self.__dict__.get("_nnterp_tokenizer_settings", {}).items():
            setattr(self.tokenizer, key, value)

    @property
    def family(self) -> Any:
        """The family class (``nnterp.families.<model_type>``, e.g. ``Qwen3_5Text``); ``family.MODELING`` is the transformers module it wraps."""
        return self._family

    def _at(self, path: str) -> Any:
        return reduce(getattr, path.split("."), self)

    @property
    def remote(self) -> bool:
        """Whether this model was built with ``remote=True``: its runs default to NDIF, and `support()` answers for a server."""
        return self.__dict__.get("_nnterp_remote", False)

    attention_probabilities = AttentionProbabilitiesSlot()

    logits = EProperty(
        "output",
        select=_OutputLogits(),
        description="the logits: the causal LM's output logits (the unembedding's output, scaled or soft-capped where the family does), [batch, seq, vocab]",
        annotation=Logits,
    )

    def _next_token_probs(self) -> Probs:
        # nnsight left-pads a batch, so the last position is every row's last real token; a right-padded
        # batch (tokenizer_kwargs=dict(padding_side="right")) is read at each row's own last token (`_batch`).
        logits = self.logits
        ends = self.__dict__.get(_ROW_ENDS)
        if ends is None:
            return torch.softmax(logits[:, -1].float(), dim=-1)
        ends = ends.to(logits.device)
        return torch.softmax(logits[torch.arange(len(ends), device=logits.device), ends].float(), dim=-1)

    next_token_probs = DerivedEProperty(
        _next_token_probs,
        description="softmax over the vocabulary at each row's last token, [batch, vocab]",
        annotation=Probs,
    )

    def states_of(self, positions: Any = None, layers: Any = None) -> dict[int, torch.Tensor]:
        """The states of the recurrent layers ``layers`` after tokens ``positions``: ``{layer: [batch, len(positions), ...state]}``.

        Inside a trace: ``chosen = model.states_of(positions=[3, -1], layers=[0, 2]).save()``
        (a plain dict: ``.save()`` keeps it and its tensors). Each entry is
        that layer's ``linear_attn.states_of(positions)`` (same positions, same
        errors, float32), or its ``states`` when ``positions`` is ``None``.
        ``layers``: model layer indices (an int, a sequence, negative ones from
        the end), each with a recurrent mixer; ``None``: every such layer. The
        keys are the indices counted from 0, in model order. Only the selected
        layers compute anything, each as its own ``states_of`` does (on the fast
        path: up to the last selected token, a block at a time).
        """
        return states_of(self, positions, layers)

    def knockout(self, sources: Any, targets: Any = None, layers: Any = None, mode: str = "value") -> None:
        """``knockout(sources, targets, mode)`` on the mixer and the attention layer of each of ``layers`` (default:
        all): ``"value"`` on both, ``"skip"`` on mixers, ``"mask"`` on attention layers (`nnterp.knockout`)."""
        model_knockout(self, sources, targets, layers, mode)

    def steer_states(self, vectors: dict, scale: float = 1.0, positions: Any = None) -> None:
        """``linear_attn.steer_state(vectors[layer], positions, scale)`` for each ``{layer: delta}`` (`nnterp.steering`)."""
        steer_states(self, vectors, scale, positions)

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's driver of every trace; an optimized kernel's failure inside it names the fix.

        With fla, mamba_ssm or causal-conv1d installed, transformers binds their
        kernels whatever the device, and they fail from deep inside the forward
        (on a CPU); `kernel_error` keeps their error and adds `route_kernels`.
        """
        if not self.dispatched and detect_fake_mode() is None:
            self.dispatch()
        # tracer.iter counts steps under generate and a prompt's tokens in a trace: `state` needs to know which.
        with marked_generating(self, getattr(fn, "__name__", None) == "generate"), self.family.around_run(self._module):
            # Explicit class: on a server this method is rebuilt from its source, without a `__class__` cell.
            try:
                return super(StandardizedTransformer, self).interleave(fn, *args, **kwargs)
            except OutOfOrderError as error:
                refused = _gradient_refused(error)
                if refused is None:
                    raise
                raise refused from error
            except Exception as error:
                failed = kernel_error(self, error)
                if failed is None:
                    raise
                raise failed from error

    # -- remote execution (docs/remote.md) --------------------------------------------------

    def trace(self, *inputs: Any, remote: bool | str | None = None, **kwargs: Any) -> Any:
        """nnsight's ``trace``; ``remote`` defaults to the model's own (``remote=True`` at construction).

        A local run's tracer refuses a stepped ``tracer.iter`` slice (`StepCheckedTracer`); a remote one's block runs
        on the server, under the server's tracer.
        """
        remote = self.remote if remote is None else remote
        if not remote:
            kwargs.setdefault("tracer_cls", StepCheckedTracer)
        return super(StandardizedTransformer, self).trace(*inputs, remote=remote, **kwargs)

    def session(self, *args: Any, remote: bool | str | None = None, **kwargs: Any) -> Any:
        """nnsight's ``session``; ``remote`` defaults to the model's own."""
        return super(StandardizedTransformer, self).session(*args, remote=self.remote if remote is None else remote, **kwargs)

    def _remote_backend(self, remote: bool | str, *args: Any) -> Any:
        # Every remote run (trace, generate, session; True, a host, or "local") ships nnterp by value.
        _register_for_remote()
        return super(StandardizedTransformer, self)._remote_backend(remote, *args)

    def __getstate__(self) -> dict:
        # The copy a request carries runs on the server: its own traces (a session's) are local there.
        state = super(StandardizedTransformer, self).__getstate__()
        state["_nnterp_remote"] = False
        return state

    def _remoteable_class(self) -> type:
        # The server builds the plain nnsight model (it has no nnterp); nnterp's envoys travel with each request.
        return TransformersModel

    def _remoteable_model_key(self) -> str:
        if isinstance(self.repo_id, str) and os.path.isdir(self.repo_id):
            # A local folder names itself (a test server, or one sharing this filesystem); the hub cannot canonicalize it.
            data: dict[str, Any] = {"repo_id": os.path.abspath(self.repo_id), "revision": self.revision}
            if self.kwargs.get("trust_remote_code"):
                data["trust_remote_code"] = True
            data["task"] = "text-generation"
            return json.dumps(data)
        return super(StandardizedTransformer, self)._remoteable_model_key()

    @classmethod
    def _remoteable_from_model_key(cls, model_key: str, **kwargs: Any) -> StandardizedTransformer:
        data = {**json.loads(model_key), **kwargs}
        data.pop("task", None)
        return cls(data.pop("repo_id"), **data)

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """nnsight's rows of one invoke, refusing first an input that holds no token at all."""
        if inputs and _no_tokens(inputs[0]):
            raise EmptyPrompt(f"the prompt is empty ({inputs[0]!r}): a language model needs at least one token to run on")
        return super(StandardizedTransformer, self)._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's one model input from every invoke, refusing a prompt, or a row, the tokenizer left without tokens.

        transformers would fail deep inside the first layer with a reshape
        error; an empty row of a padded batch would run on padding alone and
        give logits that mean nothing.
        """
        args, kwargs = super(StandardizedTransformer, self)._batch(invokes, fn)
        key = next((key for key in ("input_ids", "inputs_embeds") if kwargs.get(key) is not None), None)
        ids = kwargs[key] if key is not None else args[0] if args and isinstance(args[0], torch.Tensor) else None
        if isinstance(ids, torch.Tensor) and (ids.dim() < 2 or ids.shape[1] == 0):
            raise EmptyPrompt(
                f"the prompt is empty: it tokenized to no tokens ({key or 'input'} of shape {tuple(ids.shape)}), and a language "
                "model needs at least one token to run on; pass a non-empty prompt"
            )
        mask = kwargs.get("attention_mask")
        # Under `model.scan` the mask is a fake tensor: no values to test (and `.tolist()` raises there).
        fake = detect_fake_mode() is not None or getattr(mask, "is_meta", False)
        object.__setattr__(self, _ROW_ENDS, None)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and kwargs.get("past_key_values") is None and not fake:
            empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
            if empty:
                raise EmptyPrompt(
                    f"the prompt of batch row{'s' if len(empty) > 1 else ''} {empty} is empty: it tokenized to no "
                    "tokens, and the row would run on padding alone; pass a non-empty prompt"
                )
            if self.family.PADDING_REFUSED is not None and not bool(mask.all()):
                raise InvalidArgument(self.family.PADDING_REFUSED)
            if not bool(mask[:, -1].all()):  # padded on the right
                if getattr(fn, "__name__", None) == "generate":
                    raise InvalidArgument(
                        "generate continues every row after the batch's last position, which in a right-padded "
                        f"batch (the tokenizer pads {self.tokenizer.padding_side}) is padding for the shorter "
                        "prompts: set model.tokenizer.padding_side = 'left' for generate, or generate each prompt alone"
                    )
                object.__setattr__(self, _ROW_ENDS, mask.sum(-1) - 1)
        return args, kwargs

    def support(self) -> dict:
        """Every declared value, per layer: ``None`` where every layer serves it, else the reason per layer.

        Keyed ``"<component>.<value>"`` (``"linear_attn.states"``). A value's
        entry is ``None`` when every layer that has its component serves it;
        otherwise a list indexed by layer when every layer has the component,
        or a dict keyed by layer index when only some do (a hybrid), each
        entry ``None`` or a sentence saying why and what to do. Computed now,
        from the live state of the process (routing, installed kernels).
        The model-wide ``"circuits.*"`` rows (one entry each) are `nnterp.circuits.support`'s.
        """
        return support_table(self)

    def __repr__(self) -> str:
        return describe(self)
