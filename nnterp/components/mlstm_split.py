"""A write to the mLSTM's state after token ``t`` splits its backend call in two.

The backend keeps no per-token state to overwrite: `set_state_after(t, value)`
runs the backend's own forward on tokens ``[0, t]`` from the call's entering
state and on the rest from ``value`` (`run_backend`), and the call returns
both outputs and the second part's final state (`split_result`): what a cache
holding ``value`` after token ``t``, continued by the rest, would give.
`nnterp.components.mlstm.MLSTM` binds these functions as its methods.
"""

from __future__ import annotations

import torch

from ..core.errors import Unavailable
from ..core.values import check_expected
from ..fast.mlstm import unpack
from ..recurrent.call import Call
from ..recurrent.gradients import recording
from ..recurrent.per_token.from_arguments import covers_the_batch


def backend_state(state: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """A packed state as the backend's ``(c_initial, n_initial, m_initial)``, in the model's dtype.

    transformers keeps the state between calls in a cache of the model's dtype and the chunkwise kernel multiplies it
    with q, k, v in theirs, so a written state is cast the same way (a no-op on a float32 model).
    """
    if state is None:
        return (None, None, None)
    return tuple(x.to(dtype) for x in unpack(state))


def set_state_after(self, t: int, value: torch.Tensor) -> None:
    """Continue the tokens after ``t`` from the packed state ``value``; token ``t``'s own output is unchanged.

    The backend call is split at ``t``: it runs on tokens ``[0, t]`` and on
    the rest from ``value``, and the call returns both outputs and the
    second's final state (``value`` itself when ``t`` is the last token),
    as a cache holding ``value`` continued by the rest would. Writes come
    before the kernel runs, positions in increasing order, after reads of
    earlier positions and before `states`.
    """
    what = f"set_state_after({t}, value)"
    call = self._split(what)
    position = call.position(t, what)
    check_expected(what, value, *call.expected)
    if not call.strategy["served"]:
        call.check_not_started(what, "this call's kernel had already started (state_output, attention_output or a later value was read first)")
    call.check_write(position, what)
    read = call.strategy["read"].get(position)
    if read is not None and position not in call.writes and not recording(value) and torch.equal(value, read):
        return  # the call already continues from this very state (a target under autograd is still read, for .grad)
    call.writes[position] = value
    result = split_result(self, call)
    if not call.strategy["served"] and covers_the_batch():
        call.op.skip(result)
    else:
        # Another invoke shares this backend call: let it run, and replace this invoke's rows of its return.
        if not call.strategy["served"]:
            call.op.output
        call.op.output = result
    call.strategy["served"] = True
    call.advance(position, what)


def split_result(self, call: Call) -> tuple:
    """The call's return with its writes: every part's output, concatenated, and the last part's final state."""
    pieces = [run_backend(self, call, lo, hi, initial) for lo, hi, initial in self._segments(call)]
    final = pieces[-1][1]
    if call.seq - 1 in call.writes:
        final = unpack(call.writes[call.seq - 1])
    return torch.cat([h for h, _ in pieces], dim=2), final


def run_backend(self, call: Call, lo: int, hi: int, initial: torch.Tensor | None) -> tuple:
    """The backend module's own forward on tokens ``[lo, hi)`` of the call, from ``initial``: ``(h, (C, n, m))``."""
    backend = self._module.mlstm_backend
    if "inference" not in backend.config.mode:
        raise Unavailable(
            "linear_attn.set_state_after",
            f"it splits the backend call, which config.mode={backend.config.mode!r} runs through the "
            "chunkwise kernel alone (whole chunks only, no final state); use mode='inference' (the default)"
        )
    kwargs = dict(call.kwargs)
    for name in ("query", "key", "value", "igate", "fgate"):
        kwargs[name] = kwargs[name][:, :, lo:hi].contiguous()
    kwargs.update(zip(("c_initial", "n_initial", "m_initial"), backend_state(initial, kwargs["query"].dtype)))
    # The class's forward, not the module's __call__: the model is mid-run, hooked by nnsight.
    return type(backend).forward(backend, *call.args, **kwargs)


__all__ = ["set_state_after", "split_result", "run_backend", "backend_state"]
