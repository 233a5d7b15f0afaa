"""A kernel call's arguments by name: one signature table per kernel, one vocabulary for every value.

Mental model: a mixer calls one of two kernels (a prompt's, a decode step's),
and the same quantity (the queries ``q``, the input ``x``, the step ``dt``,
``B``, ``C``, the entering ``state``, ...) sits at a different place in each
call and in a different layout. A component declares, per kernel, a table
``name -> (where, layout)`` (``CHUNK_ARGUMENTS``, ``RECURRENT_ARGUMENTS``):
``where`` is a position in the call's ``args`` or a keyword, and the layout
says how to serve the element tokens first (``[batch, seq, ...]``, ``seq`` = 1
on a decode step) and lay a written view back. The values, the per-token
strategies and the fast path all read arguments through these tables, by
these names.

Mamba-1's prompt kernel is channel-first (``x`` is ``[batch, channels,
seq]``) and both Mamba decode kernels have no sequence axis; Mamba-2's decode
kernel takes its per-head values expanded over ``head_dim``: never transpose
what you read, the layout already did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.calls import mediator
from ..core.errors import Unavailable
from ..core.values import check_tensor, replace_in, select_all, select_from
from ..fast.step import served_step_size
from .gradients import graft, on_the_path, recording

Where = int | str


class Layout:
    """How a kernel holds one argument: ``read(element) -> [batch, seq, ...]`` and ``write(view, element) -> element``."""

    def __init__(self, name: str, read: Callable[[Any], Any], write: Callable[[Any, Any], Any]) -> None:
        self.name, self.read, self.write = name, read, write

    def __repr__(self) -> str:
        return f"Layout({self.name})"


#: Already as served (tokens first, or a parameter).
SAME = Layout("as served", lambda e: e, lambda v, e: v)
#: ``[batch, channels, seq]`` (Mamba-1's prompt kernel).
CHANNELS_FIRST = Layout("[batch, channels, seq]", lambda e: e.transpose(1, 2), lambda v, e: v.transpose(1, 2))
#: ``[batch, ...]``, one token with no sequence axis (a decode kernel).
ONE_TOKEN = Layout("[batch, ...] (one token)", lambda e: e.unsqueeze(1), lambda v, e: v.squeeze(1))


def whole(element: Any) -> Any:
    """An argument that is one tensor for the whole batch (a parameter: Mamba's ``A``, ``D``, ``dt_bias``, RWKV's
    ``time_decay``, a convolution's weight), as the kernel holds it.

    nnsight's batcher takes every tensor whose leading dim equals the batch size for batch rows and serves each
    invoke its own rows, so a parameter of that leading size (4 heads, 4 invokes) would reach each invoke as one
    row of itself. The narrowed view is undone here: the same storage, seen with the shape it has.
    """
    if not isinstance(element, torch.Tensor) or not getattr(element, "_nnsight_batch", False):
        return element
    med = mediator("a kernel argument")
    start, _ = med.batch_group
    total = med.interleaver.batcher.total
    offset = element.storage_offset() - start * element.stride(0)
    return element.as_strided((total, *element.shape[1:]), element.stride(), offset)


def _write_whole(value: Any, element: Any) -> Any:
    if isinstance(element, torch.Tensor) and getattr(element, "_nnsight_batch", False):
        raise Unavailable(
            "a write to this kernel argument",
            f"it is one tensor for the whole batch, and its leading dim ({whole(element).shape[0]}) equals this trace's "
            "batch size, so nnsight's batcher would splice the write in as batch rows: write it in a trace whose batch "
            "size differs (one invoke, or another number of prompts)",
        )
    return value


#: One tensor for the whole batch (a parameter), whatever nnsight's batcher took it for (`whole`).
PARAMETER = Layout("one for the whole batch", whole, _write_whole)
#: ``[heads, ...]`` expanded over trailing axes (Mamba-2's decode A, D, dt_bias), one for the whole batch: served ``[heads]``.
PER_HEAD = Layout(
    "[heads, ...] expanded",
    lambda e: whole(e).reshape(whole(e).shape[0], -1)[:, 0],
    lambda v, e: _write_whole(v, e).reshape(v.shape[0], *([1] * (e.dim() - 1))).expand_as(whole(e)),
)
#: ``[batch, heads, head_dim]`` expanded over head_dim, one token (Mamba-2's decode dt): served ``[batch, 1, heads]``.
ONE_TOKEN_PER_HEAD = Layout(
    "[batch, heads, head_dim] expanded (one token)",
    lambda e: e[..., 0].unsqueeze(1),
    lambda v, e: v[:, 0, :, None].expand_as(e),
)

#: ``[batch, heads, seq, ...]``, heads first (the mLSTM backend's q, k, v and gates); written back contiguous.
HEADS_FIRST = Layout("[batch, heads, seq, ...]", lambda e: e.transpose(1, 2), lambda v, e: v.transpose(1, 2).contiguous())

#: ``{name: (where, layout)}``: one kernel's signature table.
Signature = dict


def serve(table: Signature, name: str, call: tuple) -> Any:
    """Argument ``name`` of ``call`` (``(args, kwargs)``), tokens first; ``None`` where the kernel has no such argument."""
    slot = table.get(name)
    if slot is None:
        return None
    where, layout = slot
    return tokens_first(select_from(call, where), layout)


def serve_all(table: Signature, call: tuple) -> dict:
    """Every argument of ``table`` by name, tokens first, as `serve` serves each (one pass over the call)."""
    elements = select_all(call, [where for where, _ in table.values()])
    marks = torch.is_grad_enabled()  # once for every argument: without autograd no view is marked
    return {name: tokens_first(element, layout, marks) for (name, (_, layout)), element in zip(table.items(), elements)}


def tokens_first(element: Any, layout: Layout, marks: bool = True) -> Any:
    """A kernel argument in the served layout: a tensor seen through ``layout``, anything else as it is
    (``marks=False``: autograd records nothing now, so `on_the_path` has nothing to mark)."""
    if not isinstance(element, torch.Tensor) or layout is SAME:
        return element
    if layout is PARAMETER:
        return whole(element)
    # Another layout is a view of what the kernel consumes: its .grad is read off that tensor's.
    return on_the_path(layout.read(element)) if marks else layout.read(element)


def own_nodes(call: Any, table: Signature) -> bool:
    """Under autograd, give the kernel a node of its own for each argument it holds in another layout than served.

    A value served in another layout is a view of the kernel's argument, and
    its ``.grad`` is read off that tensor's (`serve`). Where the forward also
    uses that tensor elsewhere (Mamba-1's ``x`` feeds ``x_proj`` too), its
    gradient would count those uses, which writing the value does not change.
    An identity `graft` (the same numbers, bit for bit) that only the kernel
    reads makes the view's gradient the kernel's path alone. Called once per
    call, at the kernel's input; returns whether an argument was replaced.
    """
    if not recording():
        return False
    changed = False
    for where, layout in table.values():
        if layout is SAME or layout is PARAMETER:
            continue
        element = select_from(call.arguments, where)
        if isinstance(element, torch.Tensor) and element.requires_grad:
            call.args, call.kwargs = replace_in(call.arguments, where, graft(element, element, element))
            changed = True
    return changed


def named(table: Signature, call: tuple) -> dict:
    """Every argument of ``call`` the table names, by name, as the kernel holds it (no layout applied)."""
    return {name: select_from(call, where) for name, (where, _) in table.items()}


# -- the step size Δ (written once, in nnterp.fast.step) and its inverse ------------------


def step_input(delta: torch.Tensor, bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """The ``dt`` a kernel takes for the step size ``delta``: the inverse of `step_size` (inside its limit)."""
    step = inverse_softplus(delta) if softplus else delta
    return step - bias.to(step.dtype) if bias is not None else step


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) == y`` (``y > 0``), stable for small and large ``y``."""
    return y + torch.log(-torch.expm1(-y))


def keep_unchanged(new: torch.Tensor, served: torch.Tensor, computed: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``computed`` where ``new`` differs from what was ``served``, ``kept`` (the kernel's own) where it does not.

    An inverse (softplus⁻¹, a division by ``A``) does not round-trip bit for
    bit: writing back a value as served must leave the kernel's input as it was.
    """
    return torch.where(new == served, kept, computed.to(kept.dtype))


def served_step(mixer: Any) -> torch.Tensor:
    """Δ of a Mamba mixer's call, tokens first, from its ``dt``, ``dt_bias``, ``dt_softplus`` (and ``dt_limit``)."""
    return served_step_size(mixer.record().serve_all())


def kernel_waiting(mixer: Any) -> bool:
    """Whether this call's kernel has not started yet, so its arguments can still be rewritten."""
    return mixer.record().kernel_waiting()


def reached_through(mixer: Any, served: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``served`` (Δ, or a value computed from it), made what the kernel's ``dt`` is read through, under autograd.

    ``step`` is Δ recomputed from ``served``; the kernel's ``dt`` becomes a
    `graft` of ``dt`` (the kernel sees the same numbers) on ``step_input(step)``,
    so ``served.grad`` is the loss's derivative by it. Without autograd, or once
    the kernel has started, ``served`` is returned as it is.
    """
    if recording(served) and kernel_waiting(mixer):
        call = mixer.record()
        rebuilt = step_input(step, call.serve("dt_bias"), bool(call.serve("dt_softplus")))
        call.assign("dt", graft(served, rebuilt, call.serve("dt")))
    return served


def served_betas(mixer: Any) -> torch.Tensor:
    """The ``betas`` value: Δ (`served_step`), which the kernel's ``dt`` is read through under autograd."""
    step = served_step(mixer)
    return reached_through(mixer, step, step)


def assign_step(mixer: Any, value: Any) -> None:
    """Write Δ back as the ``dt`` the kernel takes (`step_input`), leaving entries written back unchanged bit for bit."""
    served = served_step(mixer)
    check_tensor("`linear_attn.betas`", value, served)
    call = mixer.record()
    step = step_input(value, call.serve("dt_bias"), bool(call.serve("dt_softplus")))
    call.assign("dt", keep_unchanged(value, served, step, call.serve("dt")))


def cut(table: dict, spec: Any, call: tuple, lo: int, hi: int, initial: Any, final: bool) -> tuple:
    """``(args, kwargs)`` of ``call`` restricted to tokens ``[lo, hi)``, starting from ``initial``, asking for the final state.

    Each token argument is sliced in its own layout (tokens first, then laid
    back: Mamba-1's are channel-first); ``initial``, one of the spec's own
    states, is passed in the kernel's format (``spec.starting_from``: RWKV-4's
    triple). A kernel without an initial state (no ``"state"`` in its table)
    runs from zeros: the caller resumes it.
    """
    args, kwargs = call
    start = spec.starting(initial) if spec.starting is not None else {"state": initial}  # no hop into the spec
    for name in spec.tokens:
        where, layout = table[name]
        element = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(where)
        if isinstance(element, torch.Tensor):
            args, kwargs = replace_in((args, kwargs), where, layout.write(layout.read(element)[:, lo:hi], element))
    for name, value in (*start.items(), ("final", final)):
        if name in table:
            args, kwargs = replace_in((args, kwargs), table[name][0], value)
    return args, kwargs
