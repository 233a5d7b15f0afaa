"""Fast per-token recurrent states: pure torch, vectorized, from a kernel call's own arguments.

The spec reads the state after every token by routing a prompt through
transformers' token-by-token kernel (`nnterp.route_kernels`), or, on
Mamba-2, by a chunk size of one (quadratic in length). This package
computes the same states from the arguments of the prompt's kernel call, at
about the cost of that call plus writing the states once (and, with
``output=True`` / a spec's ``one_pass``, the call's own output alongside, so
the call itself can be skipped):

* `gated_delta_states` / `kimi_delta_states`: the gated delta rule (a decay
  per head, or per key channel), chunkwise in the WY/UT form, with a loop
  over chunks only;
* `ssd_states`: Mamba-2's state space duality, linear in length;
* `selective_scan_states`: Mamba-1's selective scan (a decay per channel and
  state entry), token by token (chunked under autograd); `selective_scan_output`:
  its output with the states, in one pass; `selective_scan_readout`: what a start state adds to
  a scan that started from zeros (Mamba-1's prompt kernel takes none);
* `FastSpec` (``GATED_DELTA``, ``KIMI_DELTA``, ``SSD``, ``SCAN``): what a component's
  fast path computes from its kernel call, by its signature table's names;
* `gated_delta_attention`, `kimi_delta_attention`, `ssd_attention`,
  `selective_scan_attention` (`effective`): the exact effective attention
  ``A[t, s]`` with which a kernel's output is a sum over the values it is
  fed, from the same arguments (``EffectiveSpec``: by the table's names);
* `empty_cache` / `cached_bytes`: release / count the state buffers kept for reuse
  (`buffers`: by default at most what the last read needed).

``nnterp.fast_states(model)`` opts a model's mixers in (the strategy is
`nnterp.recurrent.per_token.from_arguments`). All states are float32,
``[batch, seq, heads, ...state]``. Nothing here imports nnsight or the rest of nnterp.
"""

from .buffers import cached_bytes, empty_cache, empty_states
from .delta import gated_delta_states, kimi_delta_states
from .effective import EffectiveSpec
from .effective_delta import GATED_DELTA_ATTENTION, KIMI_DELTA_ATTENTION, gated_delta_attention, kimi_delta_attention
from .effective_scan import SCAN_ATTENTION, SSD_ATTENTION, selective_scan_attention, ssd_attention
from .selective import selective_scan_output, selective_scan_readout, selective_scan_states
from .specs import GATED_DELTA, KIMI_DELTA, SCAN, SSD, FastSpec
from .ssd import ssd_states

__all__ = [
    "gated_delta_states",
    "kimi_delta_states",
    "ssd_states",
    "selective_scan_states",
    "selective_scan_readout",
    "selective_scan_output",
    "gated_delta_attention",
    "kimi_delta_attention",
    "ssd_attention",
    "selective_scan_attention",
    "EffectiveSpec",
    "GATED_DELTA_ATTENTION",
    "KIMI_DELTA_ATTENTION",
    "SSD_ATTENTION",
    "SCAN_ATTENTION",
    "FastSpec",
    "GATED_DELTA",
    "KIMI_DELTA",
    "SSD",
    "SCAN",
    "empty_states",
    "empty_cache",
    "cached_bytes",
]

