"""The mLSTM's ``states`` in one pass: the backend's output computed with every state, the backend call skipped.

Reading ``states`` computes every packed state from the backend call's
arguments (`nnterp.fast.mlstm`); the backend then computes the same
recurrence again, chunkwise, for its output. Where the call would run
transformers' own pure-torch backend anyway, `states` computes the output
while it writes the states (`nnterp.fast.mlstm.mlstm_one_pass`: each block
of states is read by its queries while it is still in cache) and skips the
backend call with its return ``(h, (C, n, m))``, as the fast path does for
the delta rules and Mamba and RWKV-4 does for its loop
(`nnterp.components.wkv_one_pass`).

It applies to a call of two tokens or more (a decode step runs the
one-step kernel, whose bits the cache keeps) when ``states`` is read before
the backend started, with no write to a state of the call, on float32
arguments and entering state, without autograd recording them, with one
invoke covering the batch, and with transformers' own backend in
``mode='inference'`` (not the external ``xlstm`` kernels, not a training
mode) keeping its state in float32: the state dtype its sequence and step
kernels were bound with (``config.inference_state_dtype`` when the backend
was built), read off the backend itself. Everything else computes the states
beside the backend, as before.
The output equals the backend's to float32 rounding (a recurrence where the
backend is chunkwise), as the other one passes' do.
"""

from __future__ import annotations

from typing import Any

import torch

from ..fast.buffers import empty_states
from ..fast.mlstm import mlstm_one_pass
from ..recurrent.arguments import kernel_waiting
from ..recurrent.call import Call
from ..recurrent.gradients import recording
from ..recurrent.kernels import modeling_of
from ..recurrent.per_token.from_arguments import covers_the_batch

#: Whether ``states`` runs the one pass where it applies (``False``: the backend runs, the states beside it).
ONE_PASS = True
#: The buffer a call's one pass filled, in its record's per-strategy data.
SERVED = "one_pass"


def native_backend(mixer: Any) -> bool:
    """Whether the call runs transformers' own pure-torch backend in inference mode (the computation replaced)."""
    backend = mixer._module.mlstm_backend
    modeling = modeling_of(mixer._module)
    native = getattr(modeling, "xLSTMBackend", None)
    if native is None or type(backend) is not native or "inference" not in backend.config.mode:
        return False
    return backend.chunkwise_kernel_fn is getattr(modeling, "mlstm_chunkwise_native_autograd", None) and state_dtypes(backend) == {
        torch.float32
    }


def state_dtypes(backend: Any) -> set:
    """The state dtypes the backend's inference kernels were bound with (``{None}`` where this release binds none found)."""
    kernels = getattr(getattr(backend, "_inference_fn", None), "keywords", {})
    found = set()
    for name in ("mlstm_sequence_kernel", "mlstm_step_kernel"):
        kernel = kernels.get(name)
        found.add(getattr(kernel, "keywords", {}).get("dtype_state") if kernel is not None else None)
    return found


def states(mixer: Any, call: Call) -> torch.Tensor | None:
    """The states by the one pass, the backend call skipped with its return; ``None`` where it does not apply."""
    if not ONE_PASS or call.seq < 2 or call.writes or call.strategy["served"] or not covers_the_batch():
        return None
    if not kernel_waiting(mixer) or not native_backend(mixer):
        return None
    q, k, v, i, f = (mixer.record().serve(name) for name in ("q", "k", "v", "igate", "fgate"))
    initial = call.strategy["initial"]
    if any(x is not None and (x.dtype != torch.float32 or recording(x)) for x in (q, k, v, i, f, initial)):
        return None
    out = empty_states((k.shape[0], call.seq, *call.expected[0][1:]), k.device)
    with torch.no_grad():
        result = mlstm_one_pass(q, k, v, i, f, initial, out, eps=mixer._module.mlstm_backend.config.eps)
    call.op.skip(result)
    call.strategy["served"] = True
    call.strategy[SERVED] = out
    return out


def served(call: Call) -> torch.Tensor | None:
    """The buffer this call's one pass filled, or ``None``."""
    return call.strategy.get(SERVED)


__all__ = ["states", "served", "native_backend", "ONE_PASS"]
