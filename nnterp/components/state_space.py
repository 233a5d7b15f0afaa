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
``nnterp.chunk_per_token(model)`` (`nnterp.recurrent.per_token.boundaries`),
or from the call's arguments with ``nnterp.fast_states(model)``; until then
``states`` and its kin say so.

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
* ``effective_attention`` ``[batch, mixer_heads, seq, seq]``: ``A[t, s] =
  C_t·B_s exp(Σ_{s<j≤t} Δ_j A) Δ_s``, with ``D`` on the diagonal: the scan's
  output (before the gate z, which the mixer applies in its norm after the
  scan) is ``Σ_s A[t, s] x_s`` plus ``state_input_readout`` ``[batch, seq,
  mixer_heads, head_dim]``; ``effective_attention_of(positions=, heads=)``.
  One kernel gates inside: Falcon-H1's decode step without ``mamba_rms_norm``
  returns ``silu(z) ⊙`` that (``argument("z")``, per channel, which one
  pattern per head cannot hold).
* ``attention_output`` ``[batch, seq, hidden]``; ``argument(name)`` for any other, by its signature-table name.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ..core.dims import BATCH, HEAD_DIM, KEY_HEADS, MIXER_HEADS, SEQ, STATE_SIZE, Gates
from ..core.values import DerivedEProperty, check_tensor
from ..fast.state_space import EFFECTIVE as SSD_ATTENTION
from ..fast.state_space import FAST as SSD
from ..fast.step import served_step_size
from ..recurrent.arguments import (
    ONE_TOKEN,
    ONE_TOKEN_PER_HEAD,
    PARAMETER,
    PER_HEAD,
    SAME,
    assign_step,
    keep_unchanged,
    reached_through,
    served_betas,
    served_step,
)
from ..recurrent.call import Call
from ..recurrent.kernels import modeling_of, original_body, unreadable_call
from ..recurrent.labels import Label, bindings, state_label
from .conv import conv_state_input, conv_state_output
from .recurrent import RecurrentMixer, kernel_argument

HeadValues = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {HEAD_DIM}"]
GroupVectors = Float[Tensor, f"{BATCH} {SEQ} {KEY_HEADS} {STATE_SIZE}"]
HeadState = Float[Tensor, f"{BATCH} {MIXER_HEADS} {HEAD_DIM} {STATE_SIZE}"]
HeadStates = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {HEAD_DIM} {STATE_SIZE}"]





class StateSpace(RecurrentMixer):
    """A Mamba-2 mixer (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer"
    FAST = SSD
    VALUE_ARGUMENT = "x"
    SKIP = {"betas": 0.0}  # Δ_s = 0: no decay, no write
    EFFECTIVE = SSD_ATTENTION
    CHUNK_FUNCTION = "mamba2_chunk_scan"
    RECURRENT_FUNCTION = "mamba2_selective_state_update"
    ONE_STEP_DECODE = True
    CHUNKED_SCAN = True
    SEQ_ARGUMENT = "x"
    #: The chunk scan's states at every chunk boundary, index 0 the state entering.
    BOUNDARY_OP = Label()

    #: ``mamba2_chunk_scan(x, dt, A, B, C, chunk_size=, D=, dt_bias=, initial_states=, dt_softplus=, dt_limit=, ...)``.
    CHUNK_ARGUMENTS = {
        "x": (0, SAME),
        "dt": (1, SAME),
        "A": (2, PARAMETER),
        "B": (3, SAME),
        "C": (4, SAME),
        "chunk_size": ("chunk_size", SAME),
        "D": ("D", PARAMETER),
        "dt_bias": ("dt_bias", PARAMETER),
        "state": ("initial_states", SAME),
        "dt_softplus": ("dt_softplus", SAME),
        "dt_limit": ("dt_limit", SAME),
        "final": ("return_final_states", SAME),
        "z": ("z", SAME),
    }
    #: ``mamba2_selective_state_update(state, x, dt, A, B, C, D, z=, dt_bias=, dt_softplus=)``: one token, per-head values
    #: expanded; ``z`` is ``None`` except on Falcon-H1 without ``mamba_rms_norm``, whose decode step gates inside the kernel.
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
        "z": ("z", ONE_TOKEN),
    }

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        labels = super(StateSpace, cls).find_labels(hf_mixer)
        modeling = modeling_of(hf_mixer)
        labels["BOUNDARY_OP"] = state_label(original_body(modeling, cls.CHUNK_FUNCTION), "new_states", in_loop=False)
        # The update itself, not the `.to(...)` copy the readout makes of it.
        labels["STEP_STATE_OP"] = bindings(original_body(modeling, cls.RECURRENT_FUNCTION), "ssm_states", in_loop=False)[0]
        return labels

    attention_queries = kernel_argument("C", "C, how each token reads the state (the queries), [batch, seq, key_heads, state_size]", GroupVectors)
    attention_keys = kernel_argument("B", "B, how each token writes the state (the keys), [batch, seq, key_heads, state_size]", GroupVectors)
    attention_values = kernel_argument("x", "x, what each token writes, [batch, seq, mixer_heads, head_dim]", HeadValues)
    dt = kernel_argument("dt", "the time step before its bias and softplus, [batch, seq, mixer_heads]", Gates)

    def _A(self) -> torch.Tensor:
        return self.record().serve("A").float()

    def log_decays(self) -> torch.Tensor:
        served = self.record().serve_all()  # Δ and A from one look-up of the record (`served_step`, `_A`)
        return served_step_size(served) * served["A"].float()

    def _decays_value(self) -> torch.Tensor:
        # Under autograd the kernel's dt is read through the served log decay, so its .grad reaches it.
        decays = self.log_decays()
        return reached_through(self, decays, decays / self._A())

    def _assign_decays(self, value: torch.Tensor) -> None:
        served = self.log_decays()
        check_tensor("`linear_attn.decays`", value, served)
        self.betas = keep_unchanged(value, served, value / self._A(), served_step(self))

    betas = DerivedEProperty(
        served_betas,
        assign=assign_step,
        description="the step size Δ = softplus(dt + dt_bias) > 0, [batch, seq, mixer_heads]; a write sets dt",
        unavailable=unreadable_call,
        annotation=Gates,
    )
    decays = DerivedEProperty(
        _decays_value,
        assign=_assign_decays,
        description="the log decay Δ·A ≤ 0 (the state is multiplied by exp of it), [batch, seq, mixer_heads]; a write sets dt",
        unavailable=unreadable_call,
        annotation=Gates,
    )
    state_input = RecurrentMixer.state_input.variant(
        "the state this call starts from, [batch, mixer_heads, head_dim, state_size], a copy (None on a fresh prompt); "
        "assign it to continue from another",
        HeadState,
    )
    state_output = RecurrentMixer.state_output.variant(
        "the state after this call's last token, [batch, mixer_heads, head_dim, state_size]", HeadState
    )
    state = RecurrentMixer.state.variant(
        "the state after the token tracer.iter pins (token 0 outside a loop), [batch, mixer_heads, head_dim, state_size]; needs chunk_per_token",
        HeadState,
    )
    states = RecurrentMixer.states.variant(
        "the state after every token of this call, [batch, seq, mixer_heads, head_dim, state_size]; needs chunk_per_token",
        HeadStates,
    )
    state_input_readout = RecurrentMixer.state_input_readout.variant(
        "the part of the scan's output read from the state entering the call (the rest of it is "
        "sum_s effective_attention[t, s] * attention_values[s]), [batch, seq, mixer_heads, head_dim]; None on a fresh prompt",
        HeadValues,
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

    def _prompt_state_shape(self, call: Call) -> tuple:
        x, B = call.serve("x"), call.serve("B")
        return (x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
