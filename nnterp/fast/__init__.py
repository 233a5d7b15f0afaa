"""Fast per-token recurrent states: pure torch, vectorized, from a kernel call's own arguments.

The spec reads the state after every token by routing a prompt through
transformers' token-by-token kernel (`nnterp.route_kernels`), or, on
Mamba-2, by a chunk size of one (quadratic in length). This package
computes the same states from the arguments of the prompt's kernel call, at
about the cost of that call plus writing the states once:

* `gated_delta_states` / `kimi_delta_states`: the gated delta rule (a decay
  per head, or per key channel), chunkwise in the WY/UT form, with a loop
  over chunks only;
* `ssd_states`: Mamba-2's state space duality, linear in length;
* `fast_states(model)` (`nnterp.fast.mixin`): opt a model's mixers in, so
  ``states``, ``state_after(t)`` and ``set_state_after(t, value)`` are
  served this way, without routing and with any kernel bound;
* `empty_cache`: release the state buffers kept for reuse (`buffers`).

All states are float32, ``[batch, seq, heads, ...state]``.
"""

from .buffers import cached_bytes, empty_cache, empty_states
from .delta import gated_delta_states, kimi_delta_states
from .mixin import FastStates, fast_component, fast_enabled, fast_states, unless_fast
from .specs import GATED_DELTA, KIMI_DELTA, SSD, FastSpec
from .ssd import ssd_states

__all__ = [
    "gated_delta_states",
    "kimi_delta_states",
    "ssd_states",
    "fast_states",
    "fast_enabled",
    "unless_fast",
    "FastStates",
    "fast_component",
    "FastSpec",
    "GATED_DELTA",
    "KIMI_DELTA",
    "SSD",
    "empty_states",
    "empty_cache",
    "cached_bytes",
]
