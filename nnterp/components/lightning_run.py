"""One call of lightning attention, as a worker knows it: the record, and the writes that recompute the call.

`LightningAttention` (``lightning_attention.py``) binds these functions as its
methods. A call is read at the mixer's input and where its forward splits q, k
and v (`record`); a write that changes the call (``set_state_after``, a
written ``decays``) replaces the forward's concatenated output before the
norm by the recurrence continued from the written values (`rewrite`, with
`nnterp.fast.lightning_attention`) and writes the continuation's final state into the
forward's own final-state tensor, which the cache holds; under autograd an
exact zero that depends on a served value is added there (`graft`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.source import compiled, decorator_chain

from ..core import indices
from ..core.calls import mediator, per_call, pinned
from ..core.errors import OrderError, UnsupportedRelease
from ..core.local import LocalDict
from ..fast.buffers import empty_states
from ..fast.lightning_attention import lightning_scan, lightning_states
from ..fast.scan import differentiable
from ..recurrent.call import Call, order_hint, runs_between_writes
from ..recurrent.kernels import signature, signature_binding
from ..recurrent.labels import bindings, call_label, missing

#: HF mixer class -> its labels (`find_labels`), found once.
FOUND: dict[type, dict] = LocalDict()  # pickled empty: a server reads its own release


def cache_parameter(forward) -> str:
    """The forward's parameter whose ``get_linear_cache`` it calls (``cache`` from 5.24, ``past_key_values`` before)."""
    names = compiled(forward).names
    for name in signature(forward).parameters:
        pattern = re.compile(rf"^{re.escape(name)}_get_linear_cache_\d+$")
        if any(pattern.match(label) for label in names):
            return name
    raise UnsupportedRelease(missing("a call of `get_linear_cache` on one of its parameters (the cache)", forward))


def find_labels(hf_mixer: type) -> dict:
    """The forward's operations this component reads, found in the installed release's source.

    ``"cache"`` is the name of the forward's cache parameter, not a label.
    """
    forward = decorator_chain(hf_mixer.forward)[0]
    loops = bindings(forward, "attn_weights_inter", in_loop=True)
    if len(loops) < 2:
        raise UnsupportedRelease(missing("the state's bindings in the block loop and in the token loop", forward))
    cache = cache_parameter(forward)
    return {
        "cache": cache,
        "split": call_label(forward, "torch_split"),
        "get": call_label(forward, f"{cache}_get_linear_cache"),
        "cat": call_label(forward, "torch_cat"),
        "block_state": loops[0],
        "token_state": loops[-1],
    }


def labels_of(hf_mixer: type) -> dict:
    """`find_labels` of ``hf_mixer``, found once."""
    if hf_mixer not in FOUND:
        FOUND[hf_mixer] = find_labels(hf_mixer)
    return FOUND[hf_mixer]


class Run:
    """What a worker knows of one call of the mixer: its inputs, q, k, v, decays, entering state and writes."""

    def __init__(self) -> None:
        self.writes: dict[int, torch.Tensor] = {}
        self.decays_written = False
        self.original: torch.Tensor | None = None  # the forward's own attention output, [batch, heads, seq, dim]
        self.final: torch.Tensor | None = None  # the forward's own final-state tensor (what the cache holds)
        self.states_read = False
        self.furthest = -1
        self.read: dict[int, torch.Tensor] = {}  # the states state_after served, by position
        self.g_leaf: torch.Tensor | None = None  # the decays served under autograd, grafted into the output


def record(mixer) -> Run:
    """This call's record: read once, at the mixer's input and where the forward splits q, k, v."""

    def make() -> Run:
        mixer.source  # instrument the forward before it runs
        med = mediator()
        Call.check_entry(mixer)
        args, kwargs = mixer.inputs
        bound = signature_binding(type(mixer._module).forward, mixer._module, args, kwargs)
        run = Run()
        run.first = {name: med.occurrence(mixer._at(name)) for name in ("split", "get", "cat", "block_state", "token_state")}
        run.first["output"] = med.occurrence(f"{mixer.path}.output")
        run.cache = bound.get(mixer.labels()["cache"])
        run.seq = bound["hidden_states"].shape[1]
        entering = run.cache.get_linear_cache(mixer._module.layer_idx) if run.cache is not None else None
        run.continues = entering is not None
        run.initial = entering.clone() if entering is not None else None
        with pinned(run.first["split"]):
            run.q, run.k, run.v = mixer._op("split").output
        slope = mixer._module.slope_rate.reshape(1, 1, -1).to(run.q.dtype)
        run.g = (-slope).expand(run.q.shape[0], run.seq, -1)
        return run

    return per_call(mixer, "lightning", make)


def passed(mixer, run: Run, name: str, occurrence: int) -> bool:
    return mediator().occurrence(mixer._at(name)) > occurrence


def before(mixer, run: Run, name: str, what: str, moment: str) -> None:
    """Raise `OrderError` unless the forward has not passed operation ``name`` of this call yet."""
    Call.check_reachable(mixer._at(name), run.first[name], what, moment)


def position(mixer, run: Run, t: Any, what: str) -> int:
    return indices.index(t, run.seq, what)


def segments(mixer, run: Run, stop: int | None = None) -> list:
    """``(lo, hi, initial)`` runs of the call up to ``stop``, split after every write (`nnterp.recurrent.call.runs_between_writes`)."""
    return runs_between_writes(run.writes, run.seq, run.initial, stop)


def scan(mixer, run: Run, lo: int, hi: int, initial: Any, keep: bool = False) -> tuple:
    return lightning_scan(run.q[:, lo:hi], run.k[:, lo:hi], run.v[:, lo:hi], run.g[:, lo:hi], initial, keep)


def in_place(run: Run, *initials: Any) -> bool:
    """Whether the states are written in place (`lightning_states`) rather than by the token loop (`lightning_scan`).

    The token loop is kept under autograd (a graph to keep), for a state in
    another dtype than float32 (computed in it, as transformers does), and on a
    call that continues a state (a decode step): there the forward runs the same
    token loop, so its states equal the cache's bit for bit, which an
    ``addcmul_`` (one rounding where the loop rounds twice) would not.
    """
    return run.q.dtype == torch.float32 and not run.continues and not differentiable(run.k, run.v, run.g, *initials)


def state_at(mixer, run: Run, lo: int, hi: int, initial: Any) -> torch.Tensor:
    """The state after token ``hi - 1`` from ``initial`` before ``lo``: as `computed_states` computes it (so
    ``state_after(t)`` equals ``states[:, t]``), in place in a two-slot ring when `in_place`."""
    if not in_place(run, initial):
        return scan(mixer, run, lo, hi, initial)[1]
    ring = run.q.new_empty((run.q.shape[0], 2, *mixer._state_shape(run)[1:]))
    lightning_states(run.k[:, lo:hi], run.v[:, lo:hi], run.g[:, lo:hi], initial, ring)
    return ring[:, (hi - lo - 1) % 2].clone()


def computed_states(mixer, run: Run, stop: int | None = None) -> torch.Tensor:
    """The states after tokens ``0 .. stop - 1`` from the call's q, k, v, decays and writes, ``[batch, stop, ...]``.

    When `in_place`, written into one buffer (`lightning_states`); otherwise
    the token loop's states, concatenated. A written state ``t`` is not copied in here.
    """
    runs = segments(mixer, run, stop)
    if not in_place(run, *(initial for _, _, initial in runs)):
        return torch.cat([scan(mixer, run, lo, hi, initial, keep=True)[2] for lo, hi, initial in runs], dim=1)
    stop = run.seq if stop is None else stop
    out = empty_states((run.q.shape[0], stop, *mixer._state_shape(run)[1:]), run.q.device)
    for lo, hi, initial in runs:
        lightning_states(run.k[:, lo:hi], run.v[:, lo:hi], run.g[:, lo:hi], initial, out, lo)
    return out


def scan_with(mixer, run: Run, g: torch.Tensor) -> torch.Tensor:
    """The call's outputs before the norm with decays ``g`` (q, k, v detached), ``[batch, heads, seq, dim]``."""
    q, k, v = (x.detach() for x in (run.q, run.k, run.v))
    initial = run.initial.detach() if run.initial is not None else None
    return lightning_scan(q, k, v, g, initial)[0].transpose(1, 2)


def forward_final(mixer, run: Run) -> torch.Tensor | None:
    """The forward's own final-state tensor (its loop's last binding of the state), or ``None`` once passed."""
    if run.final is None:
        loop = "token_state" if run.continues else "block_state"
        steps = run.seq if run.continues else -(-run.seq // mixer._module.block_size)
        last = run.first[loop] + steps - 1
        if passed(mixer, run, loop, last):
            return None
        with pinned(last):
            run.final = getattr(mixer.source, mixer.labels()[loop]).output
    return run.final


def graft(mixer, run: Run, zero: torch.Tensor) -> None:
    """Add ``zero`` (exact zeros that carry a gradient) to the forward's concatenated output, ``[batch, heads, seq, dim]``."""
    with pinned(run.first["cat"]):
        current = mixer._op("cat").output
    if run.original is None:
        run.original = current
    with pinned(run.first["cat"]):
        Mediator.swap(mixer._at("cat"), current + zero.to(current.dtype))


def rewrite(mixer, run: Run, what: str) -> None:
    """Replace the call's attention output and final state by the recurrence with this call's writes."""
    if run.final is None and forward_final(mixer, run) is None:
        raise OrderError(order_hint(what, "the forward had computed the call's final state"))
    before(mixer, run, "cat", what, "the forward had concatenated the call's outputs")
    with pinned(run.first["cat"]):
        current = mixer._op("cat").output
    if run.original is None:
        run.original = current
    if run.decays_written:
        pieces = [scan(mixer, run, lo, hi, initial) for lo, hi, initial in segments(mixer, run)]
        outputs, final = torch.cat([p[0] for p in pieces], dim=1).transpose(1, 2), pieces[-1][1]
        keep = 0
    else:
        keep = min(run.writes) + 1
        pieces = [scan(mixer, run, lo, hi, initial) for lo, hi, initial in segments(mixer, run) if lo >= keep]
        tail = [p[0] for p in pieces]
        outputs = torch.cat([run.original[:, :, :keep], *[x.transpose(1, 2) for x in tail]], dim=2)
        final = pieces[-1][1] if pieces else run.writes[run.seq - 1]
    if run.seq - 1 in run.writes:
        final = run.writes[run.seq - 1]
    with pinned(run.first["cat"]):
        Mediator.swap(mixer._at("cat"), outputs.to(current.dtype))
    # The forward hands this tensor to the cache and returns it after the loop: write into it.
    run.final.copy_(final)


def positions(mixer, run: Run, selection: Any, what: str) -> list[int]:
    """``selection`` (a sequence of ints, a range, a 1-d tensor) as positions of this call, in the order given."""
    return indices.sequence(selection, run.seq, what)


def states_of(mixer, selection: Any) -> torch.Tensor:
    """The states after tokens ``selection`` of this call only, ``[batch, len(selection), ...state]``, in the order given.

    Equal to ``states[:, selection]``; only the tokens up to the last selected
    one are computed. As `state_after` at each of them for the order rules. A
    new tensor: its ``.grad`` never comes (read ``states.grad``).
    """
    mediator("`linear_attn.states_of`")
    run = record(mixer)
    chosen = positions(mixer, run, selection, "states_of(positions)")
    if not chosen:
        return run.q.new_empty((run.q.shape[0], 0, *mixer._state_shape(run)[1:]))
    stop = max(chosen) + 1
    states = computed_states(mixer, run, stop)
    for t, value in run.writes.items():
        if t < stop:
            states[:, t] = value
    run.furthest = max(run.furthest, stop - 1)
    return states[:, chosen]

