"""`FromArguments`, the fast path: per-token states and mid-prompt writes from the kernel call's own arguments.

Mental model. A prompt reaches a recurrent mixer's state through one kernel
call, ``kernel(q, k, v, g=…, beta=…, initial_state=…)``. This strategy reads
only the call's *arguments* (``mix.source.<CHUNK_KERNEL>.inputs``), which are
the call's own whatever function is bound (the chunk kernel, the loop,
flash-linear-attention), by the names of the component's signature table,
and:

* ``states`` computes every state from them with `nnterp.fast` (the
  component's ``FAST`` spec) into one buffer. Where the call would run
  transformers' pure-torch kernel without autograd, on inputs of a dtype the
  spec's ``one_pass`` takes (float32; the delta rule's any, its body computing
  in float32), the pass computes the kernel's output with the states and the
  kernel call is skipped with it (one pass instead of the kernel plus a
  second pass over its arguments: `ONE_PASS`); otherwise (an optimized kernel
  bound, Mamba in another dtype, autograd, another invoke sharing the call) the kernel
  runs as it would and the states are a second pass;
* ``state_after(t)`` runs the bound kernel on the tokens up to ``t`` (from the
  call's own entering state) and returns its final state (after a one pass, while
  the reader still holds its states, their entry);
* ``states_of(positions)`` computes the states with the same spec, a block of
  `SELECTION_BLOCK` tokens at a time, up to the last selected position only,
  keeping the selected ones: memory is the selection plus one block;
* ``set_state_after(t, value)`` splits the call at ``t``: the bound kernel runs
  on ``[:t+1]`` and on ``[t+1:]`` from ``value`` (on Mamba, where the pure-torch
  kernel would run without autograd, the spec's ``one_pass`` with two slots
  for states runs instead: it is the cheaper of the two; ``state_after(t)`` alike), and the call is skipped with
  ``(both outputs concatenated, the second's final state)``, so token ``t``
  keeps its own readout and the rest continue from ``value``. Later writes in
  the same call re-split and replace the output. When another invoke shares
  the call (a skip must cover every row), the kernel runs and this invoke's
  rows of its output are replaced instead. A kernel that takes no initial
  state (Mamba-1's, which always starts from zeros) runs the second part from
  zeros, and the spec's ``resume`` adds what ``value`` contributes (exact: the
  recurrence is linear in its start state, `nnterp.fast.selective_scan`).

On a one-token decode step, ``states`` is the step's new state
(``state_output``) and ``set_state_after(0, v)`` replaces it.

A kind whose call is not that shape declares hooks (`Mixer`), never a branch
here: its spec's own arguments (``fast_arguments``), its own run of a part
(``run_kernel``: lightning attention, whose record is its forward's own
operations, `nnterp.recurrent.forward_call`, and the short convolution), where
the state it leaves goes when its kernel returns none (``FINAL_STATE``
``None``, ``leave_state``). The record ends the call (`Call.skip`,
`Call.replace`, which keeps the outputs of `Call.kept` tokens).

Differences from the routed path, all deliberate: states equal it within
float32 rounding, not bit for bit, in a bfloat16 model too (`nnterp.fast.state_space`:
Mamba-2's time step is rounded as the kernel rounds it); under autograd they
are a function of the kernel's arguments (a loss on them reaches the
arguments), but the kernel never reads them, so a loss on the model's output
has no gradient by them (route, or ``chunk_per_token`` on Mamba-2, for that;
``set_state_after`` targets do get one, the split kernel reads them), except
where the states are tapped (a spec's ``tap``: lightning attention, the mLSTM,
the short convolution): read under autograd before the kernel runs, they are
then a leaf the call's output reads through an exact zero, added once per call
(a second read gets the same leaf), and ``states.grad`` is the loss's derivative
by them; a read after a write in the same call is allowed and sees the write. ``state`` under ``tracer.iter`` is not served here (there
is no per-token location): it stays the component's own strategy.
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Any

import torch

from ...core.calls import mediator
from ...core.errors import Unavailable
from ...core.values import check_expected, replace_in
from ...fast.buffers import empty_states
from ..arguments import cut
from ..call import Call
from ..gradients import fill, recording, records_any, tap
from ..kernels import runs_pure_torch
from ..settings import states_dtype
from .protocol import Mixer, PerToken

#: Tokens whose states `FromArguments.states_of` computes at once (its memory beyond the selection).
SELECTION_BLOCK = 64
#: Where `FromArguments.states` keeps a weak reference to the states a one pass filled, for `state_after`: the reader's
#: hold keeps them, never the record's (which lives to the run's end: every layer's states at once, unsaved ones too).
ONE_PASS_STATES = "one_pass"
#: Whether ``states`` computes a pure-torch kernel's output with the states and skips the call (measured faster
#: on every kind that has a one pass: docs/performance.md times both), on every kind (`one_pass`: the fast path's,
#: the mLSTM's backend too; RWKV-4's token loop). ``False``: the kernel runs, then a second pass.
ONE_PASS = True


class FromArguments(PerToken):
    """Computes states from the kernel call's arguments (`nnterp.fast`) and writes by splitting the call."""

    name = "from the kernel call's arguments"

    def unavailable(self, mixer: Mixer) -> str | None:
        return f"{type(mixer).__name__} has no fast path" if type(mixer).FAST is None else None

    def record(self, mixer: Mixer, what: str) -> Call:
        """This call's record, with its prompt kernel's arguments by name (once per call)."""
        reason = self.unavailable(mixer)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")
        call = mixer.record()
        if not call.decodes and "named" not in call.strategy:
            # Tokens first (the layouts applied), as the spec takes them (the prompt kernel's table: not decoding), or
            # as the kind hands them to its spec (`Mixer.fast_arguments`: the short convolution's input and window),
            # with the module's constants the spec reads beside them (the mLSTM backend's eps).
            paths = type(mixer).FAST_CONSTANTS
            constants = {name: attrgetter(path)(mixer.hf_module()) for name, path in paths.items()} if paths else {}
            own = type(mixer).fast_arguments
            arguments = {**(call.serve_all() if own is None else mixer.fast_arguments(call)), **constants}
            # The entering state as one of the spec's own states, a copy: a continued cache's buffer, which the cache
            # overwrites after the kernel returns. Every run of the call starts from one of those (`piece`, `arguments.cut`).
            entering = type(mixer).FAST.entering_state(arguments)
            call.strategy.update(named=arguments, entering=None if entering is None else entering.clone(), served=False)
        return call

    @staticmethod
    def segments(call: Call, stop: int | None = None) -> list:
        """The call's runs up to ``stop`` (`Call.segments`), the first from the state entering it."""
        return call.segments(call.strategy["entering"], stop)

    @staticmethod
    def piece(spec: Any, arguments: dict, lo: int, hi: int, initial: Any) -> dict:
        """Named, tokens-first ``arguments`` cut to tokens ``[lo, hi)``, started from ``initial`` (spec's `starting`)."""
        cut = {name: (x[:, lo:hi] if name in spec.tokens and isinstance(x, torch.Tensor) else x) for name, x in arguments.items()}
        return {**cut, **(spec.starting(initial) if spec.starting is not None else {"state": initial})}

    def _run_kernel(self, mixer: Mixer, call: Call, lo: int, hi: int, initial: Any, final: bool) -> Any:
        """The bound kernel (whatever it is) on tokens ``[lo, hi)`` of the call, from ``initial``."""
        cls = type(mixer)
        if cls.run_kernel is not None:
            return mixer.run_kernel(call, lo, hi, initial)  # the kind runs a part its own way (`Mixer.run_kernel`)
        if ONE_PASS and cls.FAST.ring and runs_pure_torch(mixer) and not recording(initial):
            arguments = self.piece(cls.FAST, call.strategy["named"], lo, hi, initial)
            if not torch.is_grad_enabled() or not any(recording(x) for x in arguments.values()):  # (asked once when off)
                # transformers' torch kernel is slower than this pass (a token loop, a chunk scan); two slots keep
                # the last state only.
                shape = cls.FAST.state_shape(arguments)
                with torch.no_grad():
                    done = cls.FAST.one_pass({**arguments, "final": final}, torch.empty((shape[0], 2, *shape[1:]), device=call.expected[2]))
                if done is not None:
                    return done[0]
        args, kwargs = cut(cls.CHUNK_ARGUMENTS, cls.FAST, call.arguments, lo, hi, initial, final)
        result = mixer.kernel_function()(*args, **kwargs)
        if initial is not None and "state" not in cls.CHUNK_ARGUMENTS:
            # The kernel started from zeros: add what the start state contributes to its output and final state.
            result = cls.FAST.resume(self.piece(cls.FAST, call.strategy["named"], lo, hi, None), initial, result)
        return result

    def _buffer(self, shape: tuple, device: Any, differentiable: bool, dtype: Any = torch.float32) -> torch.Tensor:
        """Where states are written: the reused pool (`nnterp.fast.buffers`), or a fresh tensor under autograd."""
        return torch.empty(shape, device=device, dtype=dtype) if differentiable else empty_states(shape, device, dtype)

    # -- reads ------------------------------------------------------------------------

    def states(self, mixer: Mixer) -> torch.Tensor:
        call = self.record(mixer, "states")
        if call.decodes:
            return mixer.read_state_output()[:, None]
        if "tap" in call.strategy:
            return call.strategy["tap"]  # read again: the same leaf, its zero added to the output once
        spec = type(mixer).FAST
        arguments = call.strategy["named"]
        shape = spec.state_shape(arguments)
        differentiable = records_any(arguments.values())
        # A spec with a tap, read before its call runs unchanged: the states are a leaf the call's output reads through
        # an exact zero (`tapped`), so a loss on the model's output reaches them; computed as without autograd.
        tapped = differentiable and spec.tap is not None and not call.writes and not call.strategy["served"] and call.kernel_waiting()
        differentiable = differentiable and not tapped
        # Without autograd, into the reused buffer with no graph; with it, into a fresh tensor, as a function of the
        # arguments (a loss on the states reaches them). The kernel never reads these states, so no later loss does.
        out = self._buffer((shape[0], call.seq, *shape[1:]), call.expected[2], differentiable, states_dtype(mixer))
        done = one_pass(mixer, call, spec.one_pass, arguments, out) if not differentiable else None
        if done is not None and out.dtype == torch.float32:
            call.strategy[ONE_PASS_STATES] = weakref.ref(out)  # the call was skipped: `state_after` reads these if kept
        with torch.enable_grad() if differentiable else torch.no_grad():
            for lo, hi, initial in self.segments(call) if done is None else ():
                spec.compute(self.piece(spec, arguments, lo, hi, initial), out[:, lo:hi])
        for t, value in call.writes.items():
            out[:, t] = value
        final = None if call.writes or call.strategy["served"] else call.own_final()
        if final is not None:
            out[:, -1] = final  # the call's own last state (lightning's forward's): state_output bit for bit
        call.states_read = True
        call.advance(call.seq - 1, "states")
        return self.tapped(call, spec, arguments, out) if tapped else out

    @staticmethod
    def tapped(call: Call, spec: Any, arguments: dict, out: torch.Tensor) -> torch.Tensor:
        """``out`` as a zero leaf filled with the states (`gradients.tap`), its readout by the later tokens (the spec's
        ``tap``: an exact zero) added to the call's output: ``.grad[:, t]`` is the loss's by the state after ``t``."""
        leaf = fill(tap(tuple(out.shape), out), out.detach())
        # The record adds the zero to the output the forward goes on with (`ForwardCall.graft`), or to its kernel's
        # return, on the call's tokens (`Call.graft`: the short convolution's output also holds its window's).
        call.graft(spec.tap(arguments, leaf))
        call.strategy["tap"] = leaf
        return leaf

    def state_after(self, mixer: Mixer, t: int) -> torch.Tensor:
        what = f"state_after({t})"
        call = self.record(mixer, what)
        position = call.position(t, what)
        if call.decodes:
            return mixer.read_state_output()
        if position in call.writes:
            return call.writes[position]
        kept, spec = call.strategy.get(ONE_PASS_STATES, lambda: None)(), type(mixer).FAST
        if kept is not None:
            final = kept[:, position].clone()  # a copy: the buffer is the reused pool's
        else:
            lo, hi, initial = self.segments(call, position + 1)[-1]
            if spec.final_state is not None or type(mixer).FINAL_STATE is None:
                final = self._last_state(mixer, call, lo, hi, initial)  # no kernel to run on a part, or no final state
            else:
                final = self._run_kernel(mixer, call, lo, hi, initial, True)[type(mixer).FINAL_STATE]
            if spec.leaving is not None:
                final = spec.leaving(final)  # the kernel's own format (RWKV-4's triple) as one of the states
        call.advance(position, what)
        call.strategy.setdefault("read", {})[position] = final
        return final

    def states_of(self, mixer: Mixer, positions: Any) -> torch.Tensor:
        what = "states_of(positions)"
        call = self.record(mixer, "states_of")
        chosen = call.positions(positions, what)
        if call.decodes:
            return mixer.read_state_output()[:, None][:, [0] * len(chosen)]  # the step's one token
        spec = type(mixer).FAST
        arguments = call.strategy["named"]
        shape = spec.state_shape(arguments)
        found = {p: call.writes[p] for p in chosen if p in call.writes}
        wanted = sorted(set(chosen) - set(found))
        differentiable = records_any(arguments.values())
        span = wanted[-1] + 1 if wanted else 0
        # The blocks stay float32 (each carries the next one's start); a kept state is rounded once, when kept.
        dtype = states_dtype(mixer)
        with torch.enable_grad() if differentiable else torch.no_grad():
            # Blocks of tokens up to the last wanted position, each from the state the previous one ended with.
            buffer = None
            for lo, hi, initial in self.segments(call, span):
                for at in range(lo, hi, SELECTION_BLOCK):
                    stop = min(hi, at + SELECTION_BLOCK)
                    if buffer is None or differentiable:  # under autograd a block is kept by the graph: never reused
                        buffer = self._buffer((shape[0], min(SELECTION_BLOCK, span), *shape[1:]), call.expected[2], differentiable)
                    block = buffer[:, : stop - at]
                    spec.compute(self.piece(spec, arguments, at, stop, initial), block)
                    found.update((p, block[:, p - at].to(dtype, copy=True)) for p in wanted if at <= p < stop)
                    initial = block[:, -1].clone()
        call.advance(max(chosen, default=0), what)
        if not chosen:
            return torch.empty((shape[0], 0, *shape[1:]), device=call.expected[2], dtype=dtype)
        return torch.stack([found[p].to(dtype) for p in chosen], 1)

    # -- writes -------------------------------------------------------------------------

    def set_state_after(self, mixer: Mixer, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        call = self.record(mixer, what)
        position = call.position(t, what)
        check_expected(what, value, *call.expected)
        if call.decodes:
            return mixer.write_state_output(value)
        if not call.strategy["served"]:
            call.check_first_write(what)  # the first write skips the kernel call, so it comes before the call starts
        # A read of this very position (read-modify-write) stays valid: the split leaves tokens up to it as computed.
        call.check_write(position, what)
        read = call.strategy.get("read", {}).get(position)
        if read is not None and position not in call.writes and not recording(value) and torch.equal(value, read):
            # Writing back the state this call computes: the call already continues from it, bit for bit. Not under
            # autograd: a target's .grad needs the tokens after it to read the target itself.
            return
        call.writes[position] = value
        self._serve(mixer, call)

    def state_input(self, mixer: Mixer) -> torch.Tensor | None:
        """The state a prompt's call starts from where its kernel takes none: `set_state_input`'s (a copy), else
        ``None`` (zeros)."""
        entering = self.record(mixer, "state_input").strategy["entering"]
        return None if entering is None else entering.clone()

    def set_state_input(self, mixer: Mixer, value: torch.Tensor) -> None:
        """Start a prompt's call from ``value``, where its kernel takes no initial state (Mamba-1's): the call is
        served as a write's split is, its one run from ``value`` (the kernel from zeros, then the spec's ``resume``
        adds what ``value`` contributes), so every later read and write of the call continues from it."""
        what = "a write to `linear_attn.state_input`"
        call = self.record(mixer, "state_input")
        check_expected(what, value, *call.expected)
        call.check_first_write(what)
        call.check_write_order(what, -1, call.states_read, call.furthest, call.writes)  # before every token
        call.strategy["named"]["state"] = value
        call.strategy["entering"] = value  # where every run of the call starts (`segments`)
        self._serve(mixer, call)

    def assign_argument(self, mixer: Mixer, name: str, value: Any) -> None:
        """Replace argument ``name`` of a call whose source does not read it as served (lightning's ``decays``: its
        forward reads its own buffers): the record keeps it (`Call.assign`) and the call is served as a write's split
        is, every run from the written arguments."""
        what = f"a write to `linear_attn.{name}`"
        call = self.record(mixer, what)
        call.check_open(what)
        call.assign(name, value)
        call.strategy["named"][name] = call.serve(name)
        self._serve(mixer, call)

    def _serve(self, mixer: Mixer, call: Call) -> None:
        """Make the call return what its writes make of it: the kernel call skipped with it, or, where another
        invoke shares the call (a skip must cover every row, and the others may not write), the kernel run and
        this invoke's rows of its output replaced."""
        result = self._split_result(mixer, call)
        if not call.strategy["served"] and covers_the_batch():
            call.skip(result)
        else:
            call.replace(result, waits=not call.strategy["served"])
        call.strategy["served"] = True

    def _last_state(self, mixer: Mixer, call: Call, lo: int, hi: int, initial: Any) -> torch.Tensor:
        """The state after token ``hi - 1`` of the run ``[lo, hi)`` from ``initial``, by the spec: for a kernel whose
        return holds no final state (``FINAL_STATE`` is ``None``), or a source with no kernel to run on a part."""
        spec = type(mixer).FAST
        arguments = self.piece(spec, call.strategy["named"], lo, hi, initial)
        # The spec's own where it has one (lightning's: as `states` computes it, the others not kept).
        return spec.final_state(arguments) if spec.final_state is not None else spec.compute(arguments, None)[:, -1].clone()

    def _split_result(self, mixer: Mixer, call: Call) -> Any:
        """What the call returns with its writes: the segments' outputs, and the final state."""
        flag = bool(call.strategy["named"].get("final") or False)
        runs = self.segments(call)
        while len(runs) > 1 and runs[0][1] <= call.kept:
            # A run wholly within `Call.kept` keeps the call source's own outputs (lightning's forward runs its loop
            # anyway): not recomputed; the last run always is (it gives the final state).
            runs = runs[1:]
        results = [self._run_kernel(mixer, call, lo, hi, initial, flag) for lo, hi, initial in runs]
        axis = type(mixer).FAST.output_axis
        if type(mixer).FINAL_STATE is None:
            # The forward keeps the state the call leaves itself (LFM2 caches its window before the kernel runs): the
            # write on the last token, or the last run's, goes there (`Mixer.leave_state`).
            last = call.writes.get(call.seq - 1)
            mixer.leave_state(call, self._last_state(mixer, call, *runs[-1]) if last is None else last)
        if not isinstance(results[-1], tuple):
            return torch.cat(results, dim=axis)  # a kernel returning its output only (no final state asked)
        result = replace_in(tuple(results[-1]), 0, torch.cat([r[0] for r in results], dim=axis))
        index = type(mixer).FINAL_STATE
        if "final" in type(mixer).CHUNK_ARGUMENTS and not flag:
            # The call asked for no final state (no cache): none, though a part continued from a written one (RWKV-4's
            # kernel returns one whenever it is given one, and the forward would store it in a cache it lacks).
            return replace_in(result, index, None)
        if call.seq - 1 in call.writes and result[index] is not None:
            result = replace_in(result, index, type(mixer).FAST.returned_state(call.writes[call.seq - 1]))
        return result

    def state(self, mixer: Mixer) -> torch.Tensor:
        raise Unavailable("linear_attn.state", "the fast path has no per-token location for tracer.iter")

    set_state = state  # type: ignore[assignment]


def covers_the_batch() -> bool:
    """Whether this worker's rows are the whole batch (one invoke), so its write may skip the kernel call."""
    med = mediator()
    batcher = getattr(med.interleaver, "batcher", None)
    group = med.batch_group
    return group is None or batcher is None or (group[0] == 0 and group[1] == batcher.total)


def one_pass(mixer: Mixer, call: Call, run: Any, arguments: dict, out: Any) -> torch.Tensor | None:
    """The one one-pass switch: the states of ``call`` computed with its kernel's output, the call skipped with it.

    ``run(arguments, out)`` is the kind's one pass (a `FastSpec`'s ``one_pass``, or a mixer's own
    ``OWN_ONE_PASS``): the kernel's own return and the states, ``(result, states)``, from ``arguments`` (its
    named arguments, tokens first, ``"state"`` the entering one), or ``None`` where it would not equal the
    kernel's pure-torch body (another dtype; a one-token call, for a kind whose step kernel the cache keeps).
    ``out`` is the states' buffer, or its shape (allocated from the reused pool once the pass applies). It
    applies, and this returns the states, when `ONE_PASS` is on, the call has no write and was not served yet,
    its kernel has not started (a value read earlier needed it), one invoke covers the batch, no argument is
    recorded by autograd, and the mixer's kernel is the pure-torch body the pass replaces
    (``mixer.pure_torch_kernel()``: an optimized kernel's output is what the run must get); else ``None``.
    """
    if not ONE_PASS or run is None or call.writes or call.strategy.get("served") or not covers_the_batch():
        return None
    if not call.kernel_waiting() or records_any(arguments.values()) or not mixer.pure_torch_kernel():
        return None
    if not isinstance(out, torch.Tensor):
        out = empty_states(tuple(out), call.expected[2])
    with torch.no_grad():
        done = run(arguments, out)
    if done is None:
        return None
    call.skip(done[0])
    call.strategy["served"] = True
    return done[1]



FROM_ARGUMENTS = FromArguments()
