"""What the fast path computes for a mixer's prompt kernel call (`FastSpec`), by the signature table's names.

A prompt runs through one kernel call; a component's signature table
(``CHUNK_ARGUMENTS``) names its arguments (``q``, ``k``, ``v``, ``g``,
``beta`` on a gated DeltaNet; ``x``, ``dt``, ``A``, ``B``, ``C``,
``dt_bias``, ... on Mamba-2; ``state`` the state the call starts from). A
`FastSpec` says, in those names:

* ``compute(arguments, out)``: the state after every token, into ``out`` when given;
* ``tokens``: the arguments that carry one entry per token (a call is split
  at a position by slicing these);
* ``state_shape(arguments)``: ``(batch, ...)`` of one state;
* ``output_axis``: the token axis of the kernel's output (its outputs on two
  parts of a split call are concatenated there);
* ``one_pass(arguments, out)``: the kernel's own return (its output, and its
  final state when the call asks for it) computed with the states in one
  pass, as ``(result, states)``, so the kernel call can be skipped; ``None``
  where it would not equal the kernel's pure-torch body within float32
  rounding (a model in another dtype: the body rounds its states first).
  Only for a call the pure-torch body would run, without autograd;
* ``ring``: whether ``one_pass`` takes an ``out`` with fewer tokens than the
  call (token ``t`` in slot ``t % slots``), so it returns the kernel's result
  without keeping the states: Mamba's, where that beats transformers' torch
  kernel on the parts of a split call (its token loop; its chunk scan);
* ``resume(arguments, initial, result)``: only for a kernel that takes no
  initial state (Mamba-1's always starts from zeros): its ``result`` on
  ``arguments``, turned into what it would have returned starting from
  ``initial`` (exact: the recurrence is linear in its start state).

``arguments`` are served tokens first (the table's layouts applied), as
`nnterp.fast.effective.EffectiveSpec` takes them; ``result`` is the kernel's
own return, in its own layout.

Pure torch: this file knows nothing of nnsight or of the components.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .delta import gated_delta_states, kimi_delta_states
from .selective import selective_scan_output, selective_scan_readout, selective_scan_states
from .ssd import ssd_states


@dataclass(frozen=True)
class FastSpec:
    name: str
    compute: Callable[[dict, torch.Tensor | None], torch.Tensor]
    tokens: tuple
    state_shape: Callable[[dict], tuple]
    resume: Callable[[dict, torch.Tensor, object], object] | None = None
    one_pass: Callable[[dict, torch.Tensor | None], tuple | None] | None = None
    ring: bool = False
    #: The kernel output's token axis (split outputs are concatenated on it): Mamba-1's is channel-first.
    output_axis: int = 1

    def __repr__(self) -> str:
        return f"FastSpec({self.name})"


def _delta(states: Callable) -> Callable:
    def compute(a: dict, out: torch.Tensor | None) -> torch.Tensor:
        return states(a["q"], a["k"], a["v"], a["g"], a["beta"], a.get("state"), use_qk_l2norm=bool(a.get("l2norm") or False), out=out)

    return compute


def _delta_one_pass(states: Callable) -> Callable:
    def one_pass(a: dict, out: torch.Tensor | None) -> tuple | None:
        if a["q"].dtype != torch.float32:
            return None
        y, out = states(a["q"], a["k"], a["v"], a["g"], a["beta"], a.get("state"), use_qk_l2norm=bool(a.get("l2norm") or False), output=True, out=out)
        return (y.contiguous(), _last(out, out.shape[1]) if a.get("final") else None), out

    return one_pass


def _delta_shape(a: dict) -> tuple:
    v, k = a["v"], a["k"]
    return (v.shape[0], v.shape[2], k.shape[3], v.shape[3])


def _ssd(a: dict, out: torch.Tensor | None) -> torch.Tensor:
    return ssd_states(
        a["x"], a["dt"], a["A"], a["B"], None, a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("state"), out=out,
    )


def _last(out: torch.Tensor, seq: int) -> torch.Tensor:
    """The state after the last token, as a copy (the cache keeps it: a view would keep every state alive)."""
    return out[:, (seq - 1) % out.shape[1]].clone()


def _ssd_one_pass(a: dict, out: torch.Tensor | None) -> tuple | None:
    if a["x"].dtype != torch.float32:
        return None
    seq = a["x"].shape[1]
    y, out = ssd_states(
        a["x"], a["dt"], a["A"], a["B"], a["C"], a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        tuple(a.get("dt_limit") or (0.0, math.inf)), a.get("state"), D=a.get("D"), output=True, out=out,
        ring=out is not None and out.shape[1] != seq,
    )
    y = y.contiguous()  # callers view() the kernel's output
    return ((y, _last(out, seq)) if a.get("final") else y), out


def _ssd_shape(a: dict) -> tuple:
    x, B = a["x"], a["B"]
    return (x.shape[0], x.shape[2], x.shape[3], B.shape[3])


def _scan(a: dict, out: torch.Tensor | None) -> torch.Tensor:
    return selective_scan_states(a["x"], a["dt"], a["A"], a["B"], a.get("dt_bias"), bool(a.get("dt_softplus") or False), a.get("state"), out=out)


def _scan_shape(a: dict) -> tuple:
    x, A = a["x"], a["A"]
    return (x.shape[0], x.shape[2], A.shape[1])


def _scan_one_pass(a: dict, out: torch.Tensor | None) -> tuple | None:
    if a["x"].dtype != torch.float32:
        return None
    seq = a["x"].shape[1]
    y, out = selective_scan_output(
        a["x"], a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False),
        a.get("state"), out=out, ring=out is not None and out.shape[1] != seq,
    )
    y = y.transpose(1, 2).contiguous()  # the kernel's layout, channel-first
    return ((y, _last(out, seq)) if a.get("final") else y), out


def _scan_resume(a: dict, initial: torch.Tensor, result: object) -> object:
    # The kernel returns y channel-first, [batch, channels, seq], and (with return_last_state) its final state.
    readout, decayed = selective_scan_readout(
        a["dt"], a["A"], a["C"], initial, a.get("z"), a.get("dt_bias"), bool(a.get("dt_softplus") or False)
    )
    y = result[0] if isinstance(result, tuple) else result
    y = (y.float() + readout.transpose(1, 2)).to(y.dtype)
    if not isinstance(result, tuple):
        return y
    return (y, (result[1].float() + decayed).to(result[1].dtype), *result[2:])


#: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5, Qwen3-Next, OLMo-Hybrid).
GATED_DELTA = FastSpec("gated delta rule", _delta(gated_delta_states), ("q", "k", "v", "g", "beta"), _delta_shape, one_pass=_delta_one_pass(gated_delta_states))
#: transformers' ``chunk_kimi_delta_attention`` (Kimi-Linear).
KIMI_DELTA = FastSpec("Kimi delta attention", _delta(kimi_delta_states), ("q", "k", "v", "g", "beta"), _delta_shape, one_pass=_delta_one_pass(kimi_delta_states))
#: transformers' ``mamba2_chunk_scan`` (Mamba-2).
SSD = FastSpec("state space duality", _ssd, ("x", "dt", "B", "C"), _ssd_shape, one_pass=_ssd_one_pass, ring=True)
#: transformers' ``mamba_selective_scan`` (Mamba-1, Falcon-Mamba, Jamba), which starts from zeros: ``resume``.
SCAN = FastSpec("selective scan", _scan, ("x", "dt", "B", "C", "z"), _scan_shape, _scan_resume, output_axis=2, one_pass=_scan_one_pass, ring=True)
