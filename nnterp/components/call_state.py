"""The state entering and leaving a recurrent mixer's call: ``state_input`` and ``state_output``.

A prompt's kernel takes the entering state as an argument (``"state"`` in its
signature table; ``None`` on a fresh prompt) and returns the state after its
last token (element ``FINAL_STATE`` of its return, ``None`` without a cache).
A one-step decode kernel (Mamba, ``ONE_STEP_DECODE``) instead updates the
cache's own buffer in place: the entering state is served as a copy of it and
written by copying into it, and the leaving state is the buffer once the
kernel has returned. `RecurrentMixer` binds these functions as its methods.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import Unavailable
from ..core.values import check_expected, check_tensor, replace_in
from ..recurrent.arguments import kernel_waiting
from ..recurrent.gradients import graft, recording

_NO_CACHE = (
    "this call runs without a cache, so its kernel returns no final state: run it with use_cache=True "
    "(the default of a trace and of generate)"
)


def state_buffer(self) -> torch.Tensor:
    """On a one-step decode: the cache's state buffer, which the kernel updates in place."""
    return self._serve("state")

def read_state_input(self) -> torch.Tensor | None:
    state = self._serve("state")
    if state is None:
        return None
    if recording() and not (self._decodes() and type(self).ONE_STEP_DECODE) and kernel_waiting(self):
        # Under autograd the kernel reads the entering state through the served copy (an exact graft), so its
        # .grad is the loss's derivative by it; the cache's buffer, overwritten in place later, is left out of it.
        entering = state.detach().clone().requires_grad_(True)
        self._assign_argument("state", graft(entering, entering, state))
        return entering
    # The cache overwrites the entering state's buffer in place during the call.
    return state.clone()

def assign_state_input(self, value: Any) -> None:
    call = self._record()
    what = "`linear_attn.state_input`"
    call.check_not_started(f"a write to {what}")
    check_expected(what, value, *call.expected)
    if call.decodes and type(self).ONE_STEP_DECODE:
        # The kernel updates this buffer in place and nothing else writes the cache:
        # write into it, so the step continues from value and the cache follows.
        self._state_buffer().copy_(value)
        return
    if "state" not in self._table(call):
        raise Unavailable(
            "a write to linear_attn.state_input",
            f"{type(self).__name__}'s prompt kernel takes no initial state (it starts from zeros): assign "
            "`state_input` on a decode step, or use set_state_after(t, value) inside the prompt"
        )
    self._assign_argument("state", value)

def read_state_output(self) -> torch.Tensor:
    call = self._record()
    if call.decodes and type(self).ONE_STEP_DECODE:
        buffer = self._state_buffer()
        call.op.output  # the kernel has returned: the buffer holds the new state
        return buffer.clone()
    output = call.op.output
    if not isinstance(output, tuple) or output[self.FINAL_STATE] is None:
        raise Unavailable("linear_attn.state_output", _NO_CACHE)
    return output[self.FINAL_STATE]

def write_state_output(self, value: Any) -> None:
    call = self._record()
    what = "`linear_attn.state_output`"
    if call.decodes and type(self).ONE_STEP_DECODE:
        buffer = self._state_buffer()
        call.op.output
        check_tensor(what, value, buffer)
        buffer.copy_(value)
        return
    output = call.op.output
    if not isinstance(output, tuple) or output[self.FINAL_STATE] is None:
        raise Unavailable("linear_attn.state_output", _NO_CACHE)
    check_tensor(what, value, output[self.FINAL_STATE])
    call.op.output = replace_in(output, self.FINAL_STATE, value)
