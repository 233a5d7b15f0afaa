"""The convolution window after every token, and a write to it: `ShortConvolution`'s per-token states.

The window after token ``t`` is a slice of the convolution's input
(``[window entering; u]``, `ShortConvolution._extended`), so it is read with
no recurrence; a write at ``t`` makes a new version of that input for the
later tokens and recomputes the outputs of the ``L - 1`` tokens that read the
written window. Under autograd `tap_states` serves the windows as a zero leaf
added where the later tokens read them. `nnterp.components.short_convolution.ShortConvolution`
binds these functions as its methods.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nnsight.intervention.interleaver import Mediator

from ..core.calls import mediator
from ..core.errors import OrderError, Unavailable
from ..core.values import check_expected
from ..recurrent.call import Call
from ..recurrent.gradients import fill, recording, tap
from ..recurrent.kernels import needs_torch_kernels


def states(self) -> torch.Tensor:
    """The window after every token of this call, ``[batch, seq, conv_channels, conv_width]``: slices of the extended input."""
    call = self.record()
    if call.writes:
        raise OrderError("`linear_attn.states` after set_state_after in the same call: read states before the write")
    width = self._module.conv_kernel_size
    states = self._extended().unfold(-1, width, 1)[:, :, 1:].transpose(1, 2)  # [batch, seq, channels, L]
    if recording() and not call.strategy.get("tapped"):
        states = tap_states(self, call, states)
    call.states_read = True
    return states


def state_after(self, t: int) -> torch.Tensor:
    """The window after token ``t`` of this call, ``[batch, conv_channels, conv_width]`` (negative ``t`` from the end)."""
    what = f"state_after({t})"
    check_served(self, what)
    call = self.record()
    position = call.position(t, what)
    width = self._module.conv_kernel_size
    window = self._extended(position)[..., position + 1: position + 1 + width]
    call.advance(position, what)
    return window


def set_state_after(self, t: int, value: torch.Tensor) -> None:
    """The tokens after ``t`` convolve over ``value``, ``[batch, conv_channels, conv_width]``; token ``t`` keeps its output.

    The outputs of tokens ``t+1 .. t+L-1`` of this call are recomputed from
    the written window (later tokens no longer read it), and the cache keeps
    the window after the call's last token, so a write on the last token
    is what the next call starts from. Writes in one call come in
    increasing positions, after any `states` read.
    """
    what = f"set_state_after({t}, value)"
    check_served(self, what)
    call = self.record()
    position = call.position(t, what)
    width = self._module.conv_kernel_size
    extended = self._extended(position).clone()
    check_expected(what, value, (extended.shape[0], extended.shape[1], width), extended.dtype, extended.device)
    call.check_write(position, what)
    extended[..., position + 1: position + 1 + width] = value
    call.writes[position] = value
    call.strategy["versions"].append((position, extended))
    call.advance(position, what)
    # Tokens t+1 .. t+L-1 read the written window: recompute their outputs from it.
    output = call.strategy.get("output")
    if output is None:
        output = call.op.output
    stop = min(call.seq, position + width)
    if stop > position + 1:
        weight, bias = self._module.conv.weight.squeeze(1), self._module.conv.bias
        piece = F.conv1d(extended[..., position + 2: stop + width].to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
        output = output.clone()
        start = output.shape[-1] - call.seq
        output[..., start + position + 1: start + stop] = piece.to(output.dtype)
        Mediator.swap(f"{call.op.path}.output", output)
    call.strategy["output"] = output
    window = self._window(False) if self._call()["cache"] is not None else None
    if window is not None:
        window.copy_(extended[..., -width:])


def check_served(self, what: str) -> None:
    reason = needs_torch_kernels(self)
    if reason is not None:
        raise Unavailable(f"linear_attn.{what}", reason)
    mediator(f"`linear_attn.{what}`")


def tap_states(self, call: Call, states: torch.Tensor) -> torch.Tensor:
    """``states`` as a zero leaf added where each later token reads its window, filled with the states.

    Token ``t+k`` (``0 < k < L``) reads entries ``k .. L-1`` of the window
    after ``t`` at taps ``0 .. L-1-k``; adding the leaf's entries there adds
    exact zeros, and its gradient at ``t`` is the loss's derivative by the
    window after ``t`` as the tokens after ``t`` read it (the quantity a
    write at ``t`` moves).
    """
    leaf = tap(tuple(states.shape), states)
    weight = self._module.conv.weight.squeeze(1)  # [channels, L]
    width = weight.shape[1]
    extra = torch.zeros(states.shape[:3], dtype=states.dtype, device=states.device)  # [batch, seq, channels]
    for k in range(1, min(width, call.seq)):
        # The weight detached: the product must not keep the leaf for backward, since it is filled in place.
        reads = (leaf[:, : call.seq - k, :, k:] * weight[:, : width - k].detach()).sum(-1)
        extra = extra + F.pad(reads, (0, 0, k, 0))
    output = call.op.output
    start = output.shape[-1] - call.seq
    added = torch.cat([output[..., :start], output[..., start:] + extra.transpose(1, 2).to(output.dtype)], dim=-1)
    Mediator.swap(f"{call.op.path}.output", added)
    call.strategy.update(tapped=True, output=added)
    return fill(leaf, states.detach())
