"""`ChunkBoundaries`: Mamba-2's state after every token, as the chunk scan's boundary states with one token per chunk.

Mamba-2's prompt kernel (state space duality) splits the sequence into chunks
of ``chunk_size`` tokens (256 on the released checkpoints) and computes the
state only at chunk boundaries, all in one einsum (``BOUNDARY_OP``,
``new_states``: ``[batch, chunks + 1, heads, head_dim, state_size]``, index 0
the state entering). With ``chunk_size=1`` every token is a boundary, so the
boundary states are the state after every token, and the scan computes the
same outputs (to float rounding), slower on long prompts (the inter-chunk
einsum grows with the square of the number of chunks).

With ``chunk_per_token(model)`` set, the first per-token read of a call
passes ``chunk_size=1`` to that call's scan (its kernel arguments are written
before it runs); the module's own ``chunk_size`` is never changed. A decode
step's one-step update binds the new state once (``STEP_STATE_OP``).

A write at ``t`` cannot be made at one boundary alone: the einsum computed
every boundary at once, so the next would not see it. The difference
``value - state`` is carried to every later token through the decays, as the
recurrence would carry it; token ``t``'s own output stays as computed (the
scan reads it off the boundary before it).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.calls import forget, mediator, once_per_call, per_call, pinned
from ...core.errors import Unavailable
from ...core.values import check_expected
from ..call import KERNEL_RAN, Call
from ..gradients import fill, on_the_path, recording, tap
from ..kernels import drill, needs_torch_kernels
from ..settings import per_token_setting
from .protocol import Mixer, PerToken, TokenOp


def needs_per_token_chunks(mixer: Mixer) -> str | None:
    """Why the state after every token is unavailable: the chunk scan has boundaries only every ``chunk_size`` tokens."""
    reason = needs_torch_kernels(mixer)
    if reason is not None:
        return reason
    size = mixer.hf_module().chunk_size
    if per_token_setting(mixer) != "chunks" and size != 1:
        return (
            f"the chunk scan materializes the state only at chunk boundaries, every {size} tokens "
            f"(chunk_size={size}); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, "
            "so every token is a boundary (slower on long prompts)"
        )
    return None


class ChunkBoundaries(PerToken):
    """Reads the chunk scan's boundary states, with one token per chunk; writes carry through the decays."""

    name = "chunk boundaries"

    def unavailable(self, mixer: Mixer) -> str | None:
        # Asked by the value's check, then here: resolved once per call (settings and routing hold during a trace).
        return once_per_call(mixer, "chunk boundaries: unavailable", needs_per_token_chunks)

    def require(self, mixer: Mixer, what: str) -> None:
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")

    def record(self, mixer: Mixer) -> Call:
        """This call's record, its scan run with one token per chunk and its boundary op found (once per call)."""
        call = mixer.record()
        if "op" not in call.strategy:
            if not call.decodes:
                call.check_not_started("a per-token state", KERNEL_RAN)
                if call.serve("chunk_size") != 1:
                    call.assign("chunk_size", 1)
            label = mixer.STEP_STATE_OP if call.decodes else mixer.BOUNDARY_OP
            node = getattr(drill(call.op), label)
            call.strategy.update(op=node, first=mediator().occurrence(f"{node.path}.output"))
        return call

    def token_op(self, mixer: Mixer) -> TokenOp:
        call = self.record(mixer)
        return TokenOp(call.strategy["op"], call.strategy["first"], call.seq)

    def boundaries(self, mixer: Mixer) -> tuple[Call, torch.Tensor]:
        """This call's record and the state after each of its tokens, ``[batch, seq, ...]``, read once per call."""
        call = self.record(mixer)

        def read() -> torch.Tensor:
            call.reach(0, "the state after a token", call.strategy["op"], call.strategy["first"])
            with pinned(call.strategy["first"]):
                value = call.strategy["op"].output
                if not call.decodes and recording(value):
                    return self._tapped(mixer, call, value)
            # The chunk scan's index 0 is the state entering; a decode step has no seq axis.
            return on_the_path(value[:, None] if call.decodes else value[:, 1:])

        return call, per_call(mixer, "boundaries", read)

    def states(self, mixer: Mixer) -> torch.Tensor:
        self.require(mixer, "states")
        call, states = self.boundaries(mixer)
        call.advance(call.seq - 1, "states")
        return states

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        self.require(mixer, "state_after")
        call, states = self.boundaries(mixer)
        position = call.position(t, f"state_after({t})")
        call.advance(position, f"state_after({t})")
        return on_the_path(states[:, position])

    def states_of(self, mixer: Mixer, positions: Any) -> torch.Tensor:
        # The boundaries hold every token's state already: index them.
        self.require(mixer, "states_of")
        call, states = self.boundaries(mixer)
        chosen = call.positions(positions, "states_of(positions)")
        call.advance(max(chosen, default=0), "states_of(positions)")
        return on_the_path(states[:, chosen])

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        self.require(mixer, "set_state_after")
        what = f"set_state_after({t}, value)"
        call, states = self.boundaries(mixer)
        position = call.position(t, what)
        check_expected(what, value, *call.expected)
        call.check_no_later_read(position, what)
        op, first = call.strategy["op"], call.strategy["first"]
        if call.decodes:
            call.check_open(what)
            mixer.write_state_output(value)  # the cache's buffer, after the step's own update
            updated = value[:, None]
        else:
            call.check_before(op, first, what, "the scan had moved past its boundary states")
            with pinned(first):
                current = op.output
            boundaries = current.clone()
            boundaries[:, 1:] = current[:, 1:] + self._carried(mixer, position, value - current[:, position + 1])
            boundaries[:, position + 1] = value
            with pinned(first):
                op.output = boundaries
            updated = boundaries[:, 1:]
        # Later reads of this call are served from the record: keep it current.
        forget(mixer, "boundaries")
        per_call(mixer, "boundaries", lambda: updated)
        call.furthest = (position, what)
        call.writes[position] = value

    def _tapped(self, mixer: Mixer, call: Call, boundaries: torch.Tensor) -> torch.Tensor:
        """The states after every token as a leaf the scan reads through (under autograd; pinned at the boundaries).

        The scan computed every boundary at once, so the state after token
        ``t`` reaches token ``t + 1``'s output only, not the later boundaries.
        The boundaries the scan goes on with read the tap ``collect`` once at
        ``t`` and through the decays at every later token, each an exact zero,
        so ``collect``'s gradient at ``t`` is the loss's derivative by the state
        after ``t`` as the recurrence carries it (what `set_state_after` writes).
        """
        states = boundaries[:, 1:]
        collect = tap(tuple(states.shape), states)
        zero = collect - collect.detach()
        log = mixer.log_decays().detach().float()  # [batch, seq, heads]
        total = torch.cumsum(log, dim=1)
        gap = total[:, :, None] - total[:, None, :]  # [batch, t, s, heads]: Σ_{s<j≤t} decays_j
        later = torch.ones(log.shape[1], log.shape[1], dtype=torch.bool, device=log.device).tril(-1)[None, :, :, None]
        weight = gap.masked_fill(~later, float("-inf")).exp()
        carried = torch.einsum("btsh,bshpn->bthpn", weight, zero)
        through = torch.cat([torch.zeros_like(boundaries[:, :1]), (zero + carried).to(states.dtype)], dim=1)
        # A sum keeps the boundaries' memory layout (a new layout changes the scan's rounding downstream).
        call.strategy["op"].output = boundaries + through
        return fill(collect, states.detach())

    def _carried(self, mixer: Mixer, position: int, delta: torch.Tensor) -> torch.Tensor:
        """``delta`` (the change of the state after token ``position``) as it reaches every token, ``[batch, seq, ...]``.

        The state after token ``c > position`` changes by ``exp(Σ_{position<j≤c} decays_j) · delta``; tokens up to ``position`` not.
        """
        log = mixer.log_decays()  # [batch, seq, heads]
        total = torch.cumsum(log, dim=1)
        gap = total - total[:, position : position + 1]
        after = torch.arange(log.shape[1], device=log.device)[None, :, None] >= position
        factor = torch.where(after, gap.exp(), torch.zeros_like(gap))
        return factor[..., None, None] * delta[:, None].to(factor.dtype)

    def state(self, mixer: Mixer) -> torch.Tensor:
        self.require(mixer, "state")
        t = mediator("`linear_attn.state`").iteration or 0  # the token tracer.iter pins (outside a loop: token 0)
        with pinned(None):
            call, _ = self.boundaries(mixer)
        if t >= call.seq:
            # Past the call's last token: park where the run never comes, so an open
            # tracer.iter[:] ends as it does on a DeltaNet, with nnsight's "never reached".
            with pinned(call.strategy["first"] + t + 1):
                return call.strategy["op"].output
        # The read relaxes tracer.iter's pin: an assignment after it in the loop body means this token.
        call.strategy["iterated"] = t
        with pinned(None):
            return self.state_after(mixer, t)

    def set_state(self, mixer: Mixer, value: torch.Tensor) -> None:
        self.require(mixer, "state")
        pinned_t = mediator("`linear_attn.state`").iteration
        with pinned(None):
            call, _ = self.boundaries(mixer)
            t = pinned_t if pinned_t else call.strategy.get("iterated", 0)
            self.set_state_after(mixer, t, value)


CHUNK_BOUNDARIES = ChunkBoundaries()
