"""`SplitCall`: the mLSTM's states from its backend call's arguments, and writes by splitting that call.

transformers' xLSTM runs a prompt through one method call, the layer's
backend module (``self.mlstm_backend(query=…, key=…, …, c_initial=…)``),
chunkwise: it keeps the state only at chunk boundaries. So, as `FromArguments`
does for a kernel call, this strategy reads only the call's arguments
(``call.serve``: q, k, v, the gates, the packed entering ``"state"``):

* ``states`` computes every packed state from them (`nnterp.fast.mlstm`),
  into one buffer; where the backend would run transformers' own pure-torch
  kernel (float32, no autograd, one invoke), the one switch
  (`from_arguments.one_pass`, the kind's ``OWN_ONE_PASS``) computes the
  backend's output with the states and skips the call. Under autograd, read
  before the backend runs, the states are a leaf the layer's output is read
  through (`tapped`);
* ``state_after(t)`` / ``states_of`` compute the states up to ``t`` only;
* ``set_state_after(t, value)`` splits the call: the backend's own forward
  (the mixer's ``run_kernel``) runs on ``[0, t]`` and on the rest from
  ``value``, and the call is skipped with both outputs and the second part's
  final state, as a cache holding ``value``, continued by the rest, would give.

It serves the mLSTM whatever the model's setting (its own strategy: no
routing, no fast path). A state is packed ``[batch, mixer_heads, key_dim,
value_dim + 2]`` (``C``, ``n``, ``m``; `nnterp.fast.mlstm.pack`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.calls import mediator
from ...core.values import check_expected, replace_in
from ...fast.buffers import empty_states
from ...fast.mlstm import mlstm_states, mlstm_states_into, unpack
from ...fast.scan import differentiable
from ..call import Call
from ..gradients import fill, graft, recording, tap
from .from_arguments import covers_the_batch, one_pass
from .protocol import Mixer, PerToken

#: Where the one pass keeps the states it filled, in the call's per-strategy data.
ONE_PASS_STATES = "one_pass"
GATES = ("q", "k", "v", "igate", "fgate")


class SplitCall(PerToken):
    """States from the backend call's arguments; a write splits the call."""

    name = "the backend call's arguments, split for writes"

    def record(self, mixer: Mixer, what: str) -> Call:
        """This call's record, with the state it starts from (once per call)."""
        mediator(f"`linear_attn.{what}`")
        call = mixer.record()
        if "initial" not in call.strategy:
            call.strategy.update(initial=call.serve("state"), served=False, read={})
        return call

    @staticmethod
    def segments(call: Call, stop: int | None = None) -> list:
        """The call's runs up to ``stop`` (`Call.segments`), the first from the state entering it."""
        return call.segments(call.strategy["initial"], stop)

    def computed(self, call: Call, stop: int | None = None, start: int = 0) -> torch.Tensor:
        """The packed states after tokens ``start .. stop - 1`` (written states not copied in), ``[batch, stop - start, ...]``.

        ``start`` is 0 or where a segment starts (`state_after` computes its last segment only).

        Without autograd written in place into one buffer (`mlstm_states_into`);
        with a graph to keep, or on a one-token call (transformers runs its
        one-step kernel there, whose operations `mlstm_states` repeats, so the
        state equals the cache's bit for bit), the token loop's, concatenated.
        """
        runs = [run for run in self.segments(call, stop) if run[0] >= start]
        served = call.serve_all()
        k, v, i, f = (served[name] for name in GATES[1:])
        if call.seq == 1 or differentiable(k, v, i, f, *(initial for _, _, initial in runs)):
            parts = [mlstm_states(k[:, lo:hi], k[:, lo:hi], v[:, lo:hi], i[:, lo:hi], f[:, lo:hi], initial) for lo, hi, initial in runs]
            return torch.cat(parts, dim=1)
        stop = call.seq if stop is None else stop
        out = empty_states((k.shape[0], stop - start, *call.expected[0][1:]), k.device)
        for lo, hi, initial in runs:
            mlstm_states_into(k[:, lo:hi], v[:, lo:hi], i[:, lo:hi], f[:, lo:hi], initial, out, lo - start)
        return out

    # -- reads ------------------------------------------------------------------------

    def states(self, mixer: Mixer) -> torch.Tensor:
        call = self.record(mixer, "states")
        if not call.writes and recording(call.serve("k")) and call.kernel_waiting():
            return self.tapped(mixer, call)
        # Where the backend would run transformers' own pure-torch kernel: its output computed with the states.
        served = call.serve_all()
        arguments = {name: served[name] for name in GATES}
        arguments.update(state=call.strategy["initial"], eps=mixer.hf_module().config.eps)
        out = one_pass(mixer, call, mixer.OWN_ONE_PASS, arguments, (call.expected[0][0], call.seq, *call.expected[0][1:]))
        if out is not None:
            call.strategy[ONE_PASS_STATES] = out
        out = self.computed(call) if out is None else out
        for t, value in call.writes.items():
            out[:, t] = value
        call.states_read = True
        call.advance(call.seq - 1, "states")
        return out

    def tapped(self, mixer: Mixer, call: Call) -> torch.Tensor:
        """Under autograd: the states as a leaf the layer's output is read through, so ``states.grad`` is the loss's.

        The outputs are recomputed from the states plus a zero `tap` (the
        recurrence), and the backend's own output is replaced by them
        grafted onto its values (`graft`: the same numbers bit for bit), so
        the gradient reaches the tap at every token, through the later tokens
        too, and the call's arguments through the recurrence.
        """
        served = call.serve_all()
        q, k, v, i, f = (served[name] for name in GATES)
        collect = tap((k.shape[0], call.seq, *call.expected[0][1:]), k.float())
        states, h = mlstm_states(q, k, v, i, f, call.strategy["initial"], tap=collect, eps=mixer.hf_module().config.eps)
        output = call.op.output  # the backend has run: its output is what the layer reads on
        mine = h.transpose(1, 2)
        call.op.output = replace_in(output, 0, graft(mine, mine, output[0]))
        call.states_read = True
        call.advance(call.seq - 1, "states")
        with torch.no_grad():  # the leaf's values as without autograd (`states` computes them in place there)
            values = states.detach() if call.seq == 1 else self.computed(call)
        return fill(collect, values)

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        what = f"state_after({t})"
        call = self.record(mixer, what)
        position = call.position(t, what)
        if position in call.writes:
            return call.writes[position]
        lo, hi, initial = self.segments(call, position + 1)[-1]
        served = call.strategy.get(ONE_PASS_STATES)  # the states the one pass wrote (see `states`), or None
        value = (served[:, position] if served is not None else self.computed(call, position + 1, lo)[:, -1]).clone()
        call.advance(position, what)
        call.strategy["read"][position] = value
        return value

    def states_of(self, mixer: Mixer, positions: Any) -> torch.Tensor:
        what = "states_of(positions)"
        call = self.record(mixer, what)
        chosen = call.positions(positions, what)
        if not chosen:
            shape = call.expected[0]
            return torch.empty((shape[0], 0, *shape[1:]), device=call.expected[2])
        last = max(chosen)
        states = self.computed(call, last + 1)
        for t, value in call.writes.items():
            if t <= last:
                states[:, t] = value
        call.advance(last, what)
        return states[:, chosen]

    # -- writes -------------------------------------------------------------------------

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        call = self.record(mixer, what)
        position = call.position(t, what)
        check_expected(what, value, *call.expected)
        if not call.strategy["served"]:
            call.check_first_write(what)  # the first write skips the backend call, so it comes before the call starts
        call.check_write(position, what)
        read = call.strategy["read"].get(position)
        if read is not None and position not in call.writes and not recording(value) and torch.equal(value, read):
            return  # the call already continues from this very state (a target under autograd is still read, for .grad)
        call.writes[position] = value
        result = self.split_result(mixer, call)
        if not call.strategy["served"] and covers_the_batch():
            call.op.skip(result)
        else:
            # Another invoke shares this backend call: let it run, and replace this invoke's rows of its return.
            if not call.strategy["served"]:
                call.op.output
            call.op.output = result
        call.strategy["served"] = True
        call.advance(position, what)

    def split_result(self, mixer: Mixer, call: Call) -> tuple:
        """The call's return with its writes: every part's output, concatenated, and the last part's final state."""
        pieces = [mixer.run_kernel(call, lo, hi, initial) for lo, hi, initial in self.segments(call)]
        final = pieces[-1][1]
        if call.seq - 1 in call.writes:
            final = unpack(call.writes[call.seq - 1])
        return torch.cat([h for h, _ in pieces], dim=2), final

    def state(self, mixer: Mixer) -> torch.Tensor:
        raise NotImplementedError  # the component declares `state` unavailable (no per-token location)


SPLIT_CALL = SplitCall()

__all__ = ["SplitCall", "SPLIT_CALL", "ONE_PASS_STATES"]
