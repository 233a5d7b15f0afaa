"""What the fast path computes for a mixer's prompt kernel call (`FastSpec`), by the signature table's names.

A prompt runs through one kernel call; a component's signature table
(``CHUNK_ARGUMENTS``) names its arguments (``q``, ``k``, ``v``, ``g``,
``beta`` on a gated DeltaNet; ``x``, ``dt``, ``A``, ``B``, ``C``,
``dt_bias``, ... on Mamba-2; ``state`` the state the call starts from). A
`FastSpec` says, in those names:

* ``compute(arguments, out)``: the state after every token, into ``out`` when given;
* ``tokens``: the arguments that carry one entry per token on axis 1 (a call
  is split at a position by slicing these);
* ``state_shape(arguments)``: ``(batch, ...)`` of one state.

Pure torch: this file knows nothing of nnsight or of the components.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .delta import gated_delta_states, kimi_delta_states
from .ssd import ssd_states


@dataclass(frozen=True)
class FastSpec:
    name: str
    compute: Callable[[dict, torch.Tensor | None], torch.Tensor]
    tokens: tuple
    state_shape: Callable[[dict], tuple]

    def __repr__(self) -> str:
        return f"FastSpec({self.name})"


def _delta(states: Callable) -> Callable:
    def compute(a: dict, out: torch.Tensor | None) -> torch.Tensor:
        return states(a["q"], a["k"], a["v"], a["g"], a["beta"], a.get("state"), use_qk_l2norm=bool(a.get("l2norm") or False), out=out)

    return compute


def _delta_shape(a: dict) -> tuple:
    v, k = a["v"], a["k"]
    return (v.shape[0], v.shape[2], k.shape[3], v.shape[3])


def _ssd(a: dict, out: torch.Tensor | None) -> torch.Tensor:
    return ssd_states(
        a["x"], a["dt"], a["A"], a["B"], None, a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("state"), out=out,
    )


def _ssd_shape(a: dict) -> tuple:
    x, B = a["x"], a["B"]
    return (x.shape[0], x.shape[2], x.shape[3], B.shape[3])


#: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_DELTA = FastSpec("gated delta rule", _delta(gated_delta_states), ("q", "k", "v", "g", "beta"), _delta_shape)
#: transformers' ``chunk_kimi_delta_attention`` (Kimi-Linear).
KIMI_DELTA = FastSpec("Kimi delta attention", _delta(kimi_delta_states), ("q", "k", "v", "g", "beta"), _delta_shape)
#: transformers' ``mamba2_chunk_scan`` (Mamba-2).
SSD = FastSpec("state space duality", _ssd, ("x", "dt", "B", "C"), _ssd_shape)
