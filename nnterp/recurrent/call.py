"""One record per call of a recurrent mixer, and the one order checker every per-token strategy uses.

A worker reads in the order the model runs. A mixer's values of one call
are served from that call's kernel call: its arguments (read once, when the
kernel starts, and kept here so values computed from several of them can be
read later), the states inside it, its return. `Call` keeps what the worker
learnt of the call and what it has read and written; its checks raise
`OrderError` naming the earlier read instead of letting nnsight drop a
request for a moment already passed (nnsight only warns "never reached").

Every kind's order checks are the methods below (`Call.check_reachable` the
one test they share), the MiniMax record and the checks of a call's entry
included: a kind raises `OrderError`, never nnsight's raw ``OutOfOrderError``
naming an internal location.

The record lives on the worker (`nnterp.core.calls.per_call`), so two
invokes never share one and it is freed with its run.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import indices
from ..core.calls import mediator
from ..core.errors import OrderError


def order_hint(asked: str, passed: str) -> str:
    """The `OrderError` sentence: what was asked for, what had already passed, and the order that works."""
    return (
        f"{asked} was asked for after {passed}: a worker reads in the order the model runs, so in one trace "
        "read the kernel's arguments first, then per-token positions in increasing order (positions before a "
        "write, the write, then positions after it; `states` before any write), then `state_output` / "
        "`attention_output`, and a block's reads before any write to a later block"
    )


#: What had passed when a per-token state is asked for after its call's kernel ran.
KERNEL_RAN = "this call's kernel had already run (state_output, attention_output or a later value was read first)"
#: What had passed when a call's first value is asked for after the mixer's call started.
MIXER_RAN = "the mixer's call had started (attention_output, state_output or a later value was read first)"


class Call:
    """What a worker knows of one call of a mixer: its kernel call, its arguments, what was read and written.

    Attributes:
        kernel: the label of the kernel call that fires (``CHUNK_KERNEL`` or ``RECURRENT_KERNEL``).
        op: that call's envoy (``mixer.source.<kernel>``).
        decodes: whether it is the one-token decode kernel.
        args, kwargs: the kernel call's arguments, as written so far by the worker.
        seq: the call's number of tokens.
        expected: ``(shape, dtype, device)`` of one state of this call.
        output_at: how often the kernel had returned when the record was made.
        furthest: ``(position, what)``: the latest token a read or write reached.
        writes: ``{position: state}`` written by ``set_state_after``.
        states_read: whether ``states`` (every position) was read.
        strategy: a per-token strategy's own per-call data (its state op, boundaries, ...).
    """

    __slots__ = (
        "mixer", "kernel", "op", "decodes", "args", "kwargs", "seq", "expected", "started", "output_at",
        "furthest", "writes", "states_read", "strategy",
    )

    def __init__(self, mixer: Any, kernel: str, op: Any, decodes: bool, started: int) -> None:
        self.mixer, self.kernel, self.op, self.decodes, self.started = mixer, kernel, op, decodes, started
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.seq = 0
        self.expected: tuple = ((), torch.float32, None)
        self.output_at = 0
        self.furthest: tuple[int, str] | None = None
        self.writes: dict[int, torch.Tensor] = {}
        self.states_read = False
        self.strategy: dict[str, Any] = {}

    @property
    def arguments(self) -> tuple:
        """``(args, kwargs)`` of the kernel call."""
        return self.args, self.kwargs

    def occurrences(self, location: str) -> int:
        """How often the run has passed ``location`` (a path ending in ``.input`` / ``.output``)."""
        return mediator().occurrence(location)

    # -- the checks ----------------------------------------------------------------

    @staticmethod
    def check_reachable(location: str, first: int, what: str, passed: str) -> None:
        """The one order test: raise `OrderError` (``what`` asked after ``passed``) once the run has passed
        ``location`` more than ``first`` times, where nnsight would raise its raw ``OutOfOrderError``."""
        if mediator().occurrence(location) > first:
            raise OrderError(order_hint(what, passed))

    @staticmethod
    def check_entry(mixer: Any, what: str = "a value of this call of `linear_attn`", location: str | None = None) -> None:
        """Raise unless the run has not passed ``location`` (the mixer's input) of the call a request made now
        asks for: a call's record is made there, before any of its values."""
        entry = location or f"{mixer.path}.input"
        Call.check_reachable(entry, mediator().wanted(entry), what, MIXER_RAN)

    def check_not_started(self, what: str, passed: str = "this call's kernel had started") -> None:
        """Raise unless the kernel call has not started: arguments are read and written, and states found, before it runs."""
        self.check_reachable(f"{self.op.path}.input", self.started, what, passed)

    def check_open(self, what: str) -> None:
        """Raise unless the kernel call has not returned yet."""
        self.check_reachable(f"{self.op.path}.output", self.output_at, what, "the kernel had returned (state_output or a later value was read)")

    def reach(self, position: int, what: str, ops: Any, first: int) -> None:
        """Raise unless the run can still reach occurrence ``first + position`` of every op in ``ops`` (one op, or
        the ops one token's state is read from, in any order); then record it as reached."""
        self.check_open(what)
        earlier = self.furthest[1] if self.furthest is not None else "an earlier read"
        for op in ops if isinstance(ops, (list, tuple)) else (ops,):
            self.check_reachable(f"{op.path}.output", first + position, what, f"{earlier} had moved the run past token {position}")
        self.advance(position, what)

    def advance(self, position: int, what: str) -> None:
        """Record that a read or write reached ``position``."""
        if self.furthest is None or position >= self.furthest[0]:
            self.furthest = (position, what)

    def check_write(self, position: int, what: str) -> None:
        """Raise unless a write at ``position`` comes before the kernel returned and after no read or write of a
        later (or the same) position."""
        self.check_open(what)
        self.check_write_order(what, position, self.states_read, self.furthest, self.writes)

    @staticmethod
    def check_write_order(what: str, position: int, states_read: bool, furthest: tuple | None, writes: dict) -> None:
        """The write order, on any kind's record: no `states` read before, no later token read, writes increasing."""
        if states_read:
            raise OrderError(order_hint(what, "states"))
        if furthest is not None and furthest[0] > position:
            raise OrderError(order_hint(what, f"{furthest[1]} had read a later token"))
        if writes and max(writes) >= position:
            raise OrderError(order_hint(what, f"set_state_after({max(writes)}, value)"))

    def positions(self, selection: Any, what: str) -> list[int]:
        """``selection`` (a sequence of ints, a range, a 1-d tensor) as positions of this call, in the order given."""
        return indices.sequence(selection, self.seq, what)

    def position(self, t: Any, what: str) -> int:
        """``t`` as a position of this call (negative counts from the end), or an error naming the range."""
        return indices.index(t, self.seq, what)
