"""`TokenLoop`: the state after every token, read once per token inside the routed token-by-token kernel.

transformers' token-by-token kernel (the gated delta rule's decode kernel,
Mamba-1's pure-torch scan) binds the state after each token's update once
per token: ``STATE_OP`` (``last_recurrent_state_3``) fires ``seq`` times per
call. ``route_kernels(family, "torch")`` binds a prompt's kernel name to that
loop. Within one run the op's occurrences run on across calls, so the record
keeps ``first``, the op's occurrence count when the call's kernel starts (the
tokens earlier calls put through it): token ``t`` of this call is occurrence
``first + t``, which a read pins (`nnterp.core.calls.pinned`).

A write at ``t`` (`set_state_after`) leaves token ``t``'s own readout: the
component's ``continue_from`` writes the state token ``t + 1`` starts from
(the decayed state on a DeltaNet, the next update on Mamba-1), and on the
call's last token the kernel's returned final state.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.calls import mediator, once_per_call, outputs_at, pinned
from ...core.errors import Unavailable
from ...core.values import check_expected
from ..call import KERNEL_RAN, Call
from ..gradients import fill, recording, tap
from ..kernels import bound, modeling_of, needs_torch_kernels, torch_function
from ..settings import runs_remotely
from .from_arguments import one_pass
from .protocol import Mixer, PerToken, TokenOp

#: Where a kind's own one pass (``OWN_ONE_PASS``) keeps the states it filled, in the call's per-strategy data.
ONE_PASS_STATES = "one_pass"


def needs_recurrent_routing(mixer: Mixer) -> str | None:
    """Why the per-token state is unavailable: only the token-by-token kernel materializes it."""
    if mixer.STATE_OP is None:
        return "this mixer's kernels do not materialize the state after each token"
    reason = needs_torch_kernels(mixer)
    if reason is not None:
        return reason
    if not type(mixer).CHUNK_FUNCTION:
        return None  # the token loop is the mixer's own method (RG-LRU's scan): every prompt runs it, nothing to route
    modeling = modeling_of(mixer.hf_module())
    # Through the dispatcher or bound bare, what counts is the body a prompt runs (Mamba-1: the loop already).
    if torch_function(bound(modeling, type(mixer).CHUNK_FUNCTION)) is not mixer.loop_function():
        if runs_remotely(mixer):
            return (
                "the state after each token is materialized only by the token-by-token kernel, and this model runs "
                "on a server, where route_kernels (which rebinds this process's transformers) cannot reach: call "
                "nnterp.fast_states(model) before the trace to compute it from the kernel call's own arguments "
                "(`state` under tracer.iter has no such path: read state_after(t) instead)"
            )
        return (
            "the state after each token is materialized only by the token-by-token kernel; the chunked kernel a "
            "prompt runs through carries it between chunks. Call nnterp.route_kernels(model.family, 'torch') "
            "before tracing this layer (slower, like attn_implementation='eager')"
        )
    return None


class TokenLoop(PerToken):
    """Reads and writes the state binding the token loop makes once per token."""

    name = "token loop"

    def unavailable(self, mixer: Mixer) -> str | None:
        # Asked by the value's check, then here: resolved once per call (settings and routing hold during a trace).
        return once_per_call(mixer, "token loop: unavailable", needs_recurrent_routing)

    def require(self, mixer: Mixer, what: str) -> Call:
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")
        return self.record(mixer)

    def record(self, mixer: Mixer) -> Call:
        """This call's record, with the state op found under its kernel (once per call)."""
        call = mixer.record()
        if "op" not in call.strategy:
            call.check_not_started("a per-token state", KERNEL_RAN)
            source = mixer.loop_source(call.op)
            label = mixer.STEP_STATE_OP if call.decodes and mixer.STEP_STATE_OP is not None else mixer.STATE_OP
            node = getattr(source, label)
            call.strategy.update(op=node, source=source, first=mediator().occurrence(f"{node.path}.output"))
        return call

    def token_op(self, mixer: Mixer) -> TokenOp:
        call = self.record(mixer)
        return TokenOp(call.strategy["op"], call.strategy["first"], call.seq)

    @staticmethod
    def _kept(call: Call, position: int) -> torch.Tensor | None:
        """The state after ``position`` if it is the last one this call read: read again, it is served from here,
        on every kind (RWKV's state is three bindings, the first of which the run has passed by the third)."""
        kept = call.strategy.get("kept")
        return kept[1] if kept is not None and kept[0] == position else None

    @staticmethod
    def _bound(call: Call, occurrence: int | None) -> torch.Tensor:
        """The state after the token at ``occurrence`` of the state op (``None``: the next one): the kind's own
        ``token_state`` where it has one (RWKV: three bindings), else the state op's output there."""
        hook = call.mixer.token_state
        if hook is not None:
            return hook(call, occurrence)
        with pinned(occurrence):
            return call.strategy["op"].output

    def _pinned(self, call: Call, position: int) -> torch.Tensor:
        kept = self._kept(call, position)
        if kept is None:
            kept = self._bound(call, call.strategy["first"] + position)
            call.strategy["kept"] = (position, kept)
        return kept

    @staticmethod
    def _rest(call: Call, start: int) -> list:
        """The states after tokens ``start .. seq - 1``, read in one pass of pinned reads of the state op."""
        first = call.strategy["first"]
        rest = outputs_at(call.strategy["op"], range(first + start, first + call.seq))
        call.strategy["kept"] = (call.seq - 1, rest[-1])
        return rest

    def _reach(self, call: Call, position: int, what: str, op: Any = None) -> None:
        call.reach(position, what, op or call.mixer.token_ops(call, position), call.strategy["first"])

    def _served(self, mixer: Mixer) -> torch.Tensor | None:
        """The states a kind's own one pass filled in this call, or ``None`` (a kind without one: never)."""
        if type(mixer).OWN_ONE_PASS is None or self.unavailable(mixer) is not None:
            return None
        mediator("`linear_attn.states`")
        return mixer.record().strategy.get(ONE_PASS_STATES)

    def _one_pass(self, mixer: Mixer) -> torch.Tensor | None:
        """``states`` by the kind's own one pass (RWKV-4: the kernel's loop run once with every state, the call
        skipped with its return, through the one switch `from_arguments.one_pass`), where it applies: a call
        where nothing per-token was read or written yet. After it ``state_after`` reads the buffer and
        ``set_state_after`` is refused, as after ``states`` on every path."""
        own = type(mixer).OWN_ONE_PASS
        if own is None or self.unavailable(mixer) is not None:
            return None
        mediator("`linear_attn.states`")
        call = mixer.record()
        if ONE_PASS_STATES in call.strategy:
            return call.strategy[ONE_PASS_STATES]
        if call.strategy or call.furthest is not None:
            return None  # something per-token already read or written in this call: the loop serves it
        shape = call.expected[0]
        arguments = dict(call.serve_all())
        out = one_pass(mixer, call, own, arguments, (shape[0], call.seq, *shape[1:]))
        if out is not None:
            call.strategy[ONE_PASS_STATES] = out
            call.states_read = True
            call.advance(call.seq - 1, "states")
        return out

    def states(self, mixer: Mixer) -> torch.Tensor:
        served = self._one_pass(mixer)
        if served is not None:
            return served
        call = self.require(mixer, "states")
        if self._kept(call, 0) is None:
            self._reach(call, 0, "states")
        out: list = []
        collect = None
        for position in range(call.seq):
            if collect is None and mixer.token_state is None and self._kept(call, position) is None and (
                position or not torch.is_grad_enabled()
            ):
                # No tap goes between tokens (autograd is off, or token 0 needed none) and the kind has no hook of
                # its own: the state op's outputs from here on, in one pass.
                out += self._rest(call, position)
                break
            state = self._pinned(call, position)
            out.append(state)
            if position == 0 and recording(state):
                collect = tap((state.shape[0], call.seq, *state.shape[1:]), state)
            if collect is not None and position + 1 < call.seq:
                # Token t + 1 continues from the state through the tap (an exact zero), as set_state_after writes it.
                call.advance(position, "states")
                mixer.continue_from(call, position, state + collect[:, position])
        if call.seq:
            call.advance(call.seq - 1, "states")
        if collect is not None:
            # A leaf the later tokens read through: its gradient at t is the loss's derivative by the state after t.
            return fill(collect, torch.stack([s.detach() for s in out], 1))
        return torch.stack(out, 1)

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        what = f"state_after({t})"
        served = self._served(mixer)
        if served is not None:
            return served[:, mixer.record().position(t, what)]
        call = self.require(mixer, "state_after")
        position = call.position(t, what)
        if position in call.writes:
            return call.writes[position]
        if self._kept(call, position) is None:
            self._reach(call, position, what)
        return self._pinned(call, position)

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        if self._served(mixer) is not None:
            mixer.record().check_no_states_read(what)
        call = self.require(mixer, "set_state_after")
        position = call.position(t, what)
        check_expected(what, value, *call.expected)
        # Token t itself may have been read (read-modify-write): what must still come is token t + 1's start.
        call.check_open(what)
        if position + 1 < call.seq:
            self._reach(call, position + 1, what, op=mixer.continue_op(call))
            mixer.continue_from(call, position, value)
        else:
            mixer.write_state_output(value)
        call.writes[position] = value
        call.strategy.pop("kept", None)
        call.advance(position + 1, what)

    def location(self, mixer: Mixer) -> str:
        with pinned(None):
            call = self.record(mixer)
        return call.strategy["op"].path[len(mixer.path) + 1:] + ".output"

    def state(self, mixer: Mixer) -> torch.Tensor:
        self.require_iteration(mixer)
        occurrence = mediator("`linear_attn.state`").iteration or 0
        with pinned(None):
            call = self.record(mixer)
        # The read relaxes tracer.iter's pin: an assignment after it in the loop body means this token.
        call.strategy["iterated"] = occurrence - call.strategy["first"]
        return self._bound(call, occurrence or None)

    def set_state(self, mixer: Mixer, value: torch.Tensor) -> None:
        # One meaning on every mixer: the token tracer.iter pins is `set_state_after`'s t.
        self.require_iteration(mixer)
        occurrence = mediator("`linear_attn.state`").iteration
        with pinned(None):
            call = self.record(mixer)
            position = occurrence - call.strategy["first"] if occurrence else call.strategy.get("iterated", 0)
            self.set_state_after(mixer, position, value)

    def require_iteration(self, mixer: Mixer) -> None:
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable("linear_attn.state", reason)
        mediator("`linear_attn.state`")


TOKEN_LOOP = TokenLoop()

__all__ = ["TokenLoop", "TOKEN_LOOP", "TokenOp", "needs_recurrent_routing", "ONE_PASS_STATES"]
