"""Interventions at the recurrence: knock out what token ``s`` carries to token ``t``, and steer the state itself.

Mental model. Given everything but the values (queries, keys, decays, write
strengths, gates), a recurrent mixer's kernel output is linear in the values it
is fed (`nnterp.fast.spec`, effective attention):

    out_t = Σ_{s ≤ t} A[t, s] · v_s  +  readout_t(state entering the call)

so what flows from token ``s`` to token ``t`` through the layer's memory is
exactly the term ``A[t, s] · v_s``: the state token ``s`` wrote, decayed and
erased as the recurrence does, read at ``t``. A knockout acts at the
recurrence (the kernel call, or the kind's own loop); the rest of the layer
(projections, the short convolution in front of the kernel, gates, norms) runs
as usual on what the recurrence returns.

``mode="value"`` (`knock_out`): the sources' terms are removed from the
outputs at the targets, and nothing else changes in the layer.

* ``targets=None`` (every position at or after each source): the sources'
  values (``attention_values[:, s]``) enter the recurrence as zero, written
  before the kernel runs. Every output at or after ``s`` loses ``A[t, s] v_s``,
  and so does the state the call leaves, so later decode steps do not read the
  sources either. The value is the kind's ``attention_values``: ``v`` on the
  gated DeltaNet, Kimi, lightning attention, RWKV-4 and the mLSTM (whose
  denominators do not depend on it); ``x`` on Mamba-1/2, where this removes the
  source's input to the scan ``Δ_s B_s x_s`` and its skip term ``D x_s`` (both
  are ``A[·, s]``'s) while its decay ``exp(Δ_s A)`` stays; the RG-LRU's
  normalized input; the short convolution's ``x`` (its window then holds
  ``B_s x_s = 0``).
* ``targets`` given: only the outputs at those positions change, by exactly
  ``-Σ_{s ∈ sources} A[t, s] v_s`` (the call's own effective attention and
  values), added to the kernel's output once it returned; every other output,
  and the state the call leaves, are the kernel's own.

``mode="skip"``: token ``s`` does not touch the state: the state after ``s``
is the state before it (no decay, no erasure, no write) and every later token
continues from there; ``targets`` must be ``None``. Each token's output stays
its kind's readout: a kind whose output reads the state after the token's
update (the DeltaNets, Mamba-1/2, the mLSTM, lightning attention, the RG-LRU)
reads the unchanged state at ``s``; RWKV-4 and the short convolution, whose
output at ``s`` is computed from the state before ``s`` and ``s``'s own input,
keep token ``s``'s output. A kind skips through its ``SKIP`` table (values
written at the sources before the kernel runs: a DeltaNet's ``betas`` 0 and
``decays`` 0, Mamba's ``decays`` 0, i.e. ``Δ_s = 0``), or, where its
recurrence has no per-token decay to neutralize (``SKIP = None``: RWKV-4, the
short convolution), by ``set_state_after(s, the state before s)``, which
needs the kind's per-token strategy (``route_kernels`` on RWKV).

Composition. Several knockouts in one call compose: a value already zeroed
contributes nothing more, and a ``(target, source)`` pair already removed from
an output is not removed twice. Order: a knockout of every target and a skip
write the kernel's arguments, so in one call they come before a targeted one
(which reads the kernel's output); `OrderError` says so otherwise.

Positions are positions of this call (of the padded sequence in a padded
batch), negative ones counting from the end, as ``states`` indexes them.

`steer_state` adds to the state after some tokens (``set_state_after(t,
state_after(t) + scale * delta)``) or to the state the call leaves.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import indices
from ..core.calls import mediator, per_call
from ..core.errors import InvalidArgument, Unavailable, WrongType
from ..core.values import replace_in
from .per_token.protocol import Mixer

#: ``mode`` values a recurrent mixer's knockout takes.
MODES = ("value", "skip")
#: The per-call record (`per_call`) of the ``(target, source)`` pairs already removed from a kernel output.
REMOVED = "knocked_out"
#: Attribute of a run's batcher holding what its invokes share (`shared_in_run`).
SHARED = "_nnterp_shared"


def knockout_reason(mixer: Mixer) -> str | None:
    """Why ``knockout`` cannot act on this call of ``mixer`` now: the effective attention's reason (the kernels)."""
    return type(mixer).values()["effective_attention"].reason(mixer)


def skip_reason(mixer: Mixer) -> str | None:
    """Why ``knockout(..., mode="skip")`` cannot act now: a kind without a ``SKIP`` table needs its per-token writes."""
    reason = knockout_reason(mixer)
    if reason is None and type(mixer).SKIP is None:
        reason = type(mixer).values()["states"].reason(mixer)
    return reason


def as_positions(chosen: Any, size: int, what: str) -> list[int]:
    """An int or a sequence of ints as sorted distinct positions of a call of ``size`` tokens."""
    if isinstance(chosen, bool) or chosen is None:
        raise WrongType(f"{what} takes a token position (an int) or a sequence of them, got {chosen!r}")
    found = indices.selection(chosen, size, what)
    if not found:
        raise InvalidArgument(f"{what}: no position given")
    return sorted(set(found))


def check_mode(mode: Any, targets: Any, what: str, modes: tuple = MODES) -> None:
    """Refuse an unknown ``mode``, and ``targets`` with ``mode="skip"``."""
    if mode not in modes:
        other = " ('mask' is an attention layer's: self_attn.knockout)" if "mask" not in modes else ""
        raise InvalidArgument(f"`{what}`: mode must be one of {modes}, got {mode!r}{other}")
    if mode == "skip" and targets is not None:
        raise InvalidArgument(
            f"`{what}`: mode='skip' changes every token after the source (it never touches the state), so it "
            "takes no targets: pass targets=None, or mode='value' with targets to remove its terms at some outputs only"
        )


class RecurrenceInterventions:
    """What a recurrent mixer offers beyond its values: ``knockout`` and ``steer_state`` (module docstring).

    A kind declares ``SKIP`` (how ``mode="skip"`` neutralizes a token: ``{value name: what is written at the
    skipped tokens}``, or ``None`` to skip by ``set_state_after``) and ``VALUE_ARGUMENT`` (the kernel argument
    ``attention_values`` serves, whose layout the kernel's output shares); a kind without a kernel call
    (lightning attention) overrides `kernel_output` and `write_kernel_output`.
    """

    SKIP: dict | None = None
    VALUE_ARGUMENT = "v"

    def knockout(self, sources: Any, targets: Any = None, mode: str = "value") -> None:
        """Remove the flow from token(s) ``sources`` to ``targets`` through this call's recurrence.

        ``sources``: an int or a sequence of positions of this call (negative ones count from the end);
        ``targets``: ``None`` (every position at or after each source) or an int / a sequence: only the outputs
        there change. ``mode="value"``: the sources' effective-attention terms ``A[t, s] · v_s`` are removed
        (with ``targets=None`` their values enter the recurrence as zero, so the state the call leaves lacks
        them too); ``mode="skip"``: each source leaves the state as it found it (no decay, no erasure, no
        write), and later tokens continue from there. `nnterp.recurrent.knockout` says what each kind does.
        A knockout of every target and a skip come before a targeted knockout in the same call.
        """
        what = "linear_attn.knockout"
        check_mode(mode, targets, what)
        reason = skip_reason(self) if mode == "skip" else knockout_reason(self)
        if reason is not None:
            raise Unavailable(what, reason)
        mediator(f"`{what}`")
        values = self.attention_values
        seq = values.shape[1]
        chosen = as_positions(sources, seq, f"`{what}` sources")
        if mode == "skip":
            self._skip(chosen)
        elif targets is None:
            zeroed = values.clone()
            zeroed[:, chosen] = 0
            self.attention_values = zeroed
        else:
            self._remove_terms(chosen, as_positions(targets, seq, f"`{what}` targets"), values)

    def _remove_terms(self, sources: list[int], targets: list[int], values: torch.Tensor) -> None:
        """Subtract ``Σ_{s ∈ sources} A[t, s] v_s`` from the kernel's output at each target (a pair removed once)."""
        removed = per_call(self, REMOVED, set)
        pairs = torch.tensor([[(t, s) not in removed and s <= t for s in sources] for t in targets], dtype=torch.float32)
        if not pairs.any():
            return
        rows = shared_in_run(self, ("knockout", tuple(targets)), self.effective_inputs(), lambda: self.effective_attention_of(positions=targets))
        A = rows[..., sources].float()  # [batch, heads or channels, T, S]
        A = A * pairs.to(A.device)
        v = values[:, sources].float()
        if v.dim() == 4:  # [batch, S, heads, value_dim]
            change = torch.einsum("bhts,bshd->bthd", A, v)
        else:  # [batch, S, channels]
            change = torch.einsum("bcts,bsc->btc", A, v)
        output = self.kernel_output()
        # The short convolution's prompt output may start with the window entering the call: the call's tokens are last.
        at = torch.tensor(targets, device=output.device) + (output.shape[1] - values.shape[1])
        edited = output.clone()
        edited[:, at] = (output[:, at].float() - change.to(output.device)).to(output.dtype)
        self.write_kernel_output(edited)
        removed.update((t, s) for t in targets for s in sources if s <= t)

    def _skip(self, sources: list[int]) -> None:
        table = type(self).SKIP
        if table is not None:
            for name, filler in table.items():
                written = getattr(self, name).clone()
                written[:, sources] = filler
                setattr(self, name, written)
            return
        for s in sources:
            before = self.state_after(s - 1) if s > 0 else self.state_input
            self.set_state_after(s, (before if before is not None else self.fresh_state()).clone())

    def steer_state(self, delta: torch.Tensor, positions: Any = None, scale: float = 1.0) -> None:
        """Add ``scale * delta`` to the state after each token in ``positions`` of this call (later tokens continue
        from the steered state), or with ``positions=None`` to the state the call leaves (what the next decode
        step starts from). ``delta`` broadcasts to one position's state (``state_output``'s shape, with or
        without its batch axis). Under ``generate``, inside ``tracer.iter[k]`` it steers that step. Equal to
        ``set_state_after(t, state_after(t) + scale * delta)`` at each position, in increasing order.
        """
        what = "linear_attn.steer_state"
        if not isinstance(delta, torch.Tensor):
            raise WrongType(f"`{what}` takes a tensor delta (one position's state), got {type(delta).__name__}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise WrongType(f"`{what}`: scale is a number, got {type(scale).__name__}")
        if positions is None:
            state = self.state_output
            self.state_output = state + broadcast(delta, state, what) * scale
            return
        reason = type(self).values()["states"].reason(self)
        if reason is not None:
            raise Unavailable(what, reason)
        mediator(f"`{what}`")
        for t in as_positions(positions, self.record().seq, f"`{what}` positions"):
            state = self.state_after(t)
            self.set_state_after(t, state + broadcast(delta, state, what) * scale)

    # -- the hooks a kind overrides --------------------------------------------------

    def kernel_output(self) -> torch.Tensor:
        """The kernel call's output, tokens first (``attention_values``' layout), read once the kernel returned."""
        call = self.record()
        output = call.op.output
        element = output[0] if isinstance(output, tuple) else output
        return call.table[type(self).VALUE_ARGUMENT][1].read(element)

    def write_kernel_output(self, value: torch.Tensor) -> None:
        """Make ``value`` (tokens first, as `kernel_output` serves it) the kernel call's output the forward goes on with."""
        call = self.record()
        output = call.op.output
        element = output[0] if isinstance(output, tuple) else output
        element = call.table[type(self).VALUE_ARGUMENT][1].write(value, element)
        call.op.output = replace_in(tuple(output), 0, element) if isinstance(output, tuple) else element

    def effective_inputs(self) -> dict:
        """What this call's effective attention is computed from, by name (the kernel's served arguments): invokes
        whose inputs are equal share its rows (`shared_in_run`)."""
        return self.record().serve_all()

    def fresh_state(self) -> torch.Tensor:
        """The state before a fresh prompt's first token (zeros of one position's state)."""
        shape, dtype, device = self.record().expected
        return torch.zeros(shape, dtype=dtype, device=device)

    def interventions(self) -> dict[str, str | None]:
        """Per intervention, ``None`` where it acts now, else why not (``support()``'s rows)."""
        return {
            "knockout": knockout_reason(self),
            "knockout.skip": skip_reason(self),
            "steer_state": type(self).values()["state_output"].reason(self),
        }


def shared_in_run(envoy: Any, key: Any, inputs: dict, compute: Any) -> Any:
    """``compute()``, computed once for the invokes of one run that ask it with equal ``inputs``.

    A knockout sweep runs one prompt in many invokes (a batch row per source), and each needs the same rows of
    the knocked-out layer's effective attention: the first invoke computes them, and a later one whose ``inputs``
    (what they are computed from: tensors, equal element by element, and plain values) are equal takes them. Kept
    on the run's batcher, one entry per ``(module, key)``, so it is freed with the run. Not under autograd (a
    shared value would carry one invoke's graph into another's), nor with one invoke. The value is shared: read it,
    never write it in place.
    """
    med = mediator(f"`{envoy.path}`")
    batcher = getattr(med.interleaver, "batcher", None)
    if batcher is None or len(med.interleaver.mediators) < 2 or torch.is_grad_enabled():
        return compute()
    memo = batcher.__dict__.setdefault(SHARED, {})
    held = memo.get((envoy.path, key))
    if held is not None and held[0].keys() == inputs.keys() and all(_same(held[0][name], value) for name, value in inputs.items()):
        return held[1]
    value = compute()
    memo[(envoy.path, key)] = ({name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in inputs.items()}, value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def broadcast(delta: torch.Tensor, state: torch.Tensor, what: str) -> torch.Tensor:
    """``delta`` on ``state``'s device and dtype, refused unless it broadcasts to one position's state."""
    try:
        shaped = torch.broadcast_shapes(delta.shape, state.shape)
    except RuntimeError:
        shaped = None
    if shaped != state.shape:
        raise InvalidArgument(
            f"`{what}`: delta of shape {tuple(delta.shape)} does not broadcast to one position's state "
            f"{tuple(state.shape)} (state_output's shape, [batch, ...state])"
        )
    return delta.to(device=state.device, dtype=state.dtype)
