"""Per-token states stored as what the recurrence writes, and replayed: the factorized store of `nnterp.collect`.

Mental model. A recurrent mixer's state after token ``t`` is a function of
the state before the call and the kernel's arguments at tokens ``0..t`` (the
keys, values, write strengths and decays of a gated DeltaNet; ``x``, ``Δ``,
``B`` on Mamba; a window's inputs on a short convolution): its kind's fast
spec (`nnterp.fast.spec.FastSpec`, `spec_of`) computes it. So instead of the
states, ``[seq, ...state]`` per prompt (``key_dim · value_dim`` numbers per
head and token on a DeltaNet), a store keeps the per-token arguments the
states are written from (``tokens``: the spec's ``state_tokens``, about
``key_dim + value_dim`` per head and token on a DeltaNet: the queries, which
only the output reads, are not kept), in the dtype the kernel received them,
the arguments shared by every token (``A``, ``dt_bias``, flags) once, the state
the prompt's first token starts from where it is not zeros (``start``), and
the state after every ``checkpoint_every``-th token (float32). The state after
``t`` is then the spec run from the checkpoint at or before ``t`` over the
tokens up to ``t``: at most ``checkpoint_every`` tokens of one layer, and only
those tokens are read from disk (`loaded` reads slices).

`Factorized` is one prompt's record for one layer: ``tokens`` (each
``[seq, ...]``, tokens first as the component serves them, or a reader of
slices of them), ``shared`` (tensors and plain values), ``start`` (``None``:
zeros) and ``checkpoints`` ``[n, ...state]``, the states after tokens ``every
- 1, 2 · every - 1, ...``. States and checkpoints are in the format the spec
writes (``[3, channels]`` on RWKV-4, the packed ``[..., value_dim + 2]`` on
the mLSTM, the window ``[conv_channels, L]`` on a short convolution); where the
kernel takes its entering state in another format, the kind's spec converts it
(``FastSpec.entering_state`` / ``starting_from``, in its ``nnterp.fast`` file).
The checkpoints are computed by the same replay from the stored arguments, so
a replayed state is the spec's state of the stored arguments: within float32
rounding of the live one.

A store may keep the mixer's inputs instead of the token arguments
(``collect(..., factorized="inputs")``): `FromInputs` recomputes a stretch's
arguments by running the mixer on them, which needs the model (section
"recomputed from the mixer's inputs" below).

A left-padded row: its prompt's tokens are stored, and ``start`` is the state
after the padding (the spec run over the padding's arguments from the call's
entering state), so a family whose model runs the padding through the
recurrence (RecurrentGemma's convolution, say) replays the row as the batch
computed it; on a family that masks the padding it is zeros and not stored.
"""

from __future__ import annotations

import inspect
from typing import Any

import nnsight
import torch

from ..core.errors import Unavailable
from ..fast import SPECS
from ..fast.spec import FastSpec


def spec_of(mixer: Any, what: str) -> FastSpec:
    """The fast spec that replays ``mixer``'s states, or `Unavailable` saying why there is none.

    Its component's ``FAST`` where a fast path is attached; else the spec of the same name as its effective
    attention's (a kind file of `nnterp.fast` names its ``FAST`` and ``EFFECTIVE`` alike), or the component's
    ``REPLAY`` where its effective attention is its own (lightning attention's).
    """
    kind = type(mixer)
    spec = getattr(kind, "FAST", None) or getattr(kind, "REPLAY", None) or SPECS.get(getattr(getattr(kind, "EFFECTIVE", None), "name", None))
    if spec is None:
        raise Unavailable(
            what, f"{kind.__name__} has no fast spec (nnterp.fast) to replay its states from its kernel's "
            "arguments: collect its states unfactorized (factorized=False), at the positions you need",
        )
    return spec


def arguments_of(mixer: Any) -> dict:
    """This call's arguments by its spec's names, tokens first, with the state entering the call: the record's
    served arguments, or the kind's own ``replay_arguments()`` where the record does not serve them by those names
    (lightning attention's forward; the short convolution, whose kernel takes the window and the inputs as one tensor)."""
    if hasattr(type(mixer), "replay_arguments"):
        return mixer.replay_arguments()
    return mixer.record().serve_all()


class Factorized:
    """One prompt's per-token states of one layer, as the arguments that write them plus checkpoints (module docstring).

    ``tokens`` and ``checkpoints`` are tensors or anything sliced like one along tokens (a shard's lazy slices).
    """

    def __init__(
        self, spec: FastSpec, tokens: dict, shared: dict, every: int, seq: int, start: torch.Tensor | None = None,
        checkpoints: Any = None,
    ) -> None:
        self.spec, self.tokens, self.shared, self.every, self.seq, self.start = spec, tokens, shared, every, seq, start
        self.checkpoints = self._checkpoints() if checkpoints is None else checkpoints

    def _arguments(self, lo: int, hi: int, start: torch.Tensor | None) -> dict:
        """The spec's arguments for tokens ``lo .. hi - 1`` from the state ``start`` (``None``: zeros), batch of one."""
        found = dict(self.shared)
        found.update({name: value[lo:hi][None] for name, value in self.tokens.items()})
        found.update(self.spec.starting_from(start[None] if start is not None else None))
        return found

    def replay(self, lo: int, hi: int, start: torch.Tensor | None) -> torch.Tensor:
        """The states after tokens ``lo .. hi - 1``, starting from ``start`` (the state after ``lo - 1``): ``[hi - lo, ...state]``."""
        return self.spec.compute(self._arguments(lo, hi, start), None)[0]

    def _checkpoints(self) -> torch.Tensor:
        found, start = [], self.start
        for lo in range(0, self.seq - self.seq % self.every, self.every):
            start = self.replay(lo, lo + self.every, start)[-1].clone()
            found.append(start)
        if not found:
            shape = self.spec.state_shape(self._arguments(0, self.seq, None))[1:]
            return torch.zeros(0, *shape)
        return torch.stack(found)

    def states(self, positions: list[int]) -> torch.Tensor:
        """The states after each of ``positions`` (from 0, in the order given): each segment replayed once, from the
        checkpoint before it (the first from ``start``), over its tokens up to the last position asked in it."""
        last: dict = {}  # each segment's last position asked
        for t in positions:
            last[t // self.every] = max(t, last.get(t // self.every, t))
        found: dict = {}
        for segment, t in sorted(last.items()):
            lo = segment * self.every
            start = self.checkpoints[segment - 1 : segment][0] if segment else self.start
            for offset, state in enumerate(self.replay(lo, t + 1, start)):
                found[lo + offset] = state
        return torch.stack([found[t] for t in positions])

    def tensors(self, prefix: str, inputs: torch.Tensor | None = None) -> dict:
        """What a shard keeps of it, under ``prefix``: the token arguments (or, given, the mixer's ``inputs`` they are
        recomputed from: `FromInputs`), the shared tensors, the start, the checkpoints."""
        if inputs is None:
            found = {f"{prefix}/tokens/{name}": value.contiguous() for name, value in self.tokens.items()}
        else:
            found = {f"{prefix}/inputs": inputs.contiguous()}
        found.update({f"{prefix}/shared/{name}": value.contiguous() for name, value in self.shared.items() if isinstance(value, torch.Tensor)})
        if self.start is not None:
            found[f"{prefix}/start"] = self.start.contiguous()
        found[f"{prefix}/checkpoints"] = self.checkpoints.contiguous()
        return found

    def plain(self) -> dict:
        """The shared arguments that are not tensors (flags, limits), for the manifest."""
        return {name: value for name, value in self.shared.items() if not isinstance(value, torch.Tensor)}


def kept(value: Any) -> Any:
    """``value`` (a tensor, or a tuple of them: RWKV-4's state) detached, on the CPU, as a copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, (tuple, list)) and value and all(isinstance(x, torch.Tensor) for x in value):
        return [x.detach().to("cpu").clone() for x in value]
    return list(value) if isinstance(value, tuple) else value


def from_served(spec: FastSpec, served: dict, row: int, real: torch.Tensor, every: int) -> Factorized:
    """Row ``row`` of a call's served arguments (tokens first), at the prompt's own tokens ``real`` (a padded row's,
    in order, the padding before them)."""
    entering = set(spec.starting_from(None))  # the names the entering state goes by ("state", a window)
    written = spec.state_tokens or spec.tokens
    tokens, shared = {}, {}
    for name, value in served.items():
        if name in entering or name == "final":
            continue
        if name in spec.tokens:
            if name in written and value is not None:
                tokens[name] = kept(value[row].index_select(0, real.to(value.device)))
        elif isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str, list, tuple)):
            shared[name] = kept(value)
    state = spec.entering_state(served)
    start = None if state is None else state[row : row + 1].float()
    first = int(real[0]) if real.numel() else 0
    if first:  # the padding before the prompt, run through the recurrence as the batch ran it
        arguments = {name: value for name, value in served.items() if name not in spec.tokens}
        arguments.update({name: served[name][row : row + 1, :first] for name in written if served.get(name) is not None})
        arguments.update(spec.starting_from(start))
        start = spec.compute(arguments, None)[:, -1]
    if start is not None:
        start = None if not bool(start.any()) else kept(start[0])
    return Factorized(spec, tokens, shared, every, int(real.numel()), start)


def loaded(spec: FastSpec, shard: Any, prefix: str, entry: dict, seq: int, mixer: Any = None) -> Factorized:
    """A `Factorized` back from an open shard (``safe_open``'s) and the manifest's ``entry``: only the shared
    arguments and the start are read now; the tokens and the checkpoints as the slices a replay reads (a store of the
    mixer's inputs: the tokens recomputed by ``mixer`` from the slices of its inputs, `FromInputs`)."""
    if entry.get("stores") == "inputs":
        tokens = FromInputs(mixer, shard.get_slice(f"{prefix}/inputs"), entry["tokens"], entry["lookback"]).columns()
    else:
        tokens = {name: shard.get_slice(f"{prefix}/tokens/{name}") for name in entry["tokens"]}
    shared = {name: shard.get_tensor(f"{prefix}/shared/{name}") for name in entry["shared"]}
    shared.update(entry["plain"])
    start = shard.get_tensor(f"{prefix}/start") if f"{prefix}/start" in shard.keys() else None
    return Factorized(spec, tokens, shared, entry["checkpoint_every"], seq, start, shard.get_slice(f"{prefix}/checkpoints"))


# -- the kernel's arguments recomputed from the mixer's inputs ----------------------------------------------
# Mental model. The kernel's token arguments at token ``t`` are the mixer's projections of its input, through a
# causal convolution of a few tokens where the kind has one: a function of the inputs at ``t - lookback .. t``
# and of the weights. So a store may keep the mixer's input, ``[seq, hidden]`` in the model's dtype (``hidden``
# numbers a token, against ``key_dim + value_dim`` per value head for the arguments and ``key_dim · value_dim``
# per head for the states), and recompute the arguments of a stretch when it replays it: the mixer itself runs
# on the inputs from ``lookback`` tokens before the stretch (its convolution's window, so no window is stored),
# stopped at its kernel call, and the stretch's arguments are replayed from the checkpoint as stored ones are.


def lookback(module: torch.nn.Module) -> int:
    """How many tokens before ``t`` a mixer's kernel arguments at ``t`` read from its input, counted safely over: its
    widest causal convolution's window (kernel size less one), and at least one (a token shift, RWKV's)."""
    return max([1, *(int(m.kernel_size[0]) - 1 for m in module.modules() if isinstance(m, torch.nn.Conv1d))])


def unrecomputable(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a transformers mixer) cannot recompute its kernel's arguments from its input alone, or ``None``:
    its forward requires more than its hidden states (RecurrentGemma's position ids, which restart its RG-LRU)."""
    parameters = list(inspect.signature(type(module).forward).parameters.values())[2:]  # self, its hidden states
    required = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        return None
    return (
        f"{type(module).__name__}.forward requires {', '.join(required)} besides its input, which the store does not "
        "keep: pass factorized=True (the kernel's arguments)"
    )


class FromInputs:
    """One prompt's kernel token arguments ``names`` in one layer, recomputed from the mixer's inputs (section above).

    ``inputs`` is ``[seq, hidden]``, a tensor or a shard's slice; ``mixer`` the layer's nnterp mixer envoy, on a
    dispatched model. ``arguments(lo, hi)`` traces the mixer on the inputs ``lo - lookback .. hi - 1``, stopped at its
    kernel call (its output projection and kernel do not run), and returns each argument at tokens ``lo .. hi - 1``,
    tokens first, as the collecting trace served them; ``columns()`` slices them like stored tensors (`Factorized`).
    """

    def __init__(self, mixer: Any, inputs: Any, names: list[str], lookback: int) -> None:
        self.mixer, self.inputs, self.names, self.lookback = mixer, inputs, list(names), lookback
        self.last: tuple | None = None  # ((lo, hi), arguments): `Factorized` asks each name of one stretch in turn

    def arguments(self, lo: int, hi: int) -> dict:
        if self.last is not None and self.last[0] == (lo, hi):
            return self.last[1]
        first = max(0, lo - self.lookback)
        weight = next(self.mixer.hf_module().parameters())
        x = self.inputs[first:hi][None].to(weight.device, weight.dtype)  # a model opened in another dtype runs in its own
        names = self.names
        with torch.no_grad(), self.mixer.trace(x) as tracer:
            served = nnsight.save({name: kept(value) for name, value in arguments_of(self.mixer).items() if name in names})
            tracer.stop()
        found = {name: served[name][0, lo - first :] for name in names}
        self.last = ((lo, hi), found)
        return found

    def columns(self) -> dict:
        """Each argument as ``[lo:hi]`` slices of it, ``[hi - lo, ...]``."""
        return {name: Column(self, name) for name in self.names}


class Column:
    """Argument ``name`` of a `FromInputs`, sliced along its tokens as a stored tensor is (``column[lo:hi]``)."""

    def __init__(self, source: FromInputs, name: str) -> None:
        self.source, self.name = source, name

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self.source.arguments(index.start or 0, index.stop)[self.name]
