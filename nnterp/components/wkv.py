"""WKV: RWKV-4's time mixing (Peng et al., 2023, arXiv:2305.13048).

Mental model: every attention channel ``c`` keeps a running weighted average of the values it has seen. Token ``s``
enters with weight ``e^{k_s}``, and each later token multiplies the weights by ``e^{w}`` with ``w =
-exp(time_decay)`` (``< 0``, one decay per channel, the same at every token); the current token gets a bonus ``u``
(``time_first``) instead. In the paper's notation, per channel:

    wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t})
    a_t = e^{w} a_{t-1} + e^{k_t} v_t,   b_t = e^{w} b_{t-1} + e^{k_t}
    out_t = W_o (σ(r_t) ⊙ wkv_t)

transformers' kernel (`rwkv_linear_attention_cpu`, a loop over tokens) keeps ``a`` and ``b`` scaled by ``e^{-p}``,
with ``p`` the running maximum of the exponents, so nothing overflows. That triple is the state, served as one
tensor ``[batch, 3, channels]`` (``wkv_parts``): index 0 the scaled numerator ``a e^{-p}``, 1 the scaled
denominator ``b e^{-p}``, 2 the maximum ``p``; float32. A fresh state is ``(0, 0, -1e30)`` (the model's own initial
value).

Values, all tokens first (``seq`` is this call's tokens, one on a decode step), in forward order:

* ``conv_state_input`` ``[batch, conv_channels, 1]``: the token shift, the previous token's (normed) input that
  this call's first token mixes with (``None`` on a fresh prompt, which shifts in zeros); ``conv_channels`` is
  ``hidden``. ``conv_state_output``: the one this call leaves (its last token's).
* ``receptances`` ``[batch, seq, channels]``: ``σ(r)``, the gate on the kernel's output (HF's ``receptance`` is the
  linear map before the sigmoid).
* ``attention_keys`` / ``attention_values`` ``[batch, seq, channels]``: ``k``, ``v``.
* ``decay_rates`` ``[channels]``: the kernel's ``time_decay`` (the decay per token is ``exp(-exp(time_decay))``);
  ``bonus`` ``[channels]``: its ``time_first``, ``u``. Both are the kernel's arguments, the module's parameters as
  passed: a write changes this call only.
* ``decays`` ``[channels]``: the log decay ``w = -exp(time_decay)``, read-only.
* ``state_input`` ``[batch, wkv_parts, channels]``: the state entering the call, a copy; ``None`` on a fresh prompt
  (a state with nothing absorbed: ``b = 0``). Writable on a prompt too: the kernel takes an initial state.
* ``state`` / ``states`` ``[batch, seq, wkv_parts, channels]`` / ``state_after`` / ``set_state_after``: the state
  after every token, read in the kernel's own loop (`TokenLoop`), with no routing on CPU; ``states`` read first on
  a float32 prompt without autograd runs the kernel's loop once with every state and skips the call
  (`OWN_ONE_PASS`, run by `TokenLoop`); under ``fast_states`` computed from the kernel's arguments (``FAST``). A write at ``t`` recomputes token ``t + 1`` from the written state with the
  kernel's own operations (its output and its update), so the loop goes on from it.
* ``state_output``: the state after the call's last token; writable.
* ``effective_attention`` ``[batch, channels, seq, seq]``: the kernel's output as an average of the values, one
  pattern per channel (`nnterp.fast.wkv`), and ``state_input_readout`` ``[batch, seq, channels]``, the entering
  state's part; exact from the arguments.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output.
* ``argument(name)``: any kernel argument by its signature-table name.

Failure mode worth knowing: with transformers' CUDA WKV kernel loaded (the ``kernels`` package, on CUDA tensors) a
prompt runs with no Python loop, and the values inside it are unavailable (`kernel_reason`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ..core.calls import pinned
from ..core.dims import BATCH, CHANNELS, CONV_CHANNELS, CONV_WIDTH, SEQ, WKV_PARTS
from ..core.errors import Unavailable
from ..core.values import DerivedEProperty, Key, check_expected, check_tensor, replace_in
from ..fast import wkv as wkv_loop
from ..fast.wkv import EMPTY_MAX
from ..recurrent.arguments import PARAMETER, SAME, kernel_waiting
from ..recurrent.call import Call
from ..recurrent.gradients import graft, recording
from ..recurrent.kernels import bound, drill, modeling_of, needs_torch_kernels, original_body, torch_function
from ..recurrent.labels import Label, bindings, cache_test, call_label
from .recurrent import RecurrentMixer, kernel_argument

Channels = Float[Tensor, f"{BATCH} {SEQ} {CHANNELS}"]
PerChannel = Float[Tensor, f"{CHANNELS}"]
WkvState = Float[Tensor, f"{BATCH} {WKV_PARTS} {CHANNELS}"]
WkvStates = Float[Tensor, f"{BATCH} {SEQ} {WKV_PARTS} {CHANNELS}"]
ChannelAttention = Float[Tensor, f"{BATCH} {CHANNELS} {SEQ} {SEQ}"]
ShiftState = Float[Tensor, f"{BATCH} {CONV_CHANNELS} {CONV_WIDTH}"]

#: The kernel's loop over tokens, which the kernel calls on CPU (and without the CUDA kernel).
LOOP_FUNCTION = "rwkv_linear_attention_cpu"
_NO_STATE = (
    "this call runs without a state (use_cache=False), so its kernel neither takes nor returns one: run it with "
    "use_cache=True (the default of a trace and of generate)"
)

#: Why ``state_output.grad`` never comes: a backward pass needs ``BACKWARD_KWARGS`` (use_cache=False), which keeps none.
_NO_BACKWARD_STATE = (
    "transformers writes the state leaving a call into the model's state list in place, so autograd refuses a "
    "backward pass through a run that keeps it: a backward runs with use_cache=False (model.family.BACKWARD_KWARGS), "
    "which keeps no state; states.grad[:, -1] is the derivative by the state after the last token"
)


def _fresh(den: torch.Tensor) -> bool:
    # b > 0 once any token was absorbed (each update adds e^{k - p'} with p' >= k, or keeps b > 0).
    return bool((den == 0).all())


class WKV(RecurrentMixer):
    """RWKV-4's time mixing (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.rwkv.modeling_rwkv.RwkvSelfAttention"
    # One kernel serves a prompt and a decode step alike; on CPU it runs its token loop either way.
    CHUNK_FUNCTION = "rwkv_linear_attention"
    RECURRENT_FUNCTION = "rwkv_linear_attention"
    CONV_FUNCTIONS = ()
    STATE_VARIABLE = "max_state"
    SEQ_ARGUMENT = "k"
    FAST, EFFECTIVE = wkv_loop.FAST, wkv_loop.EFFECTIVE

    #: ``rwkv_linear_attention(time_decay, time_first, key, value, state=, return_state=)``; ``state`` is
    #: the triple ``(num, den, max)`` of ``[batch, channels]`` tensors (``None`` without a cache); ``final``
    #: (``return_state``) asks for the final state, as ``"final"`` does on every kernel.
    CHUNK_ARGUMENTS = {
        "time_decay": (0, PARAMETER),
        "time_first": (1, PARAMETER),
        "k": (2, SAME),
        "v": (3, SAME),
        "state": ("state", SAME),
        "final": ("return_state", SAME),
    }
    RECURRENT_ARGUMENTS = CHUNK_ARGUMENTS

    @staticmethod
    def OWN_ONE_PASS(arguments: dict, out: torch.Tensor) -> tuple | None:
        """Its fast path's one pass, run by its own strategy (`TokenLoop`) too: a float32 prompt, not a decode step."""
        return wkv_loop.one_pass(arguments, out)

    #: The loop's call inside the kernel, and its per-token bindings (``STATE_OP`` is ``max_state``, bound last).
    LOOP_CALL = Label()
    NUM_OP = Label()
    DEN_OP = Label()
    NUMERATOR_OP = Label()
    DENOMINATOR_OP = Label()
    #: The forward's call of ``extract_key_value`` (receptance, key, value, and the shifted state).
    EXTRACT_CALL = Label()

    @classmethod
    def loop_body(cls, modeling) -> object:
        # The prompt's kernel is the loop on CPU: the binding routing compares with is the kernel itself.
        return original_body(modeling, cls.CHUNK_FUNCTION)

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        modeling = modeling_of(hf_mixer)
        loop = original_body(modeling, LOOP_FUNCTION)
        kernel = call_label(hf_mixer.forward, cls.CHUNK_FUNCTION)

        def last(variable: str) -> str:
            return bindings(loop, variable, in_loop=True)[-1]

        return {
            "CHUNK_KERNEL": kernel,
            "RECURRENT_KERNEL": kernel,
            "CACHE_TEST": cache_test(hf_mixer.forward, required=False),
            "STATE_OP": last("max_state"),
            "STEP_STATE_OP": None,
            "LOOP_CALL": call_label(original_body(modeling, cls.CHUNK_FUNCTION), LOOP_FUNCTION),
            "NUM_OP": last("num_state"),
            "DEN_OP": last("den_state"),
            "NUMERATOR_OP": last("numerator"),
            "DENOMINATOR_OP": last("denominator"),
            "EXTRACT_CALL": call_label(hf_mixer.forward, "self_extract_key_value"),
        }

    def kernel_reason(self) -> str | None:
        modeling = modeling_of(self._module)
        if getattr(modeling, "rwkv_cuda_kernel", None) is not None and self._module.time_decay.is_cuda:
            return (
                "transformers loaded RWKV's CUDA WKV kernel (kernels-community/rwkv), which runs a prompt with no "
                "Python loop to read inside; set transformers.models.rwkv.modeling_rwkv.rwkv_cuda_kernel = None "
                "before the trace (transformers then runs its pure-torch loop, on any device), or uninstall `kernels`"
            )
        return None

    def pure_torch_kernel(self) -> bool:
        # transformers' own loop, as bound at import (not a routed binding), and not the CUDA kernel.
        if not RecurrentMixer.pure_torch_kernel(self):
            return False
        return torch_function(bound(modeling_of(self._module), self.CHUNK_FUNCTION)) is self.loop_function() and self.kernel_reason() is None

    def loop_source(self, op):
        source = drill(op)
        # Unrouted, the kernel dispatches to its loop; routed to the loop, the op is the loop itself.
        return getattr(source, self.LOOP_CALL).source if self.LOOP_CALL in source.names else source

    # -- the state: three bindings per token, served as one [batch, 3, channels] ---------

    def token_state(self, call: Call, occurrence: int | None) -> torch.Tensor:
        written = call.strategy.get("continued", {})
        if occurrence is not None and occurrence - call.strategy["first"] in written:
            return written[occurrence - call.strategy["first"]]
        source = call.strategy["source"]
        parts = []
        for label in (self.NUM_OP, self.DEN_OP, self.STATE_OP):
            with pinned(occurrence):
                parts.append(getattr(source, label).output)
        return torch.stack(parts, 1)

    def token_ops(self, call: Call, position: int) -> list:
        if position in call.strategy.get("continued", {}):
            return []  # a write's continuation computed it: served from there, whatever the run has passed
        return [getattr(call.strategy["source"], label) for label in (self.NUM_OP, self.DEN_OP, self.STATE_OP)]

    def continue_op(self, call: Call):
        return getattr(call.strategy["source"], self.NUMERATOR_OP)

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        # Token t+1 read the state after t before its own update: its readout (numerator, denominator)
        # and its update are recomputed from value with the kernel's own operations, and written there.
        after = position + 1
        num, den, top = value.unbind(1)
        key = call.serve("k")[:, after].float()
        current = call.serve("v")[:, after]
        first = call.serve("time_first")
        decay = -torch.exp(call.serve("time_decay"))
        peak = torch.maximum(top, key + first)
        e1, e2 = torch.exp(top - peak), torch.exp(key + first - peak)
        readout = (e1 * num + e2 * current, e1 * den + e2)
        peak = torch.maximum(top + decay, key)
        e1, e2 = torch.exp(top + decay - peak), torch.exp(key - peak)
        state = (e1 * num + e2 * current, e1 * den + e2, peak)
        source = call.strategy["source"]
        labels = (self.NUMERATOR_OP, self.DENOMINATOR_OP, self.NUM_OP, self.DEN_OP, self.STATE_OP)
        for label, element in zip(labels, (*readout, *state)):
            with pinned(call.strategy["first"] + after):
                getattr(source, label).output = element
        call.strategy.setdefault("continued", {})[after] = torch.stack(state, 1)

    def fresh_state(self) -> torch.Tensor:
        state = RecurrentMixer.fresh_state(self)
        return state.index_fill(1, torch.tensor([2], device=state.device), EMPTY_MAX)  # (0, 0, the kernel's empty max)

    def _prompt_state_shape(self, call: Call) -> tuple:
        key = call.serve("k")
        return (key.shape[0], 3, key.shape[2])

    # -- the state entering and leaving the call --------------------------------------------

    def _state_input(self) -> torch.Tensor | None:
        state = self.record().serve("state")
        if state is None or _fresh(state[1]):
            return None
        return torch.stack([part.float() for part in state], 1)

    def _assign_state_input(self, value: torch.Tensor) -> None:
        call = self.record()
        what = "`linear_attn.state_input`"
        call.check_not_started(f"a write to {what}")
        check_expected(what, value, *call.expected)
        if call.serve("state") is None:
            raise Unavailable(f"a write to {what}", _NO_STATE)
        self.record().assign("state", tuple(value.unbind(1)))

    def _final(self, call: Call) -> tuple:
        output = call.op.output
        if not isinstance(output, tuple) or output[1] is None:
            raise Unavailable("linear_attn.state_output", _NO_STATE)
        return output

    def read_state_output(self) -> torch.Tensor:
        return torch.stack(list(self._final(self.record())[1]), 1)

    def write_state_output(self, value: torch.Tensor) -> None:
        call = self.record()
        output = self._final(call)
        check_tensor("`linear_attn.state_output`", value, torch.stack(list(output[1]), 1))
        call.op.output = replace_in(output, 1, list(value.unbind(1)))

    state_input = DerivedEProperty(
        _state_input, assign=_assign_state_input, key=RecurrentMixer.kernel("inputs"),
        description="the WKV state entering this call, [batch, wkv_parts, channels] (numerator, denominator, max), a "
        "copy; None on a fresh prompt; assign it to continue from another",
        unavailable=needs_torch_kernels, annotation=WkvState, none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        read_state_output, assign=write_state_output, key=RecurrentMixer.kernel("output"),
        description="the WKV state after this call's last token, [batch, wkv_parts, channels]",
        unavailable=needs_torch_kernels, annotation=WkvState,
    )
    state = RecurrentMixer.state.variant(
        "the WKV state after a token, one occurrence per token (tracer.iter), [batch, wkv_parts, channels]", WkvState
    )
    states = RecurrentMixer.states.variant("the WKV state after every token of this call, [batch, seq, wkv_parts, channels]", WkvStates)

    effective_attention = RecurrentMixer.effective_attention.variant(
        "the exact effective attention per channel A[c, t, s]: the kernel's output (before the receptance gate) at t "
        "is sum_s A[c, t, s] * attention_values[s, c] (+ state_input_readout), a weighted average; [batch, channels, "
        "seq, seq], float32, 4*batch*channels*seq^2 bytes (effective_attention_of(positions=..., channels=...))",
        ChannelAttention,
    )
    state_input_readout = RecurrentMixer.state_input_readout.variant(
        "the part of the kernel's output read from the state entering the call, [batch, seq, channels]; None on a "
        "fresh prompt",
        Channels,
    )

    def gradients(self) -> dict[str, str | None]:
        reasons = RecurrentMixer.gradients(self)
        if reasons.get("state_output") is None:
            reasons["state_output"] = _NO_BACKWARD_STATE
        return reasons

    # -- the kernel's arguments and the gate ----------------------------------------------------

    def _extract(self):
        self._call()  # instruments the forward before it runs
        return getattr(self.source, self.EXTRACT_CALL)

    def _receptance(self) -> torch.Tensor:
        return self._extract().output[0]

    def _assign_receptance(self, value: torch.Tensor) -> None:
        op = self._extract()
        output = op.output
        check_tensor("`linear_attn.receptances`", value, output[0])
        op.output = replace_in(output, 0, value)

    receptances = DerivedEProperty(
        _receptance, assign=_assign_receptance,
        key=Key(lambda envoy: f"source.{envoy.EXTRACT_CALL}.output", "extract_key_value.output"),
        description="the receptance gate sigma(r) on the kernel's output (the forward multiplies it in after the "
        "kernel), [batch, seq, channels]",
        unavailable=needs_torch_kernels, annotation=Channels,
    )
    attention_keys = kernel_argument("k", "k, each token's log weight in the average, [batch, seq, channels]", Channels)
    attention_values = kernel_argument("v", "v, what each token writes, [batch, seq, channels]", Channels)
    decay_rates = kernel_argument("time_decay", "the decay's rate (the decay per token is exp(-exp(time_decay))), [channels]", PerChannel)
    bonus = kernel_argument("time_first", "u, the current token's bonus (its weight is e^(u + k)), [channels]", PerChannel)
    def _decays(self) -> torch.Tensor:
        rate = self.record().serve("time_decay")
        decays = -torch.exp(rate.float())
        if recording(decays) and kernel_waiting(self):
            # Under autograd the kernel reads its time_decay through the served decays (an exact zero added).
            self.record().assign("time_decay", graft(decays, torch.log(-decays), rate))
        return decays

    decays = DerivedEProperty(
        _decays, description="the log decay per token w = -exp(time_decay) < 0, [channels]",
        unavailable=needs_torch_kernels, annotation=PerChannel,
    )

    # -- the token shift, a window of one token ----------------------------------------------

    def _shift(self, state: list) -> torch.Tensor:
        return state[1][:, :, self._module.layer_id]

    def _entering_state(self) -> list:
        state = self._call_state()
        if state is None:
            raise Unavailable("linear_attn.conv_state_input", _NO_STATE)
        return state

    def _call_state(self) -> list | None:
        return self._call()["arguments"].get("state")

    def _shift_input(self) -> torch.Tensor | None:
        state = self._entering_state()
        if _fresh(state[3][:, :, self._module.layer_id]):
            return None
        return self._shift(state).clone()[..., None]

    def _assign_shift_input(self, value: torch.Tensor) -> None:
        state = self._entering_state()
        check_tensor("`linear_attn.conv_state_input`", value, self._shift(state)[..., None])
        # extract_key_value reads this slice, then overwrites it with the call's last token.
        self._shift(state).copy_(value[..., 0])

    def _leaving_shift(self) -> torch.Tensor:
        output = self.output
        if not isinstance(output, tuple) or output[1] is None:
            raise Unavailable("linear_attn.conv_state_output", _NO_STATE)
        return self._shift(output[1])

    def _shift_output(self) -> torch.Tensor:
        return self._leaving_shift().clone()[..., None]

    def _assign_shift_output(self, value: torch.Tensor) -> None:
        window = self._leaving_shift()
        check_tensor("`linear_attn.conv_state_output`", value, window[..., None])
        window.copy_(value[..., 0])

    conv_state_input = DerivedEProperty(
        _shift_input, assign=_assign_shift_input,
        description="the token shift entering this call: the previous token's normed input, [batch, conv_channels, 1] "
        "(None on a fresh prompt, which shifts in zeros)",
        annotation=ShiftState, none_on_fresh_prompt=True,
    )
    conv_state_output = DerivedEProperty(
        _shift_output, assign=_assign_shift_output,
        description="the token shift leaving this call: its last token's normed input, [batch, conv_channels, 1]",
        annotation=ShiftState,
    )

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "channels": module.attention_hidden_size,
            "wkv_parts": 3,
            "conv_channels": module.config.hidden_size,
            "conv_width": 1,
        }
