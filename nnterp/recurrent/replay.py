"""Per-token states stored as what the recurrence writes, and replayed: the factorized store of `nnterp.collect`.

Mental model. A recurrent mixer's state after token ``t`` is a function of
the state before the call and the kernel's arguments at tokens ``0..t`` (the
keys, values, write strengths and decays of a gated DeltaNet; ``x``, ``Δ``,
``B`` on Mamba): its fast spec (``FAST``, `nnterp.fast.spec.FastSpec`)
computes it. So instead of the states, ``[seq, ...state]`` per prompt
(``key_dim · value_dim`` numbers per head and token on a DeltaNet), a store
can keep the per-token arguments the spec reads (``tokens``: about ``key_dim +
value_dim`` per head and token), the arguments shared by every token (``A``,
``dt_bias``, flags) once, and the state after every ``checkpoint_every``-th
token. The state after ``t`` is then the spec run from the checkpoint at or
before ``t`` over the tokens up to ``t``: at most ``checkpoint_every`` tokens
of one layer.

`Factorized` is one prompt's record for one layer: ``tokens`` (each
``[seq, ...]``, tokens first as the component serves them), ``shared``
(tensors and plain values), and ``checkpoints`` ``[n, ...state]``, the states
after tokens ``every - 1, 2 · every - 1, ...``. The checkpoints are computed
by the same replay from the stored arguments, so a replayed state is the
spec's state of the stored arguments: within float32 rounding of the live one.

Only a kind with a fast spec can be stored this way (`spec_of` says which
spec, or why not).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import Unavailable
from ..fast.spec import FastSpec


def spec_of(mixer: Any, what: str) -> FastSpec:
    """The fast spec that replays ``mixer``'s states, or `Unavailable` saying why there is none."""
    spec = getattr(type(mixer), "FAST", None)
    if spec is None:
        raise Unavailable(
            what, f"{type(mixer).__name__} has no fast spec (nnterp.fast) to replay its states from its kernel's "
            "arguments: collect its states unfactorized (factorized=False), at the positions you need",
        )
    return spec


class Factorized:
    """One prompt's per-token states of one layer, as the arguments that write them plus checkpoints (module docstring)."""

    def __init__(self, spec: FastSpec, tokens: dict, shared: dict, every: int, checkpoints: torch.Tensor | None = None) -> None:
        self.spec, self.tokens, self.shared, self.every = spec, tokens, shared, every
        self.seq = next(iter(tokens.values())).shape[0]
        self.checkpoints = self._checkpoints() if checkpoints is None else checkpoints

    def _arguments(self, lo: int, hi: int, start: torch.Tensor | None) -> dict:
        """The spec's arguments for tokens ``lo .. hi - 1`` from the state ``start`` (``None``: a fresh prompt), batch of one."""
        found = dict(self.shared)
        found.update({name: value[lo:hi][None] for name, value in self.tokens.items()})
        found["state"] = start[None] if start is not None else None
        return found

    def replay(self, lo: int, hi: int, start: torch.Tensor | None) -> torch.Tensor:
        """The states after tokens ``lo .. hi - 1``, starting from ``start`` (the state after ``lo - 1``): ``[hi - lo, ...state]``."""
        return self.spec.compute(self._arguments(lo, hi, start), None)[0]

    def _checkpoints(self) -> torch.Tensor:
        found, start = [], None
        for lo in range(0, self.seq - self.seq % self.every, self.every):
            start = self.replay(lo, lo + self.every, start)[-1]
            found.append(start)
        if not found:
            shape = self.spec.state_shape(self._arguments(0, self.seq, None))[1:]
            return torch.zeros(0, *shape)
        return torch.stack(found)

    def states(self, positions: list[int]) -> torch.Tensor:
        """The states after each of ``positions`` (from 0, in the order given): each segment replayed once."""
        found: dict = {}
        for segment in sorted({t // self.every for t in positions}):
            lo = segment * self.every
            start = self.checkpoints[segment - 1] if segment else None
            hi = max(t for t in positions if t // self.every == segment) + 1
            for offset, state in enumerate(self.replay(lo, hi, start)):
                found[lo + offset] = state
        return torch.stack([found[t] for t in positions])

    def tensors(self, prefix: str) -> dict:
        """What a shard keeps of it, under ``prefix``: the token arguments, the shared tensors and the checkpoints."""
        found = {f"{prefix}/tokens/{name}": value.contiguous() for name, value in self.tokens.items()}
        found.update({f"{prefix}/shared/{name}": value.contiguous() for name, value in self.shared.items() if isinstance(value, torch.Tensor)})
        found[f"{prefix}/checkpoints"] = self.checkpoints.contiguous()
        return found

    def plain(self) -> dict:
        """The shared arguments that are not tensors (flags, limits), for the manifest."""
        return {name: value for name, value in self.shared.items() if not isinstance(value, torch.Tensor)}


def from_served(spec: FastSpec, served: dict, row: int, real: torch.Tensor, every: int) -> Factorized:
    """Row ``row`` of a call's served arguments (tokens first), at the prompt's own tokens ``real`` (a padded row's)."""
    tokens, shared = {}, {}
    for name, value in served.items():
        if name in ("state", "final"):
            continue
        if name in spec.tokens:
            if value is not None:
                tokens[name] = value[row].index_select(0, real.to(value.device)).detach().to("cpu").clone()
        elif isinstance(value, torch.Tensor):
            shared[name] = value.detach().to("cpu").clone()
        elif value is None or isinstance(value, (bool, int, float, str, list, tuple)):
            shared[name] = list(value) if isinstance(value, tuple) else value
    if served.get("state") is not None:
        raise Unavailable("a factorized store of states", "this call starts from a state (a decode step or an assigned state_input); collect prompts from scratch")
    return Factorized(spec, tokens, shared, every)


def loaded(spec: FastSpec, read: Any, prefix: str, token_names: list, shared_names: list, plain: dict, every: int) -> Factorized:
    """A `Factorized` back from a shard (``read(key)`` a tensor) and the manifest's entries."""
    tokens = {name: read(f"{prefix}/tokens/{name}") for name in token_names}
    shared = {name: read(f"{prefix}/shared/{name}") for name in shared_names}
    shared.update(plain)
    return Factorized(spec, tokens, shared, every, read(f"{prefix}/checkpoints"))
