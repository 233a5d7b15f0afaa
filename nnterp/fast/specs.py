"""What the fast path needs to know about a mixer's prompt kernel call (`FastSpec`).

A prompt runs through one kernel call, ``kernel(*args, **kwargs)``; its
arguments are the call's own whatever function is bound to the name
(transformers' pure-torch chunk kernel, the token loop after routing, or an
optimized kernel such as flash-linear-attention's). A `FastSpec` says:

* ``compute(arguments, out)``: the state after every token from the call's
  arguments, by name (``nnterp.fast``), into ``out`` when given;
* ``tokens``: the arguments that carry one entry per token, on axis 1 (a
  call is split at a position by slicing these);
* ``initial`` / ``final_flag``: the keyword of the state the call starts
  from, and of the flag asking the kernel to return its final state;
* ``state_shape(arguments)``: ``(batch, ...)`` of one state;
* ``decode``: where a one-token decode step's new state is: ``("output", i)``
  for element ``i`` of the kernel's return, ``("buffer", i)`` for argument
  ``i``, the cache's buffer the kernel updates in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .delta import gated_delta_states, kimi_delta_states
from .ssd import ssd_states


@dataclass(frozen=True)
class FastSpec:
    name: str
    compute: Callable[[dict, Optional[torch.Tensor]], torch.Tensor]
    tokens: tuple
    initial: str
    final_flag: str
    state_shape: Callable[[dict], tuple]
    decode: tuple = ("output", 1)

    def __repr__(self) -> str:
        return f"FastSpec({self.name})"


def _delta(states: Callable) -> Callable:
    def compute(a: dict, out: Optional[torch.Tensor]) -> torch.Tensor:
        return states(
            a["query"], a["key"], a["value"], a["g"], a["beta"], a.get("initial_state"),
            use_qk_l2norm=bool(a.get("use_qk_l2norm_in_kernel", False)), out=out,
        )

    return compute


def _delta_shape(a: dict) -> tuple:
    value, key = a["value"], a["key"]
    return (value.shape[0], value.shape[2], key.shape[3], value.shape[3])


def _ssd(a: dict, out: Optional[torch.Tensor]) -> torch.Tensor:
    return ssd_states(
        a["hidden_states"], a["dt"], a["A"], a["B"], None, a.get("dt_bias"), bool(a.get("dt_softplus", False)),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("initial_states"), out=out,
    )


def _ssd_shape(a: dict) -> tuple:
    x, B = a["hidden_states"], a["B"]
    return (x.shape[0], x.shape[2], x.shape[3], B.shape[3])


#: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_DELTA = FastSpec(
    "gated delta rule", _delta(gated_delta_states), ("query", "key", "value", "g", "beta"),
    "initial_state", "output_final_state", _delta_shape,
)
#: transformers' ``chunk_kimi_delta_attention`` (Kimi-Linear).
KIMI_DELTA = FastSpec(
    "Kimi delta attention", _delta(kimi_delta_states), ("query", "key", "value", "g", "beta"),
    "initial_state", "output_final_state", _delta_shape,
)
#: transformers' ``mamba2_chunk_scan`` (Mamba-2); its decode kernel updates the cache's state in place.
SSD = FastSpec(
    "state space duality", _ssd, ("hidden_states", "dt", "B", "C", "z"),
    "initial_states", "return_final_states", _ssd_shape, decode=("buffer", 0),
)


def slice_call(names: tuple, args: tuple, kwargs: dict, spec: FastSpec, lo: int, hi: int, initial: Any, final: bool) -> tuple:
    """``(args, kwargs)`` of the call restricted to tokens ``[lo, hi)``, starting from ``initial``.

    ``names`` are the kernel's positional parameter names (to find a
    per-token argument passed by position).
    """
    def cut(name: str, x: Any) -> Any:
        return x[:, lo:hi] if name in spec.tokens and isinstance(x, torch.Tensor) else x

    args = tuple(cut(names[i] if i < len(names) else "", x) for i, x in enumerate(args))
    kwargs = {name: cut(name, x) for name, x in kwargs.items()}
    positional = dict(zip(names, range(len(args))))
    for name, value in ((spec.initial, initial), (spec.final_flag, final)):
        if name in positional:
            args = (*args[: positional[name]], value, *args[positional[name] + 1:])
        else:
            kwargs[name] = value
    return args, kwargs


def arguments(names: tuple, defaults: dict, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in."""
    found = dict(defaults)
    found.update(zip(names, args))
    found.update(kwargs)
    return found
