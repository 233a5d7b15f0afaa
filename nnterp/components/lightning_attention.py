"""LightningAttention: MiniMax's lightning attention (MiniMax-01, arXiv:2501.08313; Qin et al., arXiv:2401.04658).

Mental model: linear attention with a fixed decay per head. Per head ``h``, a
state matrix ``S`` of ``[key_dim, value_dim]`` (``key_dim == value_dim ==
head_dim`` here) is multiplied by ``exp(-λ_h)`` every token and adds the
token's ``kᵀv``; the output reads it with the query:

    q, k, v = silu(qkv_proj(x)) split per head
    S_t = exp(-λ_h) S_{t-1} + k_tᵀ v_t       (λ_h: HF's ``slope_rate``, fixed per head and layer)
    o_t = q_t S_t
    out = out_proj(sigmoid(output_gate(x)) * norm(o))

transformers computes it in the mixer's own forward, with no kernel function:
a prompt runs a loop over blocks of ``config.block_size`` tokens (the state
exists only at block ends), a call that continues a cache (a decode step)
loops over its tokens. So this component does not subclass `RecurrentMixer`
(whose values are a kernel call's arguments): it reads the forward's own
operations (found in the installed release's source by name, as
`nnterp.recurrent.labels` does), and serves the state after every token the
``FromArguments`` way, computed from the call's own ``q``, ``k``, ``v`` and
decay by `nnterp.fast.lightning_attention` with the same operations as the decode
branch. Where a prompt's states are read before its block loop, without
autograd, in float32 and on one invoke, the loop's products are skipped and
the outputs computed with the states (`lightning_one_pass`).

Values, in the order the forward makes them (``seq`` is this call's tokens):

* ``attention_queries`` / ``attention_keys`` ``[batch, seq, key_heads,
  key_dim]``, ``attention_values`` ``[batch, seq, mixer_heads, value_dim]``:
  q, k, v after the silu (and the padding mask); a write replaces them before
  the forward uses them (``key_heads == mixer_heads``).
* ``decays`` ``[batch, seq, mixer_heads]``: the log decay ``g = -λ_h`` of every
  token (the same for every token and row); a write makes the call's output
  and final state the recurrence's with the written decays, computed here
  from the call's q, k, v (the forward's own loop runs with its buffers, and
  its result is replaced).
* ``state_input`` ``[batch, mixer_heads, key_dim, value_dim]``: the state
  entering the call (the cache's, ``None`` on a fresh prompt), a copy; a write
  replaces what the forward reads from the cache (on a prompt with a cache the
  forward then takes its token loop, which continues from it).
* ``states`` ``[batch, seq, mixer_heads, key_dim, value_dim]``, ``state_after(t)``,
  ``set_state_after(t, value)``: computed from the call's q, k, v, decays and
  entering state (the last one is the forward's own final state, so
  ``states[:, -1]`` is ``state_output`` bit for bit). A write replaces the outputs of the tokens after ``t`` by the
  recurrence continued from ``value`` (token ``t``'s own output is left as the
  forward computed it) and makes ``value``'s continuation the call's final
  state (written into the forward's own final-state tensor, which the cache holds).
* ``effective_attention`` ``[batch, mixer_heads, seq, seq]`` and
  ``state_input_readout`` ``[batch, seq, mixer_heads, value_dim]``: ``o_t =
  Σ_s A[t, s] v_s + readout_t`` exactly, before the norm and the gate.
* ``state_output``: the state after the call's last token (the forward's
  return, which the cache holds); a write replaces both.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output;
  ``kernel_output()`` ``[batch, seq, mixer_heads, value_dim]``, its output
  before the norm and the gate (where the forward concatenates it).

Under autograd (a trace outside ``torch.no_grad()``), ``states`` is a tap and
``decays`` a graft, as on the other mixers (`nnterp.recurrent.gradients`): an
exact zero that depends on them is added to the output before the norm, so
``states.grad[:, t]`` is the loss's derivative by the state after ``t`` as the
tokens after ``t`` read it, and ``decays.grad`` the derivative by the decays;
q, k, v are the forward's own tensors. Values and logits are unchanged bit for
bit. Reading ``states`` or ``decays`` then moves the worker to that point of the
forward, so writes to the call come before them.

``state`` (under ``tracer.iter``), ``betas`` and the convolution windows are
`Unavailable`, each with its reason. A state is in the model's dtype, as
transformers keeps it (float32 on a float32 model).

Failure mode worth knowing: a worker reads in the order the model runs. The
call's q, k, v are read where the forward splits them, so a write to them,
to ``decays``, ``state_input`` or ``set_state_after`` comes before
``state_output`` / ``attention_output`` of the same call; ``OrderError`` says
which read came first.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..core import indices
from ..core.calls import mediator, pinned
from ..core.dims import ConvState, Gates, Hidden, Queries, State, States, Values
from ..core.errors import OrderError, SignatureError, Unavailable
from ..core.standard import Standard
from ..core.values import DerivedEProperty, check_expected, module_output
from ..fast.lightning_attention import lightning_attention, lightning_tap_readout
from ..recurrent.call import Call, order_hint
from ..recurrent.gradient_support import gradient_reasons
from ..recurrent.gradients import fill, recording, tap
from . import lightning_one_pass
from . import lightning_run as calls
from .lightning_run import Run
from .recurrent import EffectiveAttention

NO_ITERATION = (
    "lightning attention's prompt computes its state once per block of config.block_size tokens (no location "
    "binds it once per token for tracer.iter): read states / state_after(t) and write set_state_after(t, value), "
    "computed from the call's q, k, v and decay; on a decode step, state_output is the state after its token"
)
NO_BETA = "lightning attention has no write strength β: each token adds k_tᵀ v_t to the state unscaled"
NO_CONV = "lightning attention has no short convolution, so no convolution window"
_NO_CACHE = "this call runs without a cache, so the forward reads no entering state: run it with use_cache=True"


class LightningAttention(Standard):
    """A lightning attention block (``layer.linear_attn``): see the module docstring for its values."""

    KIND = "linear_attn"
    #: What `RecurrentMixer` declares, for code that asks any mixer: no kernel function to route, no fast
    #: path setting (the states are computed from the call's arguments already), no chunked scan.
    CHUNK_FUNCTION = ""
    RECURRENT_FUNCTION = ""
    CONV_FUNCTIONS: tuple = ()
    FAST = None
    CHUNKED_SCAN = False
    ONE_STEP_DECODE = False
    #: The forward returns its final state with or without a cache, so `state_output` is served without one.
    FINAL_STATE_WITHOUT_CACHE = True
    #: Its states are always computed from the call's own q, k, v and decays (as the fast path's are), so a read
    #: after the forward has run (state_output first) is still served.
    STATES_FROM_ARGUMENTS = True
    #: Values no gradient of the model's outputs reaches (`gradient_support`), beyond the shared ones.
    GRADIENTLESS = {
        "state_output": (
            "a prompt's final state goes only to the cache (the block loop computed the outputs before it), so no "
            "gradient of this call's outputs reaches it: states.grad[:, t] is the derivative by the state after t"
        ),
    }

    def labels(self) -> dict:
        """This release's labels in the wrapped HF mixer's forward (found once per class)."""
        return calls.labels_of(type(self._module))

    def _op(self, name: str) -> Any:
        return getattr(self.source, self.labels()[name])

    def _at(self, name: str) -> str:
        return f"{self._op(name).path}.output"

    def dims(self) -> dict[str, int]:
        module = self._module
        heads, dim = module.num_attention_heads, module.head_dim
        return {"key_heads": heads, "mixer_heads": heads, "key_dim": dim, "value_dim": dim}

    # -- the call's record and the writes that recompute it (lightning_run.py) ----------

    _run = calls.record
    _passed = calls.passed
    _before = calls.before
    _position = calls.position
    _segments = calls.segments
    _scan = calls.scan
    _scan_with = calls.scan_with
    _forward_final = calls.forward_final
    _graft = calls.graft
    _rewrite = calls.rewrite

    # -- q, k, v and the decays ------------------------------------------------------

    def _qkv(self, index: int) -> torch.Tensor:
        return (self._run().q, self._run().k, self._run().v)[index]

    def _write_qkv(self, index: int, value: Any) -> None:
        run = self._run()
        name = ("attention_queries", "attention_keys", "attention_values")[index]
        what = f"`linear_attn.{name}`"
        current = (run.q, run.k, run.v)
        check_expected(what, value, tuple(current[index].shape), current[index].dtype, current[index].device)
        self._before(run, "split", f"a write to {what}", "the forward had used q, k and v")
        written = tuple(value if i == index else x for i, x in enumerate(current))
        run.q, run.k, run.v = written
        with pinned(run.first["split"]):
            Mediator.swap(self._at("split"), written)

    def _read_decays(self) -> torch.Tensor:
        run = self._run()
        if run.g_leaf is not None:
            return run.g_leaf
        if not recording(run.q) or run.writes or run.decays_written or self._passed(run, "cat", run.first["cat"]):
            return run.g
        # Under autograd the forward never reads the decays (it reads its buffers): the call's output before the
        # norm gets an exact zero that depends on them (the recurrence with them, minus itself detached).
        leaf = run.g.detach().clone().requires_grad_(True)
        rebuilt = self._scan_with(run, leaf)
        self._graft(run, rebuilt - rebuilt.detach())
        run.g_leaf = leaf
        return leaf

    def _write_decays(self, value: Any) -> None:
        run = self._run()
        check_expected("`linear_attn.decays`", value, tuple(run.g.shape), run.g.dtype, run.g.device)
        if torch.equal(value, run.g):
            return  # the forward's own decays: its own loop already computes the call with them
        run.g = value
        run.decays_written = True
        self._rewrite(run, "a write to `linear_attn.decays`")

    # -- the state entering and leaving the call ------------------------------------

    def _state_shape(self, run: Run) -> tuple:
        dims = self.dims()
        return (run.q.shape[0], dims["mixer_heads"], dims["key_dim"], dims["value_dim"])

    def _state_input(self) -> torch.Tensor | None:
        run = self._run()
        return run.initial.clone() if run.initial is not None else None

    def _write_state_input(self, value: Any) -> None:
        run = self._run()
        what = "`linear_attn.state_input`"
        check_expected(what, value, self._state_shape(run), run.q.dtype, run.q.device)
        if run.cache is None:
            raise Unavailable("linear_attn.state_input", _NO_CACHE)
        self._before(run, "get", f"a write to {what}", "the forward had read the cache")
        if run.writes or run.decays_written:
            raise OrderError(order_hint(f"a write to {what}", "a write inside the call"))
        with pinned(run.first["get"]):
            self._op("get").output
        with pinned(run.first["get"]):
            Mediator.swap(self._at("get"), value)
        run.initial, run.continues = value, True

    def _state_output(self) -> torch.Tensor:
        return self._output()[1]

    def _output(self) -> tuple:
        with pinned(self._run().first["output"]):
            return Mediator.value(f"{self.path}.output")

    def _write_state_output(self, value: Any) -> None:
        run = self._run()
        what = "`linear_attn.state_output`"
        output = self._output()
        check_expected(what, value, tuple(output[1].shape), output[1].dtype, output[1].device)
        if run.cache is not None:
            # The forward has stored its final state in the cache: the next call reads this one.
            run.cache.set_linear_cache(self._module.layer_idx, value)
        with pinned(run.first["output"]):
            Mediator.swap(f"{self.path}.output", (output[0], value, *output[2:]))

    # -- the state after every token, from the call's q, k, v and decays -----------------

    def _states(self) -> torch.Tensor:
        run = self._run()
        tapped = recording(run.q) and not run.writes and not run.decays_written and not self._passed(run, "cat", run.first["cat"])
        out = None if tapped else lightning_one_pass.states(self, run)  # the block loop skipped, where it applies
        if out is None:
            with torch.no_grad() if tapped else nullcontext():  # a tap's values are detached: as without autograd
                out = calls.computed_states(self, run)
        for t, value in run.writes.items():
            out[:, t] = value
        if not run.writes and not run.decays_written:
            # The last one is the forward's own (blockwise, so equal to float rounding): state_output bit for bit.
            final = self._forward_final(run)
            if final is not None:
                out[:, -1] = final
        run.states_read = True
        run.furthest = run.seq - 1
        if tapped:
            # A tap: a leaf holding the states, read by the later tokens' outputs through an exact zero, so its
            # gradient at t is the loss's derivative by the state after t as the tokens after t read it.
            leaf = fill(tap(tuple(out.shape), out), out.detach())
            g = run.g_leaf.detach() if run.g_leaf is not None else run.g.detach()
            read = lightning_tap_readout(run.q.detach(), g, leaf)
            self._graft(run, (read - lightning_tap_readout(run.q.detach(), g, leaf.detach())).transpose(1, 2))
            return leaf
        return out

    def state_after(self, t: int) -> torch.Tensor:
        """The state after token ``t`` of this call (negative ``t`` counts from the end), from its q, k, v and decays."""
        mediator("`linear_attn.state_after`")
        run = self._run()
        position = self._position(run, t, f"state_after({t})")
        if position in run.writes:
            return run.writes[position]
        lo, hi, initial = self._segments(run, position + 1)[-1]
        run.furthest = max(run.furthest, position)
        state = calls.state_at(self, run, lo, hi, initial)
        run.read[position] = state
        return state

    states_of = calls.states_of

    def gradients(self) -> dict[str, str | None]:
        """Per value, ``None`` where its ``.grad`` is served now, else why not (``support()``'s ``.grad`` rows)."""
        return gradient_reasons(self)

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """Assign the state after token ``t``: the tokens after it continue from ``value``.

        Token ``t``'s own output stays as the forward computed it; the outputs
        of the tokens after it, and the call's final state (the cache's), are
        the recurrence continued from ``value``, as when a cache holding the
        prefix's state is replaced and the rest is fed one token at a time.
        Writes in increasing positions, before ``state_output`` and
        ``attention_output`` of the call; ``states`` only before them.
        """
        what = f"set_state_after({t}, value)"
        mediator(f"`linear_attn.{what}`")
        run = self._run()
        position = self._position(run, t, what)
        check_expected(what, value, self._state_shape(run), run.q.dtype, run.q.device)
        Call.check_write_order(what, position, run.states_read, (run.furthest, f"a read of token {run.furthest}"), run.writes)
        read = run.read.get(position)
        if read is not None and not run.writes and not run.decays_written and not value.requires_grad and torch.equal(value, read):
            return  # writing back the state this call computes: the call already continues from it, bit for bit
            # (a target that requires grad is written all the same, so the later tokens read it and it gets one)
        run.writes[position] = value
        self._rewrite(run, what)

    # -- effective attention -------------------------------------------------------

    def _effective(self) -> tuple:
        run = self._run()
        if run.writes:
            raise OrderError("`linear_attn.effective_attention` is the call's own: read it before set_state_after")
        return lightning_attention(run.q, run.k, run.g, run.initial)

    def kernel_output(self) -> torch.Tensor:
        """The call's output before the norm and the gate, ``[batch, seq, mixer_heads, value_dim]``, read where the
        forward concatenates it: what ``Σ_s effective_attention[t, s] attention_values[s]`` (+ the readout) reproduces."""
        mediator("`linear_attn.kernel_output`")
        run = self._run()
        with pinned(run.first["cat"]):
            return self._op("cat").output.transpose(1, 2)

    def effective_attention_of(self, positions: Any = None, heads: Any = None, channels: Any = None) -> torch.Tensor:
        """Rows ``positions`` of `effective_attention`, for some ``heads`` only: ``[batch, len(heads), len(positions), seq]``.

        ``positions``, ``heads``: ``None`` (all), an int, a slice, a range, a
        list or a tensor of indices (negative ones count from the end),
        checked as ``states_of`` checks its positions (`nnterp.core.indices`).
        Computed whole, then selected (``4 · batch · heads · seq²`` bytes).
        """
        mediator("`linear_attn.effective_attention_of`")
        if channels is not None:
            raise SignatureError("`linear_attn.effective_attention_of`: lightning attention has one pattern per head: pass heads=, not channels=")
        what = "linear_attn.effective_attention_of"
        A = self._effective()[0]
        picked = indices.selection(heads, A.shape[1], what, "head", f"the mixer's {A.shape[1]} heads")
        rows = indices.selection(positions, A.shape[2], what, "position")
        return A[:, slice(None) if picked is None else picked][:, :, slice(None) if rows is None else rows]

    # -- values ----------------------------------------------------------------------

    attention_queries = DerivedEProperty(
        lambda envoy: envoy._qkv(0), assign=lambda envoy, value: envoy._write_qkv(0, value),
        description="the queries q after the silu, [batch, seq, key_heads, key_dim]", annotation=Queries,
    )
    attention_keys = DerivedEProperty(
        lambda envoy: envoy._qkv(1), assign=lambda envoy, value: envoy._write_qkv(1, value),
        description="the keys k after the silu, [batch, seq, key_heads, key_dim]", annotation=Queries,
    )
    attention_values = DerivedEProperty(
        lambda envoy: envoy._qkv(2), assign=lambda envoy, value: envoy._write_qkv(2, value),
        description="the values v after the silu, [batch, seq, mixer_heads, value_dim]", annotation=Values,
    )
    betas = DerivedEProperty(
        lambda envoy: None, description="a write strength β (none here)", unavailable=lambda envoy: NO_BETA, annotation=Gates,
    )
    decays = DerivedEProperty(
        _read_decays, assign=_write_decays,
        description="the log decay g = -λ_h of every token (the state is multiplied by exp(g)), [batch, seq, mixer_heads]",
        annotation=Gates,
    )
    state_input = DerivedEProperty(
        _state_input, assign=_write_state_input,
        description="the state entering this call (None on a fresh prompt), a copy; assign to continue from another",
        annotation=State, none_on_fresh_prompt=True,
    )
    state = DerivedEProperty(
        lambda envoy: None, assign=lambda envoy, value: None, description="the state after a token under tracer.iter",
        unavailable=lambda envoy: NO_ITERATION, annotation=State,
    )
    states = DerivedEProperty(
        _states, description="the state after every token of this call, from its q, k, v and decays", annotation=States,
    )
    effective_attention = DerivedEProperty(
        lambda envoy: envoy._effective()[0],
        description=(
            "the exact effective attention A[t, s] = (q_t . k_s) exp(g (t - s)): the output at t before the norm is "
            "sum_s A[t, s] * attention_values[s] (+ state_input_readout), [batch, mixer_heads, seq, seq], float32"
        ),
        annotation=EffectiveAttention,
    )
    state_input_readout = DerivedEProperty(
        lambda envoy: envoy._effective()[1],
        description="the part of the output before the norm read from the entering state, [batch, seq, mixer_heads, value_dim]",
        annotation=Values, none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        _state_output, assign=_write_state_output,
        description="the state after this call's last token, [batch, mixer_heads, key_dim, value_dim]", annotation=State,
    )
    conv_state_input = DerivedEProperty(
        lambda envoy: None, description="a convolution window (none here)", unavailable=lambda envoy: NO_CONV, annotation=ConvState,
    )
    conv_state_output = DerivedEProperty(
        lambda envoy: None, description="a convolution window (none here)", unavailable=lambda envoy: NO_CONV, annotation=ConvState,
    )
    attention_output = module_output("the mixer's output, [batch, seq, hidden]", Hidden)
