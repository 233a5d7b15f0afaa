"""Fast per-token recurrent states: pure torch, vectorized, from a kernel call's own arguments.

The spec reads the state after every token by routing a prompt through
transformers' token-by-token kernel (`nnterp.route_kernels`), or, on
Mamba-2, by a chunk size of one (quadratic in length). This package
computes the same states from the arguments of the prompt's kernel call, at
about the cost of that call plus writing the states once (and, with
``output=True`` / a spec's ``one_pass``, the call's own output alongside, so
the call itself can be skipped).

One file per kind, each with the same functions of a call's ``arguments``
(`spec`: ``states``, ``one_pass``, ``state_shape``, ``effective_attention``)
and its specs (``FAST``: a `FastSpec`; ``EFFECTIVE``: an `EffectiveSpec`),
beside the explicit-argument functions they call:

* `gated_deltanet`: the delta rule, a decay per head (`gated_delta_states`,
  `gated_delta_attention`) or per key channel (Kimi: `kimi_delta_states`,
  `kimi_delta_attention`), chunkwise in the WY/UT form;
* `state_space`: Mamba-2's state space duality (`ssd_states`, `ssd_attention`),
  linear in length;
* `selective_scan`: Mamba-1's selective scan (`selective_scan_states`,
  `selective_scan_output`: its output with the states in one pass;
  `selective_scan_readout`: what a start state adds to a scan that started
  from zeros, as Mamba-1's prompt kernel does; `selective_scan_attention`);
* `lightning_attention` (MiniMax), `mlstm` (xLSTM), `rg_lru` (RecurrentGemma),
  `wkv` (RWKV-4), `short_convolution` (LFM2);

and what they share: `scan` (writing a decayed sum of rank-one writes, and
reading it as attention), `buffers` (`empty_states`, `empty_cache` /
`cached_bytes`: the state buffers kept for reuse, by default at most what the
last read needed), `step` (Mamba's Δ), `spec` (the spec types, `indices`,
`expand_groups`).

The package-level names of the four specs the components use:
``GATED_DELTA``, ``KIMI_DELTA``, ``SSD``, ``SCAN`` (fast paths) and
``GATED_DELTA_ATTENTION``, ``KIMI_DELTA_ATTENTION``, ``SSD_ATTENTION``,
``SCAN_ATTENTION`` (effective attention); the other kinds' as
``nnterp.fast.<kind>.FAST`` / ``.EFFECTIVE``; ``SPECS``, every kind's fast spec by its
name (the one name its ``FAST`` and ``EFFECTIVE`` share).

``nnterp.fast_states(model)`` opts a model's mixers in (the strategy is
`nnterp.recurrent.per_token.from_arguments`). All states are computed in
float32 and stored in float32 (or in the dtype of an ``out`` given, bfloat16:
each state rounded once, `nnterp.fast.scan.BF16_RTOL`),
``[batch, seq, heads, ...state]``. The fill writing them loops over tokens on
a CPU and runs by closed-form blocks on a GPU (`nnterp.fast.scan`). Nothing here imports nnsight or the rest of nnterp.
"""

from . import lightning_attention, mlstm, rg_lru, short_convolution, wkv
from .buffers import cached_bytes, empty_cache, empty_states
from .gated_deltanet import GATED_EFFECTIVE as GATED_DELTA_ATTENTION
from .gated_deltanet import GATED_FAST as GATED_DELTA
from .gated_deltanet import KIMI_EFFECTIVE as KIMI_DELTA_ATTENTION
from .gated_deltanet import KIMI_FAST as KIMI_DELTA
from .gated_deltanet import gated_delta_attention, gated_delta_states, kimi_delta_attention, kimi_delta_states
from .selective_scan import EFFECTIVE as SCAN_ATTENTION
from .selective_scan import FAST as SCAN
from .selective_scan import (
    selective_scan_attention,
    selective_scan_output,
    selective_scan_readout,
    selective_scan_states,
)
from .spec import EffectiveSpec, FastSpec
from .state_space import EFFECTIVE as SSD_ATTENTION
from .state_space import FAST as SSD
from .state_space import ssd_attention, ssd_states

#: Every kind's fast spec by its name, the name a factorized store keeps (`nnterp.recurrent.replay.spec_of`).
SPECS = {
    spec.name: spec
    for spec in (GATED_DELTA, KIMI_DELTA, SSD, SCAN, lightning_attention.FAST, mlstm.FAST, rg_lru.FAST, wkv.FAST, short_convolution.FAST)
}

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
    "SPECS",
]
