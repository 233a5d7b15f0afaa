"""Kernel arguments by name, served tokens-first whatever the kernel's layout.

Mental model: a Mamba mixer calls one of two kernels, and the same quantity
(the input ``x``, the step ``dt``, ``B``, ``C``, ...) sits at a different
place in each call and in a different layout. Mamba-1's prompt kernel is
channel-first (``x`` is ``[batch, channels, seq]``) and its decode kernel has
no sequence axis (``[batch, channels]``); Mamba-2's decode kernel takes its
per-head values already expanded over ``head_dim``. A mixer declares, per
kernel, a table ``name -> (where, layout)`` (``CHUNK_ARGUMENTS``,
``RECURRENT_ARGUMENTS``); every value is served in one layout, tokens first
(``[batch, seq, ...]``, ``seq`` = 1 on a decode step), and laid back into the
kernel's layout on write.

Both Mamba decode kernels also update the cached state *in place*
(``state.copy_(...)``): the tensor a decode call receives as its state is the
cache's own buffer. So the state entering a decode step is served as a copy
and written by copying into that buffer, and the state leaving it is the
buffer after the call (`KernelArguments`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from nnsight.intervention.interleaver import Mediator

from ..core.calls import forget, mediator, per_call
from ..core.errors import NnterpError, OrderError, Unavailable
from ..core.values import EProperty, check_expected, check_tensor, replace_in, select_from
from .recurrent import RecurrentMixer, needs_torch_kernels


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
#: ``[heads, ...]`` expanded over trailing axes (Mamba-2's decode A, D, dt_bias): served ``[heads]``.
PER_HEAD = Layout(
    "[heads, ...] expanded",
    lambda e: e.reshape(e.shape[0], -1)[:, 0],
    lambda v, e: v.reshape(v.shape[0], *([1] * (e.dim() - 1))).expand_as(e),
)
#: ``[batch, heads, head_dim]`` expanded over head_dim, one token (Mamba-2's decode dt): served ``[batch, 1, heads]``.
ONE_TOKEN_PER_HEAD = Layout(
    "[batch, heads, head_dim] expanded (one token)",
    lambda e: e[..., 0].unsqueeze(1),
    lambda v, e: v[:, 0, :, None].expand_as(e),
)

Where = Union[int, str]


class KernelArguments(RecurrentMixer):
    """A `RecurrentMixer` whose kernel arguments are read by name through per-kernel tables.

    ``CHUNK_ARGUMENTS`` / ``RECURRENT_ARGUMENTS``: ``{name: (where, layout)}``,
    ``where`` a position in the call's args or a keyword. The entry ``"state"``
    is the state entering the call, where the kernel takes one.
    """

    CHUNK_ARGUMENTS: dict[str, tuple[Where, Layout]] = {}
    RECURRENT_ARGUMENTS: dict[str, tuple[Where, Layout]] = {}

    # -- which kernel, which table -------------------------------------------

    def _decodes(self) -> bool:
        """Whether this call runs the one-token decode kernel (decided once per call)."""
        cls = type(self)
        return cls.KERNEL(self) == cls.RECURRENT_KERNEL

    def _table(self) -> dict:
        cls = type(self)
        return cls.RECURRENT_ARGUMENTS if self._decodes() else cls.CHUNK_ARGUMENTS

    def _kernel_op(self) -> Any:
        return getattr(self.source, type(self).KERNEL(self))

    def _arguments(self, what: str = "a kernel argument") -> tuple:
        """This call's kernel ``(args, kwargs)``, read once per call at the kernel's start (`per_call`).

        Values that need another argument (``betas`` needs ``dt_bias``) read it
        here, so they can still be computed after the kernel has run.
        """

        def read() -> tuple:
            op = self._kernel_op()
            kernel = type(self).KERNEL(self)
            if mediator().occurrence(f"{op.path}.input") > self._call()["kernels"][kernel]:
                raise OrderError(self._order_hint(what, "this call's kernel had already started (state_output, attention_output or a later value was read first)"))
            return op.inputs

        return per_call(self, "arguments", read)

    def _writable_arguments(self, what: str) -> tuple:
        """The call's arguments, while a write can still reach them: before the kernel starts."""
        call = self._arguments()
        op = self._kernel_op()
        if mediator().occurrence(f"{op.path}.input") > self._call()["kernels"][type(self).KERNEL(self)]:
            raise OrderError(self._order_hint(f"a write to {what}", "this call's kernel had started"))
        return call

    def _token_op(self) -> Any:
        # Record the arguments first: the per-token drill moves the run past the kernel's start.
        self._arguments("a per-token state")
        return super()._token_op()

    # -- serving and laying back ---------------------------------------------

    def _slot(self, name: str) -> Optional[tuple[Where, Layout]]:
        return self._table().get(name)

    def _serve(self, name: str, call: tuple) -> Any:
        """Argument ``name`` of ``call``, tokens first; ``None`` where this kernel has no such argument."""
        slot = self._slot(name)
        if slot is None:
            return None
        where, layout = slot
        element = select_from(call, where)
        if not isinstance(element, torch.Tensor):
            return element
        return layout.read(element)

    def _lay(self, name: str, view: Any) -> tuple:
        """This call's ``(args, kwargs)`` with argument ``name`` replaced by ``view``, laid back in the kernel's layout."""
        slot = self._slot(name)
        what = f"`linear_attn.{name}`"
        if slot is None:
            raise NnterpError(f"{what} is not an argument of this call's kernel ({type(self).KERNEL(self)})")
        where, layout = slot
        call = self._writable_arguments(what)
        current = select_from(call, where)
        if isinstance(current, torch.Tensor):
            check_tensor(what, view, layout.read(current))
            element = layout.write(view, current)
        else:
            element = view
        updated = replace_in(call, where, element)
        # Later values of this call (betas from dt, ...) read the record: keep it current.
        forget(self, "arguments")
        per_call(self, "arguments", lambda: updated)
        return updated

    def argument(self, name: str) -> Any:
        """Any argument of this call's kernel by name, tokens first (``[batch, seq, ...]``; parameters as served).

        The names are the tables' keys (``CHUNK_ARGUMENTS`` / ``RECURRENT_ARGUMENTS``);
        ``None`` where this call's kernel takes no such argument.
        """
        names = set(type(self).CHUNK_ARGUMENTS) | set(type(self).RECURRENT_ARGUMENTS)
        if name not in names:
            raise NnterpError(f"`linear_attn.argument` takes one of {sorted(names)}, got {name!r}")
        reason = needs_torch_kernels(self)
        if reason is not None:
            raise Unavailable(f"linear_attn.argument({name!r})", reason)
        mediator(f"`linear_attn.argument({name!r})`")
        return self._serve(name, self._arguments())

    # -- the state entering and leaving a call --------------------------------

    def _state_input(self, call: tuple) -> Optional[torch.Tensor]:
        state = self._serve("state", call)
        # On a decode step this is the cache's buffer, which the kernel overwrites in place.
        return state.clone() if state is not None else None

    def _lay_state_input(self, value: Any) -> tuple:
        call = self._writable_arguments("`linear_attn.state_input`")
        args, kwargs = call
        shape = self._state_shape(args, kwargs)
        check_expected("`linear_attn.state_input`", value, shape, torch.float32, args[0].device)
        if self._decodes():
            # The kernel updates this buffer in place and nothing else writes the cache:
            # write into it, so the step continues from value and the cache follows.
            self._state_buffer().copy_(value)
            return call
        if self._slot("state") is None:
            raise NnterpError(
                f"{type(self).__name__}'s prompt kernel takes no initial state (it starts from zeros): assign "
                "`state_input` on a decode step, or use set_state_after(t, value) inside the prompt"
            )
        return self._lay("state", value)

    def _state_buffer(self) -> torch.Tensor:
        """On a decode step: the cache's state buffer, which the kernel updates in place."""
        return select_from(self._arguments(), self._slot("state")[0])

    def _state_output(self) -> torch.Tensor:
        op = self._kernel_op()
        if self._decodes():
            buffer = self._state_buffer()
            op.output  # the kernel has returned: the buffer holds the new state
            return buffer.clone()
        output = op.output
        if not isinstance(output, tuple):
            raise NnterpError(_NO_CACHE)
        return output[1]

    def _write_final(self, record: Any, value: torch.Tensor) -> None:
        # The state after the call's last token: the kernel's returned final state
        # on a prompt, the cache's buffer after a decode step.
        self._assign_state_output(value)

    def _assign_state_output(self, value: Any) -> None:
        op = self._kernel_op()
        what = "`linear_attn.state_output`"
        if self._decodes():
            buffer = self._state_buffer()
            op.output
            check_tensor(what, value, buffer)
            buffer.copy_(value)
            return
        output = op.output
        if not isinstance(output, tuple):
            raise NnterpError(_NO_CACHE)
        check_tensor(what, value, output[1])
        op.output = (output[0], value, *output[2:])


_NO_CACHE = (
    "this call runs without a cache, so its kernel returns no final state: run it with use_cache=True "
    "(the default of a trace and of generate)"
)


class KernelValue(EProperty):
    """A value of the kernel call's arguments, served from this call's record of them (`KernelArguments._arguments`).

    Its location is the kernel's inputs (``<kernel.inputs>``), but a read is
    served from the record, so arguments can be read at any point of the call
    (after ``states`` too). A write replaces the argument in the call and
    must come before the kernel starts.
    """

    def __init__(self, read: Callable[[Any], Any], write: Callable[[Any, Any], tuple], **kwargs: Any) -> None:
        super().__init__(RecurrentMixer.kernel("inputs"), unavailable=needs_torch_kernels, **kwargs)
        self.read, self.write = read, write

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        self.check(obj)
        return self.read(obj)

    def __set__(self, obj: Any, value: Any) -> None:
        self.check(obj)
        location = self._location(obj)
        Mediator.swap(location, self.write(obj, value))


def kernel_argument(name: str, description: str, annotation: Any) -> KernelValue:
    """A declared value: argument ``name`` of whichever kernel fires, tokens first, laid back on write."""
    return KernelValue(
        lambda envoy: envoy._serve(name, envoy._arguments()),
        lambda envoy, view: envoy._lay(name, view),
        description=description,
        annotation=annotation,
    )


def state_input(description: str, annotation: Any) -> KernelValue:
    """The state entering the call, a copy; assigning it makes the call continue from the assigned state."""
    return KernelValue(
        lambda envoy: envoy._state_input(envoy._arguments()),
        lambda envoy, value: envoy._lay_state_input(value),
        description=description,
        annotation=annotation,
    )


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) == y`` (``y > 0``), stable for small and large ``y``."""
    return y + torch.log(-torch.expm1(-y))


def keep_unchanged(new: torch.Tensor, served: torch.Tensor, computed: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``computed`` where ``new`` differs from what was ``served``, ``kept`` (the kernel's own) where it does not.

    An inverse (softplus⁻¹, a division by ``A``) does not round-trip bit for
    bit: writing back a value as served must leave the kernel's input as it was.
    """
    return torch.where(new == served, kept, computed.to(kept.dtype))
