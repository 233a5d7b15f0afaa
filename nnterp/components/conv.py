"""The short-convolution window a recurrent mixer carries forward beside its state.

A gated DeltaNet, Mamba-1 and Mamba-2 all run a causal depthwise convolution
of width ``conv_width`` over their input channels before the recurrence, so a
call's first tokens also mix the previous call's last ``conv_width - 1``
inputs. The cache keeps that window, ``[batch, conv_channels, conv_width]``
(the newest input last), in one buffer it updates in place; these values read
and write that buffer at the mixer's input and output.

* ``conv_state_input``: the window entering the call, a copy; ``None`` on a
  fresh prompt (the convolution pads with zeros there). Assigning it on a
  decode step makes the step convolve over the assigned window.
* ``conv_state_output``: the window leaving the call, a copy; assigning it
  makes the next call start from the assigned window.

They need a cache (a plain trace and ``generate`` make one; ``use_cache=False``
does not). On a model transformers cannot run with a cache (a Qwen3.5 text
model without an attention layer, `nnterp.recurrent.no_cache`) no run keeps a
window, and they say so.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..core.dims import ConvState
from ..core.errors import Unavailable
from ..core.values import DerivedEProperty, check_tensor
from ..recurrent.no_cache import needs_a_cache, no_cache_reason

#: Why a call without a cache has no window.
NO_CACHE = (
    "this call runs without a cache, so it keeps no convolution window: run it with use_cache=True "
    "(the default of a trace and of generate)"
)


def _window(envoy: Any) -> torch.Tensor | None:
    """The cache's window buffer for this layer, or ``None`` before any has been kept."""
    cache = envoy._call()["cache"]
    if cache is None:
        raise Unavailable("the convolution window", no_cache_reason(envoy, NO_CACHE))
    layer = cache.layers[envoy._module.layer_idx]
    if not layer.has_previous_state[0]:
        return None
    return layer.conv_states[0]


def _entering(envoy: Any) -> torch.Tensor | None:
    window = _window(envoy)
    return window.clone() if window is not None else None


def _assign_entering(envoy: Any, value: torch.Tensor) -> None:
    window = _window(envoy)
    if window is None:
        raise Unavailable(
            "a write to `linear_attn.conv_state_input`", "it is None on a fresh prompt (the convolution pads with zeros): assign it on "
            "a decode step, or assign the previous call's `conv_state_output`"
        )
    check_tensor("`linear_attn.conv_state_input`", value, window)
    window.copy_(value)


def _leaving(envoy: Any) -> torch.Tensor | None:
    envoy._call()
    Mediator.value(f"{envoy.path}.output")
    window = _window(envoy)
    return window.clone() if window is not None else None


def _assign_leaving(envoy: Any, value: torch.Tensor) -> None:
    envoy._call()
    Mediator.value(f"{envoy.path}.output")
    window = _window(envoy)
    check_tensor("`linear_attn.conv_state_output`", value, window)
    window.copy_(value)


def conv_state_input() -> DerivedEProperty:
    return DerivedEProperty(
        _entering,
        assign=_assign_entering,
        description="the convolution window entering this call (None on a fresh prompt), [batch, conv_channels, conv_width]",
        annotation=ConvState,
        none_on_fresh_prompt=True,
        unavailable=needs_a_cache,
    )


def conv_state_output() -> DerivedEProperty:
    return DerivedEProperty(
        _leaving,
        assign=_assign_leaving,
        description="the convolution window leaving this call, [batch, conv_channels, conv_width]",
        annotation=ConvState,
        unavailable=needs_a_cache,
    )
