"""`FromForward`: the state after every token of a call whose recurrence is the forward's own (lightning attention).

Mental model. The call's record (`nnterp.recurrent.forward_call.ForwardCall`)
holds its q, k, v, log decays ``g`` and entering state, read where the
forward splits them; every per-token state is computed from those with
`nnterp.fast.lightning_attention` (the decode branch's own operations, so a state
continued here equals the cache's), as `FromArguments` computes a kernel
call's from its arguments. A write that changes the call (``set_state_after``,
a written ``decays``) replaces the forward's concatenated outputs before the
norm by the recurrence continued from the written values (`rewrite`) and
writes the continuation's final state into the forward's own final-state
tensor, which the cache holds. Under autograd ``states`` is a tap and
``decays`` a graft (`nnterp.recurrent.gradients`): an exact zero depending on
them is added to those outputs.

One pass: where ``states`` is read on a fresh prompt before the block loop
started, with no write to the call, in float32 without autograd, on one
invoke, with the block loop's four products found in the release's source and
its decay buffers what ``slope_rate`` gives them (`decays_agree`), the states
are written in place while each is read by its query (`nnterp.fast.lightning_attention.lightning_one_pass`),
the four products of every block are skipped (the values product returns the
block's outputs, the others a zero) and the loop's final state is the pass's
last. `from_arguments.ONE_PASS` (the one switch of every one pass) turns it off.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ...core.calls import mediator, pinned
from ...core.values import check_expected
from ...fast.buffers import empty_states
from ...fast.lightning_attention import lightning_one_pass, lightning_scan, lightning_states, lightning_tap_readout
from ...fast.scan import differentiable
from ..forward_call import ForwardCall
from ..gradients import fill, recording, tap
from . import from_arguments
from .from_arguments import covers_the_batch
from .protocol import Mixer, PerToken

#: The block loop's products, by the variable each one binds, in the order the loop computes them.
PRODUCTS = ("attn_weights_intra", "attn_output_intra", "attn_output_inter", "next_attn_weights_inter")


class FromForward(PerToken):
    """Computes a call's states from its q, k, v and decays, and writes by recomputing the outputs after the write."""

    name = "from the call's q, k, v and decays"

    def unavailable(self, mixer: Mixer) -> str | None:
        return None

    # -- the arithmetic over the record (`nnterp.fast.lightning_attention`) ------------------------------

    @staticmethod
    def scan(call: ForwardCall, lo: int, hi: int, initial: Any, keep: bool = False) -> tuple:
        """``lightning_scan`` over tokens ``[lo, hi)`` of the call from ``initial``."""
        return lightning_scan(call.q[:, lo:hi], call.k[:, lo:hi], call.v[:, lo:hi], call.g[:, lo:hi], initial, keep)

    @staticmethod
    def in_place(call: ForwardCall, *initials: Any) -> bool:
        """Whether the states are written in place (`lightning_states`) rather than by the token loop (`lightning_scan`).

        The token loop is kept under autograd (a graph to keep), for a state in
        another dtype than float32 (computed in it, as transformers does), and on a
        call that continues a state (a decode step): there the forward runs the same
        token loop, so its states equal the cache's bit for bit, which an
        ``addcmul_`` (one rounding where the loop rounds twice) would not.
        """
        return call.q.dtype == torch.float32 and not call.continues and not differentiable(call.k, call.v, call.g, *initials)

    def state_at(self, call: ForwardCall, lo: int, hi: int, initial: Any) -> torch.Tensor:
        """The state after token ``hi - 1`` from ``initial`` before ``lo``: as `computed_states` computes it (so
        ``state_after(t)`` equals ``states[:, t]``), in place in a two-slot ring when `in_place`."""
        if not self.in_place(call, initial):
            return self.scan(call, lo, hi, initial)[1]
        ring = call.q.new_empty((call.q.shape[0], 2, *call.expected[0][1:]))
        lightning_states(call.k[:, lo:hi], call.v[:, lo:hi], call.g[:, lo:hi], initial, ring)
        return ring[:, (hi - lo - 1) % 2].clone()

    def computed_states(self, call: ForwardCall, stop: int | None = None) -> torch.Tensor:
        """The states after tokens ``0 .. stop - 1`` from the call's q, k, v, decays and writes, ``[batch, stop, ...]``.

        When `in_place`, written into one buffer (`lightning_states`); otherwise
        the token loop's states, concatenated. A written state ``t`` is not copied in here.
        """
        runs = call.segments(call.initial, stop)
        if not self.in_place(call, *(initial for _, _, initial in runs)):
            return torch.cat([self.scan(call, lo, hi, initial, keep=True)[2] for lo, hi, initial in runs], dim=1)
        stop = call.seq if stop is None else stop
        out = empty_states((call.q.shape[0], stop, *call.expected[0][1:]), call.q.device)
        for lo, hi, initial in runs:
            lightning_states(call.k[:, lo:hi], call.v[:, lo:hi], call.g[:, lo:hi], initial, out, lo)
        return out

    # -- reads ------------------------------------------------------------------------------

    def states(self, mixer: Mixer) -> torch.Tensor:
        call = mixer.record()
        tapped = recording(call.q) and not call.changed and not call.passed("cat", call.first["cat"])
        out = None if tapped else self.one_pass(mixer, call)  # the block loop skipped, where it applies
        if out is None:
            with torch.no_grad() if tapped else nullcontext():  # a tap's values are detached: as without autograd
                out = self.computed_states(call)
        for t, value in call.writes.items():
            out[:, t] = value
        if not call.changed:
            # The last one is the forward's own (blockwise, so equal to float rounding): state_output bit for bit.
            final = call.forward_final()
            if final is not None:
                out[:, -1] = final
        call.states_read = True
        call.advance(call.seq - 1, f"a read of token {call.seq - 1}")
        if tapped:
            # A tap: a leaf holding the states, read by the later tokens' outputs through an exact zero, so its
            # gradient at t is the loss's derivative by the state after t as the tokens after t read it.
            leaf = fill(tap(tuple(out.shape), out), out.detach())
            g = call.g_leaf.detach() if call.g_leaf is not None else call.g.detach()
            read = lightning_tap_readout(call.q.detach(), g, leaf)
            call.graft((read - lightning_tap_readout(call.q.detach(), g, leaf.detach())).transpose(1, 2))
            return leaf
        return out

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        mediator("`linear_attn.state_after`")
        call = mixer.record()
        position = call.position(t, f"state_after({t})")
        if position in call.writes:
            return call.writes[position]
        lo, hi, initial = call.segments(call.initial, position + 1)[-1]
        call.advance(position, f"a read of token {position}")
        state = self.state_at(call, lo, hi, initial)
        call.read[position] = state
        return state

    def states_of(self, mixer: Mixer, positions: Any) -> torch.Tensor:
        """Equal to ``states[:, positions]``; only the tokens up to the last selected one are computed. A new
        tensor: its ``.grad`` never comes (read ``states.grad``)."""
        mediator("`linear_attn.states_of`")
        call = mixer.record()
        chosen = call.positions(positions, "states_of(positions)")
        if not chosen:
            return call.q.new_empty((call.q.shape[0], 0, *call.expected[0][1:]))
        stop = max(chosen) + 1
        states = self.computed_states(call, stop)
        for t, value in call.writes.items():
            if t < stop:
                states[:, t] = value
        call.advance(stop - 1, f"a read of token {stop - 1}")
        return states[:, chosen]

    def decays(self, mixer: Mixer) -> torch.Tensor:
        """The call's log decays; under autograd a leaf the outputs before the norm read through an exact zero."""
        call = mixer.record()
        if call.g_leaf is not None:
            return call.g_leaf
        if not recording(call.q) or call.changed or call.passed("cat", call.first["cat"]):
            return call.g
        # Under autograd the forward never reads the decays (it reads its buffers): the call's output before the
        # norm gets an exact zero that depends on them (the recurrence with them, minus itself detached).
        leaf = call.g.detach().clone().requires_grad_(True)
        q, k, v = (x.detach() for x in (call.q, call.k, call.v))
        initial = call.initial.detach() if call.initial is not None else None
        rebuilt = lightning_scan(q, k, v, leaf, initial)[0].transpose(1, 2)
        call.graft(rebuilt - rebuilt.detach())
        call.g_leaf = leaf
        return leaf

    # -- writes -------------------------------------------------------------------------------

    def assign_decays(self, mixer: Mixer, value: Any) -> None:
        """Make the call's outputs and final state the recurrence's with decays ``value``."""
        call = mixer.record()
        check_expected("`linear_attn.decays`", value, tuple(call.g.shape), call.g.dtype, call.g.device)
        if torch.equal(value, call.g):
            return  # the forward's own decays: its own loop already computes the call with them
        call.g = value
        call.decays_written = True
        self.rewrite(call, "a write to `linear_attn.decays`")

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        mediator(f"`linear_attn.{what}`")
        call = mixer.record()
        position = call.position(t, what)
        check_expected(what, value, *call.expected)
        call.check_write_order(what, position, call.states_read, call.furthest, call.writes)
        read = call.read.get(position)
        if read is not None and not call.changed and not value.requires_grad and torch.equal(value, read):
            return  # writing back the state this call computes: the call already continues from it, bit for bit
            # (a target that requires grad is written all the same, so the later tokens read it and it gets one)
        call.writes[position] = value
        self.rewrite(call, what)

    def rewrite(self, call: ForwardCall, what: str) -> None:
        """Replace the call's outputs before the norm and its final state by the recurrence with its writes."""
        call.check_still_ahead(call.final is not None or call.forward_final() is not None, what, "the forward had computed the call's final state")
        call.check_ahead("cat", what, "the forward had concatenated the call's outputs")
        current = call.concatenated()
        if call.decays_written:
            pieces = [self.scan(call, lo, hi, initial) for lo, hi, initial in call.segments(call.initial)]
            outputs, final = torch.cat([p[0] for p in pieces], dim=1).transpose(1, 2), pieces[-1][1]
        else:
            keep = min(call.writes) + 1
            pieces = [self.scan(call, lo, hi, initial) for lo, hi, initial in call.segments(call.initial) if lo >= keep]
            tail = [p[0].transpose(1, 2) for p in pieces]
            outputs = torch.cat([call.original[:, :, :keep], *tail], dim=2)
            final = pieces[-1][1] if pieces else call.writes[call.seq - 1]
        if call.seq - 1 in call.writes:
            final = call.writes[call.seq - 1]
        call.replace_outputs(outputs.to(current.dtype))
        # The forward hands this tensor to the cache and returns it after the loop: write into it.
        call.final.copy_(final)

    # -- the one pass -----------------------------------------------------------------------

    def one_pass(self, mixer: Mixer, call: ForwardCall) -> torch.Tensor | None:
        """The states by the one pass, the block loop's products skipped; ``None`` where it does not apply."""
        if not from_arguments.ONE_PASS or call.changed or not self.in_place(call) or not covers_the_batch():
            return None
        products = call.labels["products"]
        module = mixer.hf_module()
        if products is None or not decays_agree(module):
            return None
        med = mediator("`linear_attn.states`")
        ops = {variable: getattr(mixer.source, label) for variable, label in products.items()}
        # Each product and the loop's state binding occur once per block of every earlier prompt, so before this call's
        # loop starts they have all occurred as often as the state binding had when the call's record was made.
        start = call.first["block_state"]
        if any(med.occurrence(f"{op.path}.output") != start for op in ops.values()):
            return None  # the loop has started (a value inside it, or after it, was read first)
        out = empty_states((call.q.shape[0], call.seq, *call.expected[0][1:]), call.q.device)
        with torch.no_grad():
            outputs = lightning_one_pass(call.q, call.k, call.v, call.g, out)
        zero = call.q.new_zeros(())
        size = module.block_size
        blocks = -(-call.seq // size)
        for block in range(blocks):
            values = {"attn_output_intra": outputs[:, :, block * size : (block + 1) * size]}  # float32, as `in_place` asks
            for variable in PRODUCTS:
                with pinned(start + block):
                    ops[variable].skip(values.get(variable, zero))
        # The loop's state ends as its zero writes leave it: the state it returns (and the cache holds) is the pass's last.
        call.final = out[:, -1].clone()
        with pinned(start + blocks - 1):
            Mediator.swap(call.at("block_state"), call.final)
        return out


def decays_agree(hf_mixer: Any) -> bool:
    """Whether the block loop's decay buffers are, to float32 rounding, the ones the mixer's ``slope_rate`` gives.

    A model loaded in bfloat16 then cast to float32 keeps them rounded apart: the one pass, which reads
    ``slope_rate``, would then differ from the loop by more than rounding, so the loop runs.
    """
    factors = getattr(hf_mixer, "decay_factors", None)
    buffers = [getattr(hf_mixer, name, None) for name in ("query_decay", "key_decay", "diagonal_decay")]
    if factors is None or any(buffer is None for buffer in buffers):
        return False
    with torch.no_grad():
        expected = factors(hf_mixer.slope_rate.float())
        return all(
            b.shape == e.shape and torch.allclose(b.float(), e, rtol=1e-5, atol=0) for b, e in zip(buffers, expected)
        )


FROM_FORWARD = FromForward()

__all__ = ["FromForward", "FROM_FORWARD", "PRODUCTS", "decays_agree"]
