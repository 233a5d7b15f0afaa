"""SelectiveScan: Mamba-1's selective state-space mixer (Gu & Dao, 2023, arXiv:2312.00752).

Mental model: every inner channel ``d`` keeps a state vector of ``state_size``
numbers, ``h[d]`` (the whole state is ``[channels, state_size]``). Each token
decays it and writes its input there, with a step size Δ chosen from the
token itself (the "selective" part):

    Δ_t = softplus(dt_t + dt_bias)                 (the betas, [channels])
    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t    (log decay Δ_t A: the decays)
    y_t = h_t C_t + D ⊙ x_t,  gated by silu(z_t)

In the state-space / attention duality (Dao & Gu, 2024) ``C`` reads the state
as queries do, ``B`` writes it as keys do and ``x`` is what is written, so
they are served as ``attention_queries``, ``attention_keys`` and
``attention_values``.

Values, all tokens first (``seq`` is this call's tokens, one on a decode step):

* ``attention_values`` ``[batch, seq, channels]``: x, after the convolution.
* ``attention_keys`` / ``attention_queries`` ``[batch, seq, state_size]``: B, C.
* ``dt`` ``[batch, seq, channels]``: the time step before the bias and softplus.
* ``betas`` ``[batch, seq, channels]``: Δ, computed as the kernel computes it;
  an assignment is written back as ``dt``.
* ``decays`` ``[batch, seq, channels, state_size]``: the *log* decay Δ·A (≤ 0);
  the state is multiplied by ``decays.exp()``. Read-only.
* ``state_input`` ``[batch, channels, state_size]``: the state entering a decode
  step, a copy; ``None`` on a prompt, since transformers' prompt kernel always
  starts from zeros (so does a multi-token continuation of a cache). Under
  ``fast_states(model)`` a prompt's is assignable (before any other value of
  the call): the fast path serves the call from it, the kernel run from zeros
  plus what the state contributes (``SCAN.resume``), and reads it back.
* ``state_output``: the state after the call's last token; writable.
* ``state`` / ``states`` ``[batch, seq, channels, state_size]`` /
  ``state_after`` / ``states_of`` / ``set_state_after``: the state after every
  token (`RecurrentMixer`); the prompt kernel is itself the token loop, once
  routed; or from the kernel's arguments with ``fast_states(model)``
  (`nnterp.fast.selective_scan`), where a write splits the kernel call and adds
  the written state's contribution to the second part (the kernel always
  starts from zeros).
* ``conv_state_input`` / ``conv_state_output`` ``[batch, channels, conv_width]``.
* ``effective_attention`` ``[batch, channels, seq, seq]``: one pattern per
  channel, ``A[d, t, s] = silu(z_t[d]) (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j[d]
  A[d, n]) Δ_s[d] + D[d] δ_ts)``, so the kernel's output (skip and gate
  included) is ``Σ_s A[d, t, s] x_s[d]``, plus ``state_input_readout``
  ``[batch, seq, channels]`` on a decode step. Big: ``4 · batch · channels ·
  seq²`` bytes (6 GB for Mamba-130m's 1536 channels over 1000 tokens);
  ``effective_attention_of(positions=, channels=)`` keeps it bounded.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output.
* ``argument(name)``: any kernel argument by its signature-table name (``"z"``, ``"D"``, ``"A"``, ...).

Failure mode worth knowing: the kernels are channel-first (``[batch,
channels, seq]``) and the decode kernel has no sequence axis; every value is
served tokens first and laid back on write, so never transpose what you read.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ..core.calls import mediator, pinned
from ..core.dims import BATCH, CHANNELS, SEQ, STATE_SIZE
from ..core.errors import NnterpError
from ..core.values import DerivedEProperty
from ..fast.selective_scan import EFFECTIVE as SCAN_ATTENTION
from ..fast.selective_scan import FAST as SCAN
from ..recurrent import per_token
from ..recurrent.arguments import (
    CHANNELS_FIRST,
    ONE_TOKEN,
    PARAMETER,
    SAME,
    assign_step,
    kernel_waiting,
    served_betas,
    served_step,
)
from ..recurrent.call import Call
from ..recurrent.gradients import on_the_path, recording
from ..recurrent.kernels import drill, modeling_of, unreadable_call
from ..recurrent.labels import Label, call_label
from ..recurrent.per_token.from_arguments import FROM_ARGUMENTS
from ..recurrent.per_token.loop import needs_recurrent_routing
from .conv import conv_state_input, conv_state_output
from .recurrent import RecurrentMixer, kernel_argument

Channels = Float[Tensor, f"{BATCH} {SEQ} {CHANNELS}"]
StateVectors = Float[Tensor, f"{BATCH} {SEQ} {STATE_SIZE}"]
ScanState = Float[Tensor, f"{BATCH} {CHANNELS} {STATE_SIZE}"]
ScanStates = Float[Tensor, f"{BATCH} {SEQ} {CHANNELS} {STATE_SIZE}"]
#: ``[batch, channels, seq, seq]``: one effective attention pattern per channel.
ChannelAttention = Float[Tensor, f"{BATCH} {CHANNELS} {SEQ} {SEQ}"]


class SelectiveScan(RecurrentMixer):
    """A Mamba-1 mixer (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.mamba.modeling_mamba.MambaMixer"
    CHUNK_FUNCTION = "mamba_selective_scan"
    RECURRENT_FUNCTION = "mamba_selective_state_update"
    STATE_VARIABLE = "ssm_state"
    #: The decode kernel updates the state once, while the prompt's pure-torch kernel is itself the token loop.
    ONE_STEP_DECODE = True
    SEQ_ARGUMENT = "x"
    #: The forward feeds x (after the convolution) to x_proj as well as to the kernel (`RecurrentMixer.SHARED_ARGUMENTS`).
    SHARED_ARGUMENTS = True
    EFFECTIVE = SCAN_ATTENTION
    #: The fast path (`nnterp.fast.selective_scan`); the prompt kernel takes no initial state, so writes use ``SCAN.resume``.
    FAST = SCAN
    VALUE_ARGUMENT = "x"
    SKIP = {"betas": 0.0}  # Δ_s = 0: no decay, no write

    #: ``mamba_selective_scan(x, dt, A, B, C, D=, z=, delta_bias=, delta_softplus=, ...)``, channel-first.
    CHUNK_ARGUMENTS = {
        "x": (0, CHANNELS_FIRST),
        "dt": (1, CHANNELS_FIRST),
        "A": (2, PARAMETER),
        "B": (3, CHANNELS_FIRST),
        "C": (4, CHANNELS_FIRST),
        "D": ("D", PARAMETER),
        "z": ("z", CHANNELS_FIRST),
        "dt_bias": ("delta_bias", PARAMETER),
        "dt_softplus": ("delta_softplus", SAME),
        "final": ("return_last_state", SAME),
    }
    #: ``mamba_selective_state_update(state, x, dt, A, B, C, D, z=, dt_bias=, dt_softplus=)``, one token.
    RECURRENT_ARGUMENTS = {
        "state": (0, SAME),
        "x": (1, ONE_TOKEN),
        "dt": (2, ONE_TOKEN),
        "A": (3, PARAMETER),
        "B": (4, ONE_TOKEN),
        "C": (5, ONE_TOKEN),
        "D": (6, PARAMETER),
        "z": ("z", ONE_TOKEN),
        "dt_bias": ("dt_bias", PARAMETER),
        "dt_softplus": ("dt_softplus", SAME),
    }

    attention_queries = kernel_argument("C", "C, how each token reads the state (the queries), [batch, seq, state_size]", StateVectors)
    attention_keys = kernel_argument("B", "B, how each token writes the state (the keys), [batch, seq, state_size]", StateVectors)
    attention_values = kernel_argument("x", "x, what each token writes (after the convolution), [batch, seq, channels]", Channels)
    dt = kernel_argument("dt", "the time step before its bias and softplus, [batch, seq, channels]", Channels)

    #: The prompt kernel's ``torch.exp(A * Δ)``, whose input is the log decay (``None`` where the kernel has none).
    DECAY_OP = Label()

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        labels = super(SelectiveScan, cls).find_labels(hf_mixer)
        try:
            labels["DECAY_OP"] = call_label(cls.loop_body(modeling_of(hf_mixer)), "torch_exp")
        except NnterpError:
            labels["DECAY_OP"] = None
        return labels

    def log_decays(self) -> torch.Tensor:
        # The kernel's exp(A[None, :, None, :] * Δ[..., None]), tokens first.
        return served_step(self)[..., None] * self.record().serve("A").float()

    def _decays_value(self) -> torch.Tensor:
        """The log decays; under autograd, the very tensor the prompt kernel exponentiates (so .grad reaches it)."""
        call = self.record()
        if recording(self.record().serve("dt")) and not call.decodes and self.DECAY_OP is not None and kernel_waiting(self):
            if needs_recurrent_routing(self) is None:
                node = getattr(drill(call.op), self.DECAY_OP)
                with pinned(mediator().occurrence(f"{node.path}.input")):
                    args, _ = node.inputs
                return on_the_path(args[0].transpose(1, 2))  # [batch, channels, seq, state] -> tokens first
        return self.log_decays()

    betas = DerivedEProperty(
        served_betas,
        assign=assign_step,
        description="the step size Δ = softplus(dt + dt_bias) > 0, [batch, seq, channels]; a write sets dt",
        unavailable=unreadable_call,
        annotation=Channels,
    )
    decays = DerivedEProperty(
        _decays_value,
        description="the log decay Δ·A ≤ 0 (the state is multiplied by exp of it), [batch, seq, channels, state_size]",
        unavailable=unreadable_call,
        annotation=ScanStates,
    )
    def _starts_by_fast_path(self) -> bool:
        """Whether this call is a prompt under `fast_states`, whose entering state nnterp writes (the kernel takes none)."""
        return per_token.strategy_for(self) is FROM_ARGUMENTS and not self.record().decodes

    def _state_input(self) -> torch.Tensor | None:
        return FROM_ARGUMENTS.state_input(self) if self._starts_by_fast_path() else RecurrentMixer._state_input(self)

    def _assign_state_input(self, value: torch.Tensor) -> None:
        if self._starts_by_fast_path():
            FROM_ARGUMENTS.set_state_input(self, value)
        else:
            RecurrentMixer._assign_state_input(self, value)

    state_input = DerivedEProperty(
        _state_input, assign=_assign_state_input, key=RecurrentMixer.kernel("inputs"),
        description="the state entering this call, [batch, channels, state_size], a copy: on a decode step the cache's; "
        "on a prompt None (the kernel starts from zeros), or under nnterp.fast_states(model) the one assigned; assign "
        "it on a decode step, or on a prompt under fast_states (before any other value of the call), to continue "
        "from another",
        unavailable=unreadable_call, annotation=ScanState, none_on_fresh_prompt=True,
    )
    state_output = RecurrentMixer.state_output.variant("the state after this call's last token, [batch, channels, state_size]", ScanState)
    state = RecurrentMixer.state.variant(
        "the state after a token of the prompt, one occurrence per token (tracer.iter; under generate, the state each step leaves), [batch, channels, state_size]", ScanState
    )
    states = RecurrentMixer.states.variant("the state after every token of this call, [batch, seq, channels, state_size]", ScanStates)
    effective_attention = RecurrentMixer.effective_attention.variant(
        "the exact effective attention per channel A[c, t, s]: the kernel's output (skip D and gate silu(z) included) "
        "at t is sum_s A[c, t, s] * attention_values[s, c], [batch, channels, seq, seq], float32; big: "
        "4*batch*channels*seq^2 bytes (effective_attention_of(positions=..., channels=...) keeps it bounded)",
        ChannelAttention,
    )
    state_input_readout = RecurrentMixer.state_input_readout.variant(
        "the part of the kernel's output read from the state entering a decode step (None on a prompt, which starts "
        "from zeros), [batch, seq, channels]",
        Channels,
    )
    conv_state_input = conv_state_input()
    conv_state_output = conv_state_output()

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "channels": module.intermediate_size,
            "state_size": module.ssm_state_size,
            "conv_channels": module.intermediate_size,
            "conv_width": module.conv_kernel_size,
        }

    def _prompt_state_shape(self, call: Call) -> tuple:
        x, A = call.serve("x"), call.serve("A")
        return (x.shape[0], x.shape[2], A.shape[1])

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        # Token t+1's update, exp(Δ A) ⊙ h + (Δ x) ⊗ B, computed from value with the
        # kernel's own operations, is written as the state after t+1: token t's
        # readout keeps the state it computed, and the loop goes on from there.
        after = position + 1
        step = served_step(self)[:, after]  # [batch, channels]
        decay = torch.exp(self.record().serve("A")[None] * step[..., None])
        write = step[..., None] * self.record().serve("B")[:, after, None, :].float() * self.record().serve("x")[:, after, :, None].float()
        with pinned(call.strategy["first"] + after):
            call.strategy["op"].output = decay * value + write
