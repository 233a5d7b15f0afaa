"""A model transformers cannot run with a cache, and what nnterp says on it instead of "run it with use_cache=True".

The trap: a Qwen3.5 text model (and Qwen3.5-MoE, Qwen3-Next) whose
``config.layer_types`` are all ``"linear_attention"`` gets a ``DynamicCache``
of ``LinearAttentionLayer`` only, and that cache's ``get_seq_length`` raises
"can only be called on Attention layers" when no layer is one. Every forward
with a cache calls it (counting the cached tokens for its positions up to
5.23, in the causal mask on 5.24), and so does ``generate``'s prefill up to
5.23, so a default trace (``use_cache`` defaults to True) and ``generate``
fail, in every supported release (5.18.0, 5.19.0, 5.20.2, 5.21.1, 5.22.2,
5.23.0, 5.24.0 all do; OLMo-Hybrid's config refuses such a model outright).
A run with ``use_cache=False`` works, ``generate(..., use_cache=False)``
included (it recomputes the whole sequence at every step). An LFM2 model
whose layers are all short convolutions (``"conv"``) falls in the same trap.

Measured (random all-linear configs from transformers' config classes; a
forward with ``use_cache=True``, the default forward, ``generate``; with
``use_cache=False`` a forward and ``generate`` work on all of them):

=========  ==========================================  ===========================
release    qwen3_5_text, qwen3_5_moe_text, qwen3_next   olmo_hybrid
=========  ==========================================  ===========================
5.18.0     forward with a cache and generate raise      config refuses it
5.19.0     the same                                     the same
5.20.2     the same                                     the same
5.21.1     the same                                     the same
5.22.2     the same                                     the same
5.23.0     the same                                     the same
5.24.0     the same                                     the same
=========  ==========================================  ===========================

(A forward raises where it counts the cached tokens for its positions, up to
5.23, or in the causal mask, 5.24; ``generate`` in its prefill up to 5.23, in
its first forward on 5.24; the words are the same.)

The family decides whether a model is in the trap (`Family.cache_refused`,
from its config: Qwen3.5's, and so its descendants', runs one forward with a
cache of a one-layer random model of its own class whose one layer is
recurrent, once per process, so a release that fixes the bug is seen as
fixed). On such a model:

* a value that only a cache can serve (``state_output``, ``conv_state_input``,
  ``conv_state_output``) is unavailable, with `REASON` (what ``support()``
  reports) instead of "run it with use_cache=True";
* a run that asks for a cache (a default trace, a default ``generate``) raises
  `InvalidArgument` (a ``ValueError``, like transformers' own) naming
  ``use_cache=False`` (`RefusedCacheRun`). nnterp does not pass
  ``use_cache=False`` for the user: it would serve other values than the run
  asked for (no ``state_output``, no window) and make ``generate`` quadratic,
  and a plain transformers model fails the same way.
"""

from __future__ import annotations

from typing import Any

import transformers

from ..core.errors import InvalidArgument
from .kernels import unreadable_call

#: Why no run of such a model keeps a value carried from one call to the next, and what works instead.
REASON = (
    "this model has no attention layer (no entry of config.layer_types is one), and transformers {release} "
    "cannot run such a model with a cache (DynamicCache.get_seq_length raises 'can only be called on Attention "
    "layers'), so no call keeps the state or the convolution window it leaves: run it with use_cache=False, which "
    "serves the states (states[:, -1] is the state after the last token), the kernel's arguments, effective attention "
    "and state_input, and generate with use_cache=False (it recomputes the sequence at each step); a state_output, a "
    "convolution window or a decode step continuing a kept state needs a model with an attention layer"
)

#: The error a run asking for a cache raises on such a model.
REFUSED = (
    "this model has no attention layer (no entry of config.layer_types is one), and transformers {release} "
    "cannot run such a model with a cache: DynamicCache.get_seq_length raises 'can only be called on Attention "
    "layers' (in the causal mask and in generate). Pass use_cache=False: model.trace(prompt, use_cache=False) serves "
    "the states, the kernel's arguments, effective attention and state_input; model.generate(prompt, use_cache=False, "
    "...) recomputes the sequence at each step. state_output, the convolution window and a decode step over a kept "
    "state need a model with an attention layer in config.layer_types"
)

#: The words of transformers' error (``get_seq_length`` and ``get_mask_sizes`` both say them).
TRANSFORMERS_ERROR = "can only be called on Attention layers"


def standardized_root(envoy: Any) -> Any:
    """The model an envoy belongs to (its topmost parent envoy)."""
    while getattr(envoy, "_parent", None) is not None and envoy._parent() is not None:
        envoy = envoy._parent()
    return envoy


def refused(envoy: Any) -> bool:
    """Whether the model ``envoy`` belongs to cannot run with a cache (its family says so, from its config)."""
    root = standardized_root(envoy)
    family = getattr(root, "family", None)
    config = getattr(getattr(root, "_module", None), "config", None)
    return family is not None and config is not None and bool(family.cache_refused(config))


def run_kwargs(model: Any) -> dict:
    """The keywords a run of ``model`` that needs nothing only a cache keeps traces with: ``{"use_cache": False}``
    where transformers cannot run it with a cache (`refused`), else none (a default trace is refused there)."""
    return {"use_cache": False} if refused(model) else {}


def reason() -> str:
    """`REASON`, with the installed release."""
    return REASON.format(release=transformers.__version__)


def needs_a_cache(envoy: Any) -> str | None:
    """``unavailable=`` of a value only a cache serves: `REASON` on a model that cannot run with one, else ``None``."""
    return reason() if refused(envoy) else None


def final_state_reason(mixer: Any) -> str | None:
    """``unavailable=`` of ``state_output``: no run keeps it (`needs_a_cache`), or the kernel call is hidden from
    nnsight (`unreadable_call`: the HF ``kernels`` package's module binding)."""
    return needs_a_cache(mixer) or unreadable_call(mixer)


def no_cache_reason(envoy: Any, default: str) -> str:
    """Why a call without a cache lacks a value: ``default`` ("run it with use_cache=True"), or `REASON` where that fails."""
    return reason() if refused(envoy) else default


class RefusedCacheRun:
    """Around a run of a model that cannot run with a cache: transformers' error becomes `InvalidArgument`.

    Any other error, and every run that works (``use_cache=False``), passes through unchanged.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> RefusedCacheRun:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if isinstance(error, ValueError) and not isinstance(error, InvalidArgument) and TRANSFORMERS_ERROR in str(error):
            raise InvalidArgument(REFUSED.format(release=transformers.__version__)) from error


__all__ = ["REASON", "REFUSED", "RefusedCacheRun", "final_state_reason", "needs_a_cache", "no_cache_reason", "refused", "standardized_root"]
