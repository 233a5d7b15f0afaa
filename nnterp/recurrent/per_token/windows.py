"""`ConvolutionWindows`: a short convolution's window after every token, and a write to it (LFM2's ``Lfm2ShortConv``).

A short convolution has no recurrence to read: its state after token ``t`` is
the window of its last ``L`` inputs, a slice of the convolution's input
``[window entering; u]`` (``[batch, conv_channels, L + seq]``, kept in the
record as ``call.strategy["versions"]`` by the component's `record`): the
window after ``t`` is ``extended[..., t+1 : t+1+L]``. A write at ``t`` makes a
new version of that input for the later tokens and recomputes the outputs of
the ``L - 1`` tokens that read the written window; the cache keeps the window
after the call's last token. Under autograd `tap` serves the windows as a
zero leaf added where the later tokens read them.

The component serves ``states``, ``state_after`` and ``set_state_after``
through `WINDOWS` whatever the model's setting (its own strategy: no routing,
no fast path); it reads the mixer through `Mixer`'s names (``record()``,
``hf_module()``, ``cache_window()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nnsight.intervention.interleaver import Mediator

from ...core.calls import mediator
from ...core.errors import Unavailable
from ...core.values import check_expected
from ..call import Call
from ..gradients import fill, recording, tap
from ..kernels import unreadable_call
from .protocol import Mixer, PerToken


def extended(call: Call, position: int | None = None) -> torch.Tensor:
    """``[batch, conv_channels, L + seq]``: the window entering the call, then its inputs; with ``position``, the
    version a write at or before it made."""
    versions = call.strategy["versions"]
    if position is None:
        return versions[0][1]
    return [version for t, version in versions if t <= position][-1]


class ConvolutionWindows(PerToken):
    """The windows are slices of the convolution's input; a write recomputes the outputs that read it."""

    name = "the convolution's windows"

    def unavailable(self, mixer: Mixer) -> str | None:
        # Every window is cut from the convolution call's own input (its argument), whatever kernel runs it.
        return unreadable_call(mixer)

    def require(self, mixer: Mixer, what: str) -> Call:
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")
        return mixer.record()

    def states(self, mixer: Mixer) -> torch.Tensor:
        """The window after every token of this call, ``[batch, seq, conv_channels, conv_width]``."""
        call = mixer.record()
        call.check_no_write("`linear_attn.states`")
        width = mixer.hf_module().conv_kernel_size
        states = extended(call).unfold(-1, width, 1)[:, :, 1:].transpose(1, 2)  # [batch, seq, channels, L]
        if recording() and not call.strategy.get("tapped"):
            states = self.tap(mixer, call, states)
        call.states_read = True
        return states

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        what = f"state_after({t})"
        call = self.require(mixer, what)
        position = call.position(t, what)
        width = mixer.hf_module().conv_kernel_size
        window = extended(call, position)[..., position + 1: position + 1 + width]
        call.advance(position, what)
        return window

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        call = self.require(mixer, what)
        position = call.position(t, what)
        module = mixer.hf_module()
        width = module.conv_kernel_size
        version = extended(call, position).clone()
        check_expected(what, value, (version.shape[0], version.shape[1], width), version.dtype, version.device)
        call.check_write(position, what)
        version[..., position + 1: position + 1 + width] = value
        call.writes[position] = value
        call.strategy["versions"].append((position, version))
        call.advance(position, what)
        # Tokens t+1 .. t+L-1 read the written window: recompute their outputs from it.
        output = call.strategy.get("output")
        if output is None:
            output = call.op.output
        stop = min(call.seq, position + width)
        if stop > position + 1:
            weight, bias = module.conv.weight.squeeze(1), module.conv.bias
            piece = F.conv1d(version[..., position + 2: stop + width].to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
            output = output.clone()
            start = output.shape[-1] - call.seq
            output[..., start + position + 1: start + stop] = piece.to(output.dtype)
            Mediator.swap(f"{call.op.path}.output", output)
        call.strategy["output"] = output
        window = mixer.cache_window()
        if window is not None:
            window.copy_(version[..., -width:])

    def tap(self, mixer: Mixer, call: Call, states: torch.Tensor) -> torch.Tensor:
        """``states`` as a zero leaf added where each later token reads its window, filled with the states.

        Token ``t+k`` (``0 < k < L``) reads entries ``k .. L-1`` of the window
        after ``t`` at taps ``0 .. L-1-k``; adding the leaf's entries there adds
        exact zeros, and its gradient at ``t`` is the loss's derivative by the
        window after ``t`` as the tokens after ``t`` read it (the quantity a
        write at ``t`` moves).
        """
        leaf = tap(tuple(states.shape), states)
        weight = mixer.hf_module().conv.weight.squeeze(1)  # [channels, L]
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


WINDOWS = ConvolutionWindows()

__all__ = ["ConvolutionWindows", "WINDOWS", "extended"]
