"""StateSpace: Mamba-2's state-space-duality mixer (Dao & Gu, 2024, arXiv:2405.21060).

Mental model: each of ``mixer_heads`` heads keeps a state matrix of
``[head_dim, state_size]``, decayed by one scalar per head and token:

    Δ_t = clamp(softplus(dt_t + dt_bias), dt_limit)     (the betas, [heads])
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t           (log decay Δ_t A: the decays)
    y_t = h_t C_t + D x_t                               (gated by z in a norm afterwards)

As in the duality, ``C`` reads the state as queries do, ``B`` writes it as
keys do and ``x`` is written: ``attention_queries``, ``attention_keys``,
``attention_values``; ``B`` and ``C`` have one head per group (``key_heads``).

A prompt runs the *chunk scan*: the sequence in chunks of ``chunk_size``
tokens, the state computed only at chunk boundaries, in one einsum
(``new_states``, ``[batch, chunks + 1, heads, head_dim, state_size]``). A
decode step runs a one-step update with no sequence axis. So the state after
every token exists only when every token is a boundary:
``nnterp.chunk_per_token(model)``; until then ``states`` and its kin say so.

Values, tokens first (``seq`` is this call's tokens, one on a decode step,
where each value gains a sequence axis on read and loses it on write):

* ``attention_values`` ``[batch, seq, mixer_heads, head_dim]``: x.
* ``attention_keys`` / ``attention_queries`` ``[batch, seq, key_heads, state_size]``: B, C.
* ``dt`` / ``betas`` / ``decays`` ``[batch, seq, mixer_heads]``: the time step
  before bias and softplus, Δ, and the *log* decay Δ·A (≤ 0). A write to
  ``betas`` or ``decays`` is inverted to ``dt``, so it reaches the kernel.
* ``state_input`` ``[batch, mixer_heads, head_dim, state_size]``: the state the
  call starts from (``None`` on a fresh prompt), a copy; assignable on a prompt
  too (the chunk scan takes an initial state).
* ``state_output``: the state after the call's last token; writable.
* ``states`` ``[batch, seq, mixer_heads, head_dim, state_size]``,
  ``state_after(t)``, ``set_state_after(t, value)``, ``state`` (per
  ``tracer.iter`` token): need ``chunk_per_token``. A write at ``t`` is
  propagated to every later token through the decays, so tokens after ``t``
  continue from ``value``; token ``t``'s own output stays as computed (the scan
  reads it off the boundary before it).
* ``conv_state_input`` / ``conv_state_output`` ``[batch, conv_channels, conv_width]``.
* ``attention_output`` ``[batch, seq, hidden]``; ``argument(name)`` for any other.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
import transformers.models.mamba2.modeling_mamba2 as _reference
from jaxtyping import Float
from torch import Tensor

from ..core.calls import forget, mediator, per_call, pinned
from ..core.dims import BATCH, HEAD_DIM, KEY_HEADS, MIXER_HEADS, SEQ, STATE_SIZE, Gates
from ..core.errors import NnterpError, OrderError, Unavailable
from ..core.values import DerivedEProperty, check_expected, check_tensor
from . import kernels
from .conv import conv_state_input, conv_state_output
from .kernel_arguments import (
    ONE_TOKEN,
    ONE_TOKEN_PER_HEAD,
    PER_HEAD,
    SAME,
    KernelArguments,
    inverse_softplus,
    keep_unchanged,
    kernel_argument,
    state_input,
)
from .recurrent import TokenOp, needs_torch_kernels
from ..fast.mixin import FastStates
from ..fast.specs import SSD

HeadValues = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {HEAD_DIM}"]
GroupVectors = Float[Tensor, f"{BATCH} {SEQ} {KEY_HEADS} {STATE_SIZE}"]
HeadState = Float[Tensor, f"{BATCH} {MIXER_HEADS} {HEAD_DIM} {STATE_SIZE}"]
HeadStates = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {HEAD_DIM} {STATE_SIZE}"]


def needs_per_token_chunks(envoy: Any) -> Optional[str]:
    """Why the state after every token is unavailable: the chunk scan has boundaries only every ``chunk_size`` tokens."""
    reason = needs_torch_kernels(envoy)
    if reason is not None:
        return reason
    size = envoy._module.chunk_size
    if size != 1:
        return (
            f"the chunk scan materializes the state only at chunk boundaries, every {size} tokens "
            f"(chunk_size={size}); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, "
            "so every token is a boundary (slower on long prompts)"
        )
    return None


class StateSpace(FastStates, KernelArguments):
    """A Mamba-2 mixer (``layer.linear_attn``): see the module docstring for its values."""

    FAST = SSD
    CHUNK_FUNCTION = "mamba2_chunk_scan"
    RECURRENT_FUNCTION = "mamba2_selective_state_update"
    STATE_OP: Optional[str] = None
    #: The decode kernel's one-step update (resolved at import).
    STEP_STATE_OP: Optional[str] = "<resolved at import>"
    #: The chunk scan's states at every chunk boundary, index 0 the state entering (resolved at import).
    BOUNDARY_OP: str = "<resolved at import>"

    #: ``mamba2_chunk_scan(x, dt, A, B, C, chunk_size=, D=, dt_bias=, initial_states=, dt_softplus=, dt_limit=, ...)``.
    CHUNK_ARGUMENTS = {
        "x": (0, SAME),
        "dt": (1, SAME),
        "A": (2, SAME),
        "B": (3, SAME),
        "C": (4, SAME),
        "chunk_size": ("chunk_size", SAME),
        "D": ("D", SAME),
        "dt_bias": ("dt_bias", SAME),
        "state": ("initial_states", SAME),
        "dt_softplus": ("dt_softplus", SAME),
        "dt_limit": ("dt_limit", SAME),
    }
    #: ``mamba2_selective_state_update(state, x, dt, A, B, C, D, z=, dt_bias=, dt_softplus=)``: one token, per-head values expanded.
    RECURRENT_ARGUMENTS = {
        "state": (0, SAME),
        "x": (1, ONE_TOKEN),
        "dt": (2, ONE_TOKEN_PER_HEAD),
        "A": (3, PER_HEAD),
        "B": (4, ONE_TOKEN),
        "C": (5, ONE_TOKEN),
        "D": (6, PER_HEAD),
        "dt_bias": ("dt_bias", PER_HEAD),
        "dt_softplus": ("dt_softplus", SAME),
    }

    @classmethod
    def resolve(cls, hf_mixer: type) -> None:
        super().resolve(hf_mixer)
        modeling = kernels.modeling_of(hf_mixer)
        cls.BOUNDARY_OP = kernels.state_label(getattr(modeling, cls.CHUNK_FUNCTION), "new_states", in_loop=False)
        # The update itself, not the `.to(...)` copy the readout makes of it.
        cls.STEP_STATE_OP = kernels.bindings(getattr(modeling, cls.RECURRENT_FUNCTION), "ssm_states", in_loop=False)[0]

    attention_queries = kernel_argument("C", "C, how each token reads the state (the queries), [batch, seq, key_heads, state_size]", GroupVectors)
    attention_keys = kernel_argument("B", "B, how each token writes the state (the keys), [batch, seq, key_heads, state_size]", GroupVectors)
    attention_values = kernel_argument("x", "x, what each token writes, [batch, seq, mixer_heads, head_dim]", HeadValues)
    dt = kernel_argument("dt", "the time step before its bias and softplus, [batch, seq, mixer_heads]", Gates)

    # -- betas and decays, with their inverses --------------------------------

    def _betas(self) -> torch.Tensor:
        call = self._arguments()
        step = self._serve("dt", call)
        bias = self._serve("dt_bias", call)
        if bias is not None:
            step = step + bias.to(step.dtype)
        if self._serve("dt_softplus", call):
            step = F.softplus(step)
        limit = self._serve("dt_limit", call)  # the prompt kernel clamps; the decode kernel does not
        return torch.clamp(step, min=limit[0], max=limit[1]) if limit is not None else step

    def _assign_betas(self, value: Any) -> None:
        served = self._betas()
        check_tensor("`linear_attn.betas`", value, served)
        call = self._arguments()
        bias = self._serve("dt_bias", call)
        step = inverse_softplus(value) if self._serve("dt_softplus", call) else value
        if bias is not None:
            step = step - bias.to(step.dtype)
        self.dt = keep_unchanged(value, served, step, self._serve("dt", call))

    def _A(self) -> torch.Tensor:
        return self._serve("A", self._arguments()).float()

    def _decays(self) -> torch.Tensor:
        return self._betas() * self._A()

    def _assign_decays(self, value: Any) -> None:
        served = self._decays()
        check_tensor("`linear_attn.decays`", value, served)
        self.betas = keep_unchanged(value, served, value / self._A(), self._betas())

    betas = DerivedEProperty(
        _betas,
        assign=_assign_betas,
        description="the step size Δ = softplus(dt + dt_bias) > 0, [batch, seq, mixer_heads]; a write sets dt",
        unavailable=needs_torch_kernels,
        annotation=Gates,
    )
    decays = DerivedEProperty(
        _decays,
        assign=_assign_decays,
        description="the log decay Δ·A ≤ 0 (the state is multiplied by exp of it), [batch, seq, mixer_heads]; a write sets dt",
        unavailable=needs_torch_kernels,
        annotation=Gates,
    )
    state_input = state_input(
        "the state this call starts from, [batch, mixer_heads, head_dim, state_size], a copy (None on a fresh prompt); "
        "assign it to continue from another",
        HeadState,
    )
    state_output = DerivedEProperty(
        KernelArguments._state_output,
        assign=KernelArguments._assign_state_output,
        description="the state after this call's last token, [batch, mixer_heads, head_dim, state_size]",
        unavailable=needs_torch_kernels,
        annotation=HeadState,
    )
    conv_state_input = conv_state_input()
    conv_state_output = conv_state_output()

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "mixer_heads": module.num_heads,
            "head_dim": module.head_dim,
            "state_size": module.ssm_state_size,
            "key_heads": module.n_groups,
            "conv_channels": module.conv_dim,
            "conv_width": module.conv_kernel_size,
        }

    def _seq(self, args: tuple, kwargs: dict) -> int:
        return 1 if self._decodes() else args[0].shape[1]

    def _state_shape(self, args: tuple, kwargs: dict) -> tuple:
        if self._decodes():
            return tuple(args[0].shape)
        x, B = args[0], args[3]
        return (x.shape[0], x.shape[2], x.shape[3], B.shape[-1])

    def _state_op(self, kernel: str) -> str:
        cls = type(self)
        return cls.STEP_STATE_OP if kernel == cls.RECURRENT_KERNEL else cls.BOUNDARY_OP

    # -- the state after every token: the boundaries --------------------------

    def _boundaries(self) -> tuple[TokenOp, torch.Tensor]:
        """This call's record and the state after each of its tokens, ``[batch, seq, ...]``, read once per call."""
        record = self._token_op()

        def read() -> torch.Tensor:
            self._visit(record, 0, "the state after a token")
            with pinned(record.first):
                value = record.op.output
            # The chunk scan's index 0 is the state entering; a decode step has no seq axis.
            return value[:, None] if self._decodes() else value[:, 1:]

        return record, per_call(self, "boundaries", read)

    def _states(self) -> torch.Tensor:
        record, states = self._boundaries()
        record.furthest = (record.seq - 1, "states")
        return states

    states = DerivedEProperty(
        _states,
        description="the state after every token of this call, [batch, seq, mixer_heads, head_dim, state_size]; needs chunk_per_token",
        unavailable=needs_per_token_chunks,
        annotation=HeadStates,
    )

    def state_after(self, t: int) -> torch.Tensor:
        """The state after token ``t`` of this call (negative ``t`` counts from the end); needs `chunk_per_token`."""
        self._require("state_after")
        record, states = self._boundaries()
        position = self._position(t, record.seq, f"state_after({t})")
        if record.furthest is None or position > record.furthest[0]:
            record.furthest = (position, f"state_after({t})")
        return states[:, position]

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """Assign the state after token ``t``: the tokens after it continue from ``value``.

        On a prompt the chunk scan computes every boundary in one einsum, so a
        boundary written alone would not reach the next: the difference
        ``value - state`` is carried to every later token through the decays,
        as the recurrence would carry it. Token ``t`` itself is left as it was
        (its output read the state it computed), as when a cache holding the
        prefix's state is replaced before the rest is fed; ``state_after(t)``
        then reads ``value``. On a decode step, the cache the next step
        starts from. Write positions in increasing order, after reading the
        positions before them.
        """
        self._require("set_state_after")
        what = f"set_state_after({t}, value)"
        record, states = self._boundaries()
        position = self._position(t, record.seq, what)
        check_expected(what, value, *record.expected)
        if record.furthest is not None and record.furthest[0] > position:
            raise OrderError(self._order_hint(what, f"{record.furthest[1]} had read a later token"))
        if self._decodes():
            if mediator().occurrence(f"{record.kernel.path}.output") > record.output_at:
                raise OrderError(self._order_hint(what, "the kernel had returned (state_output or a later value was read)"))
            self._write_final(record, value)  # the cache's buffer, after the step's own update
            updated = value[:, None]
        else:
            if mediator().occurrence(f"{record.op.path}.output") > record.first:
                raise OrderError(self._order_hint(what, "the scan had moved past its boundary states"))
            with pinned(record.first):
                current = record.op.output
            boundaries = current.clone()
            boundaries[:, 1:] = current[:, 1:] + self._carried(position, value - current[:, position + 1])
            boundaries[:, position + 1] = value
            with pinned(record.first):
                record.op.output = boundaries
            updated = boundaries[:, 1:]
        # Later reads of this call are served from the record: keep it current.
        forget(self, "boundaries")
        per_call(self, "boundaries", lambda: updated)
        record.furthest = (position, what)

    def _carried(self, position: int, delta: torch.Tensor) -> torch.Tensor:
        """``delta`` (the change of the state after token ``position``) as it reaches every token, ``[batch, seq, ...]``.

        The state after token ``c > position`` changes by ``exp(Σ_{position<j≤c} decays_j) · delta``; tokens up to ``position`` not.
        """
        log = self._decays()  # [batch, seq, heads]
        total = torch.cumsum(log, dim=1)
        gap = total - total[:, position : position + 1]
        factor = torch.where(torch.arange(log.shape[1], device=log.device)[None, :, None] >= position, gap.exp(), torch.zeros_like(gap))
        return factor[..., None, None] * delta[:, None].to(factor.dtype)

    def _iterated_state(self) -> torch.Tensor:
        t = mediator("`linear_attn.state`").iteration or 0  # the token tracer.iter pins (outside a loop: token 0)
        with pinned(None):
            record, states = self._boundaries()
        if t >= record.seq:
            # Past the call's last token: park where the run never comes, so an open
            # tracer.iter[:] ends as it does on a DeltaNet, with nnsight's "never reached".
            with pinned(record.first + t + 1):
                return record.op.output
        with pinned(None):
            return self.state_after(t)

    def _assign_iterated_state(self, value: torch.Tensor) -> None:
        t = mediator("`linear_attn.state`").iteration or 0
        with pinned(None):
            self.set_state_after(t, value)

    state = DerivedEProperty(
        _iterated_state,
        assign=_assign_iterated_state,
        description="the state after the token tracer.iter pins (token 0 outside a loop), [batch, mixer_heads, head_dim, state_size]; needs chunk_per_token",
        unavailable=needs_per_token_chunks,
        annotation=HeadState,
    )

    def _require(self, what: str) -> None:
        reason = needs_per_token_chunks(self)
        if reason is not None:
            raise Unavailable(f"linear_attn.{what}", reason)
        mediator(f"`linear_attn.{what}`")


StateSpace.resolve(_reference.Mamba2Mixer)
