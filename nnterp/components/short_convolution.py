"""ShortConvolution: LFM2's gated short convolution (Liquid AI, 2025; the "double-gated short convolution" block).

Mental model: a block projects its input into three channel vectors, ``B``
(input gate), ``C`` (output gate) and ``x``, and convolves the gated input
causally, channel by channel, over the last ``L`` tokens (``L = conv_width``,
``config.conv_L_cache``, 3 on the released models):

    u_t = B_t ⊙ x_t                                  (the convolution's input)
    y_t = C_t ⊙ (Σ_{i<L} w[:, i] ⊙ u_{t-L+1+i} + b)   (w: [conv_channels, L])
    o_t = out_proj(y_t)

Its only state is the convolution window, the last ``L`` inputs
``W_t = [u_{t-L+1}, ..., u_t]``, ``[batch, conv_channels, conv_width]`` (the
newest last), which the cache keeps (``cache.layers[i].conv_states[0]``) and
which a token reads as ``conv_out_t = Σ_i w[:, i] ⊙ W_t[:, i] + b``. There is
no decay, no state matrix and no recurrence beyond the window: the state after
token ``t`` is a function of the inputs ``u`` alone, so `FromArguments` computes
it exactly from the convolution's input (the kernel call's first argument), on
a prompt and on a decode step, with no routing and whatever the setting
(``STATES_FROM_ARGUMENTS``: there is no token loop or chunk boundary to read instead).

Values, in the order the forward makes them (``seq`` is this call's tokens,
one on a decode step; ``conv_channels`` is ``hidden``):

* ``input_gates`` / ``output_gates`` / ``attention_values``
  ``[batch, seq, conv_channels]``: ``B``, ``C`` and ``x`` as the forward splits
  them (``in_proj``'s output), read and written before the convolution runs.
  In the effective-attention reading ``x`` is what each token writes.
* ``conv_input`` ``[batch, seq, conv_channels]``: ``u = B ⊙ x``, as the
  convolution kernel takes it (read-only: write the gates or ``x`` instead).
* ``state_input`` ``[batch, conv_channels, conv_width]``: the window entering
  the call, a copy (``None`` on a fresh prompt, which pads with zeros);
  assign it to convolve over another window. ``state_output``: the window
  after the call's last token. They are ``conv_state_input`` /
  ``conv_state_output``, served under both names.
* ``states`` ``[batch, seq, conv_channels, conv_width]``, ``state_after(t)``,
  ``states_of(positions)``: the window after each token, float32 (exact: its
  entries are the model's own); ``set_state_after(t, window)`` splits the
  kernel call: tokens up to ``t`` run over the entering window, the rest over
  ``window`` (only tokens ``t+1 .. t+L-1`` read it), and the cache keeps the
  window after the call's last token.
* ``effective_attention`` ``[batch, conv_channels, seq, seq]``: exact, one
  banded pattern per channel, ``A[c, t, s] = w[c, L-1-(t-s)] B_s[c]`` for
  ``0 <= t - s < L``: the convolution kernel's output is ``Σ_s A[c, t, s]
  x_s[c]`` plus ``state_input_readout`` (the entering window's part and the
  bias), and ``y_t = C_t ⊙`` that (the output gate is applied after the
  kernel, as the forward does).
* ``attention_output`` ``[batch, seq, hidden]``: the block's output.

Gradients (inside ``with loss.backward():``): ``states.grad`` is the loss's
derivative by the window after each token as the later tokens read it (a
leaf the kernel's output reads through an exact zero, the spec's ``tap``); the
gates and ``attention_values`` have theirs (the forward consumes the served
tensors); a `set_state_after` target gets one. ``state_after(t)`` and a
prompt's ``state_output`` have none (computed beside the model, or only
cached): read ``states.grad[:, t]``.

Values it does not have raise `Unavailable` with the reason: ``state`` under
``tracer.iter`` (the convolution is one ``F.conv1d`` over the call, with no
location that occurs once per token). The convolution weights are weights
(``mix.conv.weight``), not values.

Failure mode worth knowing: the kernel's first argument on a prompt with a
cache is the window entering the call followed by the call's inputs (or the
inputs left-padded to ``L``), not the inputs alone; ``conv_input`` and the
states cut it to the call's own tokens (`fast_arguments`), so never index the
raw ``argument("x")`` by token position.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from nnsight.intervention.interleaver import Mediator
from torch import Tensor

from ..core.calls import forget, mediator, per_call
from ..core.dims import BATCH, CONV_CHANNELS, CONV_WIDTH, SEQ, ConvState
from ..core.errors import Unavailable
from ..core.values import DerivedEProperty, Key, check_expected
from ..fast.short_convolution import EFFECTIVE as SHORT_CONV_ATTENTION
from ..fast.short_convolution import FAST as SHORT_CONV_WINDOWS
from ..recurrent import per_token
from ..recurrent.arguments import CHANNELS_FIRST, PARAMETER, SAME
from ..recurrent.call import Call
from ..recurrent.gradients import recording
from ..recurrent.kernels import unreadable_call
from ..recurrent.labels import Label, call_label
from ..recurrent.no_cache import no_cache_reason
from .conv import conv_state_input, conv_state_output
from .recurrent import RecurrentMixer

ConvChannels = Float[Tensor, f"{BATCH} {SEQ} {CONV_CHANNELS}"]
ConvStates = Float[Tensor, f"{BATCH} {SEQ} {CONV_CHANNELS} {CONV_WIDTH}"]
#: ``[batch, conv_channels, seq, seq]``: one banded pattern per channel.
ChannelAttention = Float[Tensor, f"{BATCH} {CONV_CHANNELS} {SEQ} {SEQ}"]

#: Why `state` has no location under ``tracer.iter``.
NO_TOKEN_LOCATION = (
    "the short convolution runs over all of a call's tokens in one F.conv1d, so no location occurs once per token "
    "for tracer.iter: read `states` or state_after(t) and write set_state_after(t, window), computed from the "
    "convolution's input"
)
_NO_CACHE = (
    "this call runs without a cache, so it keeps no convolution window: run it with use_cache=True "
    "(the default of a trace and of generate)"
)


def _gate_value(index: int, description: str) -> DerivedEProperty:
    """Element ``index`` of the forward's split ``(B, C, x)``, tokens first; a write replaces it before the convolution."""
    return DerivedEProperty(
        lambda envoy: envoy._gate(index),
        assign=lambda envoy, value: envoy._assign_gate(index, value),
        description=description,
        annotation=ConvChannels,
    )


def _rows() -> slice:
    """This invoke's rows of a buffer that holds the whole batch (the cache's window)."""
    group = mediator().batch_group
    return slice(None) if group is None else slice(group[0], group[0] + group[1])


class ShortConvolution(RecurrentMixer):
    """LFM2's gated short convolution (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv"
    CHUNK_FUNCTION = "causal_conv1d_fn"
    RECURRENT_FUNCTION = "causal_conv1d_update"
    #: The kernels are the convolution's own: no other convolution to route.
    CONV_FUNCTIONS = ()
    #: The decode kernel updates the cache's window in place, once.
    ONE_STEP_DECODE = True
    SEQ_ARGUMENT = "x"
    EFFECTIVE = SHORT_CONV_ATTENTION
    #: Served by `FromArguments` whatever the setting (module docstring); a write splits the kernel call (`run_kernel`).
    FAST = SHORT_CONV_WINDOWS
    STATES_FROM_ARGUMENTS = True
    #: The kernel returns the outputs only: the forward caches the window before it runs (`leave_state`).
    FINAL_STATE = None
    VALUE_ARGUMENT = "x"
    #: The call in the forward that splits ``in_proj``'s output into ``B, C, x``.
    GATES_FUNCTION = "BCx_chunk"

    #: ``causal_conv1d_fn(x, weight, bias, activation=None)``: x is ``[window; u]`` or ``u`` padded, channel-first.
    CHUNK_ARGUMENTS = {"x": (0, CHANNELS_FIRST), "weight": (1, PARAMETER), "bias": (2, PARAMETER)}
    #: ``causal_conv1d_update(x, conv_state, weight, bias)``: one token, channel-first; the window updated in place.
    RECURRENT_ARGUMENTS = {"x": (0, CHANNELS_FIRST), "state": (1, SAME), "weight": (2, PARAMETER), "bias": (3, PARAMETER)}

    GATES_OP = Label()

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        labels = super(ShortConvolution, cls).find_labels(hf_mixer)
        labels["GATES_OP"] = call_label(hf_mixer.forward, cls.GATES_FUNCTION)
        return labels

    def continues_cache(self, cache: Any) -> bool:
        # The forward's own test: a kept window, and a cache that does not record its past. Asked of the cache's
        # layer, as every release keeps it (the cache's get_conv_state / is_recording_past are 5.21+).
        if cache is None:
            return False
        layer = cache.layers[self._module.layer_idx]
        return bool(layer.has_previous_state[0]) and not getattr(layer, "record_past", False)

    def dims(self) -> dict[str, int]:
        return {"conv_channels": self._module.conv.weight.shape[0], "conv_width": self._module.conv_kernel_size}

    def _prompt_state_shape(self, call: Call) -> tuple:
        return (call.args[0].shape[0], *self.dims().values())

    # -- the gates and the input: the forward's split of in_proj's output ----------------

    def _gates_op(self) -> Any:
        self._call()  # instruments the forward before it runs, whatever is read first
        return getattr(self.source, self.GATES_OP)

    def _gates(self) -> tuple:
        """``(B, C, x)`` of this call, tokens first, read once per call at the forward's split (and kept for later values)."""

        def read() -> tuple:
            op = self._gates_op()
            Call.check_entry(self, location=f"{op.path}.output")
            split = tuple(op.output)
            served = tuple(part.transpose(1, 2) for part in split)
            if recording(split[0]):
                # Under autograd the forward must consume the served tensors themselves (so their .grad is
                # theirs alone, not the shared in_proj output's): the same values, as copies, swapped in.
                served = tuple(part.clone() for part in served)
                op.output = tuple(part.transpose(1, 2) for part in served)
            return served

        return per_call(self, "gates", read)

    def _gate(self, index: int) -> torch.Tensor:
        return self._gates()[index]

    def _assign_gate(self, index: int, value: torch.Tensor) -> None:
        parts = list(self._gates())
        what = f"`linear_attn.{('input_gates', 'output_gates', 'attention_values')[index]}`"
        self._gates_op().output  # still at the split: the write comes before the convolution
        check_expected(what, value, tuple(parts[index].shape), parts[index].dtype, parts[index].device)
        parts[index] = value
        self._gates_op().output = tuple(part.transpose(1, 2) for part in parts)
        forget(self, "gates")
        per_call(self, "gates", lambda: tuple(parts))

    input_gates = _gate_value(0, "B, the input gate (u = B * x is convolved), [batch, seq, conv_channels]; writable before the convolution")
    output_gates = _gate_value(1, "C, the output gate (y = C * conv(u)), [batch, seq, conv_channels]; writable before the convolution")
    attention_values = _gate_value(
        2, "x, what each token writes into the window (gated by B), [batch, seq, conv_channels]; writable before the convolution"
    )

    # -- the kernel call and the windows it sees ---------------------------------------

    def record(self) -> Call:
        self._gates()  # the split comes before the kernel: read it first, so later values can use it
        call = RecurrentMixer.record(self)
        if "extended" not in call.strategy:
            # Once per call, while the worker waits at the kernel's start (the decode kernel updates the window in place).
            entry, width = self._call(), self._module.conv_kernel_size
            seq, x = entry["seq"], call.args[0]
            call.strategy["fresh"] = not call.decodes and x.shape[-1] < seq + width
            if call.decodes:
                extended = torch.cat([call.args[1].clone(), x.to(call.args[1].dtype)], dim=-1)
            elif x.shape[-1] < seq + width:
                extended = F.pad(x, (seq + width - x.shape[-1], 0))  # a fresh prompt: zeros before it
            else:
                extended = x[..., x.shape[-1] - seq - width:]
            # ``[batch, conv_channels, L + seq]``: the window entering the call, then its inputs (`fast_arguments`).
            call.seq = seq
            # The cache, where a write's window goes, and the kernel bound now, which a write's split runs.
            call.strategy.update(extended=extended, cache=entry["cache"], kernel=self.kernel_function())
        return call

    def _conv_input(self) -> torch.Tensor:
        return self.fast_arguments(self.record())["u"]

    GRADIENTLESS = {
        "conv_input": "u = B * x is served for reading, sliced from the window the kernel convolves, which is built "
        "beside it: no gradient reaches it; differentiate input_gates and attention_values, which the forward consumes",
    }

    conv_input = DerivedEProperty(
        _conv_input,
        description="u = B * x, the convolution's input (what the window keeps), [batch, seq, conv_channels]; read-only",
        unavailable=unreadable_call,
        annotation=ConvChannels,
    )

    # -- the window entering and leaving the call ----------------------------------------

    def _window(self, required: bool) -> torch.Tensor | None:
        cache = self._call()["cache"]
        if cache is None:
            if required:
                raise Unavailable("linear_attn.state_output", no_cache_reason(self, _NO_CACHE))
            return None
        layer = cache.layers[self._module.layer_idx]
        return layer.conv_states[0][_rows()] if layer.has_previous_state[0] else None

    def _state_input(self) -> torch.Tensor | None:
        if self._call()["cache"] is None:
            return None
        window = self._window(False)
        return window.clone() if window is not None else None

    def _assign_state_input(self, value: torch.Tensor) -> None:
        window = self._window(False)
        if window is None:
            raise Unavailable(
                "a write to `linear_attn.state_input`", "it is None on a fresh prompt (the convolution pads with zeros): assign it on a "
                "decode step, or use set_state_after(t, window) inside the prompt"
            )
        check_expected("`linear_attn.state_input`", value, tuple(window.shape), window.dtype, window.device)
        window.copy_(value)

    def _enter(self) -> None:
        # The record too, where the kernel call is readable: a per-token read after this one finds its arguments kept.
        self.record() if unreadable_call(self) is None else self._call()

    def read_state_output(self) -> torch.Tensor:
        self._enter()
        Mediator.value(f"{self.path}.output")
        return self._window(True).clone()

    def write_state_output(self, value: torch.Tensor) -> None:
        self._enter()
        Mediator.value(f"{self.path}.output")
        window = self._window(True)
        check_expected("`linear_attn.state_output`", value, tuple(window.shape), window.dtype, window.device)
        window.copy_(value)

    state_input = DerivedEProperty(
        _state_input, assign=_assign_state_input, annotation=ConvState, none_on_fresh_prompt=True,
        description="the convolution window entering this call, a copy (None on a fresh prompt), [batch, conv_channels, conv_width]; assign to convolve over another",
    )
    state_output = DerivedEProperty(
        read_state_output, assign=write_state_output, annotation=ConvState,
        description="the convolution window after this call's last token, [batch, conv_channels, conv_width]",
    )
    conv_state_input = conv_state_input()
    conv_state_output = conv_state_output()

    # -- `state` under tracer.iter: no location occurs once per token ------------------

    def _iterated_state(self) -> torch.Tensor:
        raise Unavailable("linear_attn.state", NO_TOKEN_LOCATION)

    state = DerivedEProperty(
        _iterated_state, assign=lambda envoy, value: envoy._iterated_state(), unavailable=lambda envoy: NO_TOKEN_LOCATION,
        annotation=ConvState,
        description="the window after a token under tracer.iter: unavailable (no per-token location); use states / state_after",
    )

    # -- the window after every token: `FromArguments` over the hooks below (`nnterp.recurrent.per_token.protocol`) --

    states = DerivedEProperty(
        per_token.every_state, key=Key(per_token.every_state, "_states"), unavailable=unreadable_call, annotation=ConvStates,
        description="the convolution window after every token of this call, [batch, seq, conv_channels, conv_width], float32",
    )  # cut from the kernel call's input: unavailable only where a hub module hides the call

    def fast_arguments(self, call: Call) -> dict:
        """What `FAST` computes the windows from (`Mixer.fast_arguments`): the convolution's input ``u`` cut to the
        call's own tokens (the kernel's holds the entering window or zeros first), its weight and bias, and the window
        entering the call (``None``: zeros, a fresh prompt)."""
        width, extended = self._module.conv_kernel_size, call.strategy["extended"]
        return {
            "u": extended[..., width:].transpose(1, 2), "weight": self._module.conv.weight.squeeze(1),
            "bias": self._module.conv.bias, "window": None if call.strategy["fresh"] else extended[..., :width],
        }

    def run_kernel(self, call: Call, lo: int, hi: int, initial: torch.Tensor | None) -> torch.Tensor:
        """The bound kernel on tokens ``[lo, hi)`` of the call over window ``initial``, its output channel-first
        (`Mixer.run_kernel`): the first part on the kernel's own input up to ``hi`` (the entering window or zeros
        first, so the joined output keeps the kernel's length), a later one on ``[initial; u[lo:hi]]``."""
        x, width = call.args[0], self._module.conv_kernel_size
        start = x.shape[-1] - call.seq  # the call's own tokens start here in the kernel's input
        part = x[..., : start + hi] if lo == 0 else torch.cat([initial.to(x.dtype), x[..., start + lo: start + hi]], dim=-1)
        out = call.strategy["kernel"](part, *call.args[1:], **call.kwargs)
        return out if lo == 0 else out[..., width:]

    def leave_state(self, call: Call, value: torch.Tensor) -> None:
        """Make ``value`` the window the cache keeps (this invoke's rows; nothing without a cache): the forward wrote
        the cache before its kernel ran, so a write's split puts the window after the last token there (`Mixer.leave_state`)."""
        if call.strategy["cache"] is not None:
            call.strategy["cache"].layers[self._module.layer_idx].conv_states[0][_rows()].copy_(value)

    # -- effective attention: from the gates and the entering window -----------------

    def effective_inputs(self) -> dict:
        """What `_effective` reads: the input gate ``B``, the convolution's weight and bias, the entering window."""
        inputs = self.fast_arguments(self.record())
        return {"B": self._gate(0), "weight": inputs["weight"], "bias": inputs["bias"], "window": inputs["window"]}

    def replay_arguments(self) -> dict:
        """What a factorized store keeps of this call (`nnterp.recurrent.replay`, by `nnterp.fast.short_convolution`'s
        names): the convolution's input ``u``, its weight and bias, the entering window (`fast_arguments`)."""
        return self.fast_arguments(self.record())

    def _effective(self, positions: Any, selection: Any, coefficients: bool) -> tuple:
        return SHORT_CONV_ATTENTION.compute(self.effective_inputs(), positions, selection, coefficients)

    effective_attention = RecurrentMixer.effective_attention.variant(
        "the exact effective attention per channel A[c, t, s] = w[c, L-1-(t-s)] B_s[c] (0 <= t-s < L): the "
        "convolution's output at t is sum_s A[c, t, s] * attention_values[s, c] (+ state_input_readout), and the "
        "block's y_t = output_gates[t] * that; "
        "[batch, conv_channels, seq, seq], float32; 4*batch*conv_channels*seq^2 bytes "
        "(effective_attention_of(positions=..., channels=...) keeps it bounded)",
        ChannelAttention,
    )
    state_input_readout = RecurrentMixer.state_input_readout.variant(
        "the part of the convolution's output read from the window entering the call (and the conv bias, where there "
        "is one), "
        "[batch, seq, conv_channels]; None on a fresh prompt",
        ConvChannels,
    )
