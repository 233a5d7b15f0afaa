"""Gradients through served values: what makes a value's ``.grad`` reach it.

nnsight serves ``x.grad`` (inside ``with loss.backward():``) with an autograd
hook on the tensor ``x`` itself, so a value has a gradient only when *that
tensor* is one the loss was computed from. A kernel argument the kernel
consumed is; three kinds of served value are not, and each is made so here,
only while gradients are recorded (``torch.is_grad_enabled()``, a tensor that
requires grad), without changing any value bit for bit:

* a *view* of a tensor the model used (an argument served in another layout,
  Mamba-1's channel-first ``C`` served tokens first; one position of the
  per-token states): `on_the_path` marks it as nnsight marks an invoke's
  slice of the batch, so the hook goes on the tensor it views and the view's
  gradient is read off that tensor's;
* a value *computed* from the arguments (Mamba's ``betas``, Mamba-2's
  ``decays``): `graft` rewrites the argument it comes from as a function of
  the served value with the argument's own values, so the kernel consumes the
  served value;
* the state after every token, gathered from one occurrence per token: a
  `tap`, a zero leaf added to each token's live state as the model runs and
  filled with the states afterwards, so its gradient at ``t`` is the loss's
  derivative with respect to the state after token ``t`` through everything
  that reads it.
"""

from __future__ import annotations

from typing import Any

import torch

#: The attribute nnsight's batcher sets on an invoke's view of the batch (`nnsight.intervention.batching`):
#: ``.grad`` of a view so marked hooks the tensor it views (``_base``) and reads the view's elements off its gradient.
VIEW_MARK = "_nnsight_batch"


def recording(tensor: Any = None) -> bool:
    """Whether autograd records now (and ``tensor``, if given, is part of a graph)."""
    if not torch.is_grad_enabled():
        return False
    return tensor is None or (isinstance(tensor, torch.Tensor) and tensor.requires_grad)


def records_any(values: Any) -> bool:
    """Whether autograd records now and any of ``values`` (tensors, or tuples of them: RWKV-4's state) is part of a graph."""
    if not torch.is_grad_enabled():
        return False
    return any(
        any(isinstance(y, torch.Tensor) and y.requires_grad for y in x) if isinstance(x, (tuple, list))
        else isinstance(x, torch.Tensor) and x.requires_grad
        for x in values
    )


def on_the_path(view: Any) -> Any:
    """``view``, marked so its ``.grad`` is read off the tensor it views (a no-op for a tensor that is no view)."""
    if isinstance(view, torch.Tensor) and view._base is not None and recording(view):
        setattr(view, VIEW_MARK, True)
    return view


def graft(served: torch.Tensor, rebuilt: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``original``'s values, reached through ``served``: ``rebuilt`` (``original`` recomputed from ``served``).

    ``original.detach() + (rebuilt - rebuilt.detach())`` adds an exact zero, so
    the kernel's input keeps its values bit for bit; the gradient flows into
    ``served`` alone (and on from it to ``original``'s own inputs, once).
    """
    zero = rebuilt - rebuilt.detach()
    return original.detach() + torch.where(torch.isfinite(rebuilt.detach()), zero, torch.zeros_like(zero)).to(original.dtype)


def add_zero(output: torch.Tensor, zero: torch.Tensor, axis: int) -> torch.Tensor:
    """``output`` with ``zero`` (exact zeros that carry a gradient: a spec's tap, on the call's tokens) added to its
    last ``zero.shape[axis]`` entries along ``axis``, in ``output``'s dtype: a kernel's output may hold leading
    entries besides the call's tokens (the short convolution's, its window's)."""
    lead = output.shape[axis] - zero.shape[axis]
    return torch.cat([output.narrow(axis, 0, lead), output.narrow(axis, lead, zero.shape[axis]) + zero.to(output.dtype)], axis)


def tap(shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """A zero leaf of ``shape`` that requires grad: added to live tensors, it collects their gradients."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device, requires_grad=True)


def fill(leaf: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write ``values`` into the tap ``leaf`` (once the tokens it taps have run) and return it."""
    with torch.no_grad():
        leaf.copy_(values)
    return leaf


__all__ = ["VIEW_MARK", "recording", "on_the_path", "graft", "add_zero", "tap", "fill"]
