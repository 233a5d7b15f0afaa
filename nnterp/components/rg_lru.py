"""RGLRU: RecurrentGemma's recurrent block, the Real-Gated Linear Recurrent Unit (Griffin, arXiv:2402.19427).

Mental model: every channel ``c`` of the block's ``lru_width`` keeps one
number, ``h[c]``; the whole state is ``[batch, lru_width]``, float32. The block
splits its input in two branches: ``gelu(linear_y(x))`` gates the output, and
``linear_x(x)`` runs through a causal depthwise convolution of width
``conv_width`` and then the RG-LRU, per token ``t`` (the paper's eq. for the
RG-LRU, with ``c = 8``):

    r_t = σ(W_a x_t + b_a)            (the recurrence gate, per head's block of channels)
    i_t = σ(W_x x_t + b_x)            (the input gate)
    log a_t = -c r_t softplus(Λ)      (HF's ``recurrent_param`` is Λ; a_t = σ(-Λ)^{c r_t})
    u_t = sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t)    (u_0 = i_0 ⊙ x_0 at a reset)
    h_t = ã_t ⊙ h_{t-1} + u_t,   ã_t = a_t, or 0 at a reset (position 0)
    y_t = h_t, then out = linear_out(y ⊙ gelu(linear_y(x)))

The recurrence runs in the RG-LRU's own method ``_rnn_scan(hidden_states=u,
recurrent_gate=a, reset=, recurrent_states=h_in)``, a pure-torch loop binding
the state after each token once per token (the `TokenLoop` strategy reads it
there; no kernel to route, ever). A one-token call (a decode step) takes the
method's one-step branch, whose new state is its return.

Values, in forward order, all tokens first (``seq`` is this call's tokens):

* ``lru_input`` ``[batch, seq, lru_width]``: x_t, after the convolution (the RG-LRU's input).
* ``input_gates`` / ``recurrence_gate`` ``[batch, seq, lru_width]``: i_t, r_t.
* ``decays`` ``[batch, seq, lru_width]``: log a_t ≤ 0 (writes change a_t and the normalization).
* ``recurrent_gate`` ``[batch, seq, lru_width]``: a_t as the scan takes it (a write leaves u_t as computed).
* ``attention_values`` ``[batch, seq, lru_width]``: u_t, what each token adds to the state.
* ``state_input`` ``[batch, lru_width]``: the state entering the call, ``None`` when
  the call starts at position 0 (the reset discards it: every prompt).
* ``state`` / ``states`` ``[batch, seq, lru_width]`` / ``state_after`` / ``set_state_after``: h_t
  after every token: the scan's token loop, or its arguments under ``fast_states`` (`nnterp.fast.rg_lru`).
* ``state_output`` ``[batch, lru_width]``: h after the call's last token.
* ``conv_state_input`` / ``conv_state_output`` ``[batch, lru_width, conv_width - 1]``:
  the convolution's window, kept on the block (HF's ``conv1d_state``).
* ``effective_attention`` ``[batch, lru_width, seq, seq]``: ``A[c, t, s] = ∏_{s<j≤t} ã_j[c]``,
  so ``y_t = Σ_s A[c, t, s] u_s[c]`` (+ ``state_input_readout`` on a decode step).
* ``attention_output`` ``[batch, seq, hidden]``: the block's output.

Failure mode worth knowing: transformers keeps this state ON THE MODULES (``rg_lru.recurrent_states``,
``conv1d_state``), not in a cache object, and a trace leaves there the state after its last call, as a plain
forward does. A several-token call at position > 0 reads ``recurrent_states`` but convolves over zeros:
``conv_state_input`` is ``None`` there until assigned.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from nnsight.intervention.interleaver import Mediator
from torch import Tensor

from ..core.calls import mediator, per_call, pinned
from ..core.dims import BATCH, CONV_CHANNELS, CONV_WINDOW, LRU_WIDTH, SEQ
from ..core.errors import Unavailable, UnsupportedRelease
from ..core.values import DerivedEProperty, FirstInput, check_expected, check_tensor
from ..fast import rg_lru as lru_scan
from ..recurrent.arguments import SAME
from ..recurrent.call import Call
from ..recurrent.kernels import needs_torch_kernels, signature_binding
from ..recurrent.labels import Label, bindings, call_label, state_label
from ..recurrent.per_token import strategy_for
from .recurrent import RecurrentMixer, kernel_argument

_NO_CACHE = (
    "this call runs without a cache (use_cache=False), so nothing continues from the state leaving it: run it with "
    "use_cache=True (the default of a trace and of generate); states[:, -1] is the state after its last token"
)
_NO_WINDOW = (
    "this call runs without a cache (use_cache=False), so the block keeps no convolution window: run it with "
    "use_cache=True (the default of a trace and of generate)"
)

Channels = Float[Tensor, f"{BATCH} {SEQ} {LRU_WIDTH}"]
LruState = Float[Tensor, f"{BATCH} {LRU_WIDTH}"]
LruStates = Float[Tensor, f"{BATCH} {SEQ} {LRU_WIDTH}"]
ConvWindow = Float[Tensor, f"{BATCH} {CONV_CHANNELS} {CONV_WINDOW}"]
ChannelAttention = Float[Tensor, f"{BATCH} {LRU_WIDTH} {SEQ} {SEQ}"]


def _child_class(block: type, attribute: str) -> type:
    """The class ``block.__init__`` builds at ``self.<attribute>`` (the RG-LRU), read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(block.__init__)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and any(isinstance(t, ast.Attribute) and t.attr == attribute for t in node.targets)
        ):
            return block.__init__.__globals__[node.value.func.id]
    raise UnsupportedRelease(f"{block.__qualname__}.__init__ builds no `self.{attribute}`: this transformers release moved the RG-LRU")


def _lru_value(label: str | None, name: str, description: str) -> DerivedEProperty:
    """A value inside the RG-LRU before its scan: the output of binding ``label`` (a `Label` name), or its input.

    Read and written where the RG-LRU computes it (a write feeds everything
    after it); the call's record is made first, at the block's input.
    """

    def location(envoy: RGLRU) -> str:
        where = envoy._lru_location(label)
        Call.check_reachable(where, envoy._call()["passed"][where], f"`linear_attn.{name}`", "a later value of this call (the RG-LRU had computed it)")
        return where

    def read(envoy: RGLRU) -> torch.Tensor:
        value = Mediator.value(location(envoy))
        return FirstInput().get(value) if label is None else value

    def write(envoy: RGLRU, view: Any) -> None:
        where = location(envoy)
        current = Mediator.value(where)
        what = f"`linear_attn.{name}`"
        if label is None:
            check_tensor(what, view, FirstInput().get(current))
            Mediator.swap(where, FirstInput().put(current, view))
        else:
            check_tensor(what, view, current)
            Mediator.swap(where, view)

    return DerivedEProperty(read, assign=write, description=description, annotation=Channels)


class RGLRU(RecurrentMixer):
    """RecurrentGemma's recurrent block (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock"
    #: The block's child holding the RG-LRU, and the RG-LRU's method running the recurrence.
    LRU = "rg_lru"
    SCAN_METHOD = "_rnn_scan"
    STATE_VARIABLE = "recurrent_states"
    #: No module-level kernel: nothing for route_kernels to rebind (the scan is always pure torch).
    CONV_FUNCTIONS = ()
    SEQ_ARGUMENT = "x"
    FAST, EFFECTIVE = lru_scan.FAST, lru_scan.EFFECTIVE
    VALUE_ARGUMENT, SKIP = "x", {"recurrent_gate": 1.0, "attention_values": 0.0}  # h_s = 1 · h_{s-1} + 0

    #: ``self._rnn_scan(hidden_states=u, recurrent_gate=a, reset=, recurrent_states=h_in)``, for every call.
    CHUNK_ARGUMENTS = {
        "x": ("hidden_states", SAME),
        "a": ("recurrent_gate", SAME),
        "reset": ("reset", SAME),
        "state": ("recurrent_states", SAME),
    }
    RECURRENT_ARGUMENTS = CHUNK_ARGUMENTS

    SCAN_KERNEL = Label()
    INPUT_GATE = Label()
    RECURRENCE_GATE = Label()
    LOG_DECAY = Label()

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        lru = _child_class(hf_mixer, cls.LRU)
        scan = call_label(lru.forward, f"self_{cls.SCAN_METHOD}")
        return {
            "SCAN_KERNEL": scan,
            "CHUNK_KERNEL": scan,
            "RECURRENT_KERNEL": scan,
            "CACHE_TEST": None,
            "STATE_OP": state_label(getattr(lru, cls.SCAN_METHOD), cls.STATE_VARIABLE, in_loop=True),
            "STEP_STATE_OP": None,
            "INPUT_GATE": bindings(lru.forward, "input_gate", in_loop=False)[0],
            "RECURRENCE_GATE": bindings(lru.forward, "recurrent_gate", in_loop=False)[0],
            "LOG_DECAY": bindings(lru.forward, "log_recurrent_gate", in_loop=False)[0],
        }

    @classmethod
    def loop_body(cls, modeling: Any) -> Any:
        return getattr(_child_class(getattr(modeling, cls.REFERENCE.rpartition(".")[2]), cls.LRU), cls.SCAN_METHOD)

    def _lru(self) -> Any:
        return getattr(self, self.LRU)

    def _lru_location(self, label: str | None) -> str:
        """The RG-LRU's input (``None``), or the output of the binding a `Label` named ``label`` holds."""
        lru = self._lru()
        return f"{lru.path}.input" if label is None else f"{lru.path}.source.{getattr(self, label)}.output"

    # -- which call: the scan method, decided by the call's length -----------------------

    def _call(self) -> dict:
        def read() -> dict:
            lru = self._lru()
            lru.source  # instrument the RG-LRU before it runs, whatever value is read first
            Call.check_entry(self)
            args, kwargs = self.inputs
            bound = signature_binding(type(self._module).forward, self._module, args, kwargs)
            hidden = bound.get("input_states", args[0] if args else None)
            positions = bound.get("position_ids")
            # The scan's own reset: a row at position 0 drops the state entering the call.
            resets = positions is not None and bool((positions[:, 0] == 0).all())
            med = mediator()
            started = {self.SCAN_KERNEL: med.occurrence(f"{lru.path}.source.{self.SCAN_KERNEL}.input")}
            # How often the RG-LRU's values before the scan have been passed: a later request past that is too late.
            labels = (None, "INPUT_GATE", "RECURRENCE_GATE", "LOG_DECAY")
            passed = {where: med.occurrence(where) for where in map(self._lru_location, labels)}
            # One scan method branches on the length: a one-token call is a decode step, whatever its position.
            return {
                "seq": hidden.shape[1], "continues": not resets, "use_cache": bound.get("use_cache", True),
                "kernels": started, "passed": passed, "decodes": hidden.shape[1] == 1,
            }

        return per_call(self, "inputs", read)

    def kernel_source(self) -> Any:
        # A method-call source: the RG-LRU's own scan method, called in its forward (one label, prompts and steps).
        return self._lru().source

    def kernel_function(self) -> Any:
        # The class's method on the RG-LRU module, not the module's attribute: the model is mid-run, hooked by nnsight.
        return getattr(type(self._lru()._module), self.SCAN_METHOD).__get__(self._lru()._module)

    def _decodes(self) -> bool:
        return self._call()["decodes"]

    def _prompt_state_shape(self, call: Call) -> tuple:
        x = call.serve("x")
        return (x.shape[0], x.shape[2])

    # -- the state entering and leaving the call -----------------------------------------

    def _entering(self) -> torch.Tensor | None:
        state = self.record().serve("state")
        return state.clone() if self._call()["continues"] and state is not None else None

    def _assign_entering(self, value: Any) -> None:
        call = self.record()
        what = "`linear_attn.state_input`"
        call.check_not_started(f"a write to {what}")
        if not self._call()["continues"]:
            raise Unavailable(
                f"a write to {what}", "this call starts at position 0, where the RG-LRU resets its state (the entering state is "
                "multiplied by 0): assign it on a decode step, or use set_state_after(t, value) inside the prompt"
            )
        check_expected(what, value, *call.expected)
        self.record().assign("state", value)

    state_input = DerivedEProperty(
        _entering, assign=_assign_entering,
        description="the state entering this call, [batch, lru_width], a copy (None where the call starts at position 0, "
        "which resets it: every prompt); assign it on a decode step to continue from another",
        unavailable=needs_torch_kernels, annotation=LruState, none_on_fresh_prompt=True,
    )
    def read_state_output(self) -> torch.Tensor:
        self._require_cache()
        return RecurrentMixer.read_state_output(self)

    def write_state_output(self, value: Any) -> None:
        self._require_cache()
        RecurrentMixer.write_state_output(self, value)

    def _require_cache(self) -> None:
        # The scan returns a final state either way; without a cache nothing continues from it (the next forward
        # starts over), so the state leaving the call is refused as on every mixer, and `states` serves it.
        if not self._call()["use_cache"]:
            raise Unavailable("linear_attn.state_output", _NO_CACHE)

    state_output = DerivedEProperty(
        read_state_output, assign=write_state_output,
        description="the state after this call's last token, what the next decode step starts from, [batch, lru_width]",
        unavailable=needs_torch_kernels, annotation=LruState,
    )

    # -- the state after every token: the token loop on a prompt, the return on a decode step --

    def _lru_states(self) -> torch.Tensor:
        if self._decodes():
            return self.read_state_output()[:, None]
        return strategy_for(self).states(self)

    def state_after(self, t: int) -> torch.Tensor:
        if self._decodes():
            self.record().position(t, f"state_after({t})")
            return self.read_state_output()
        return RecurrentMixer.state_after(self, t)

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        if self._decodes():
            call = self.record()
            call.position(t, f"set_state_after({t}, value)")
            check_expected(f"set_state_after({t}, value)", value, *call.expected)
            return self.write_state_output(value)
        return RecurrentMixer.set_state_after(self, t, value)

    states = DerivedEProperty(
        _lru_states, description="the state after every token of this call, [batch, seq, lru_width]",
        unavailable=lambda mixer: strategy_for(mixer).unavailable(mixer), annotation=LruStates,
    )
    state = RecurrentMixer.state.variant(
        "the state after a token of the prompt, one occurrence per token (tracer.iter; under generate, the state each step leaves), [batch, lru_width]", LruState
    )

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        # Token t+1's update with the scan's own operations (the gate masked by the reset, in float32),
        # written as the state after t+1: token t's readout keeps the state it computed.
        after = position + 1
        gate = call.serve("a")[:, after] * ~call.serve("reset")[:, after]
        with pinned(call.strategy["first"] + after):
            call.strategy["op"].output = gate.type(torch.float32) * value + call.serve("x")[:, after].type(torch.float32)

    # -- the recurrence's inputs ---------------------------------------------------------

    lru_input = _lru_value(None, "lru_input", "x_t, the RG-LRU's input after the convolution, [batch, seq, lru_width]")
    input_gates = _lru_value("INPUT_GATE", "input_gates", "i_t = sigmoid(W_x x_t + b_x), the input gate, [batch, seq, lru_width]")
    recurrence_gate = _lru_value(
        "RECURRENCE_GATE", "recurrence_gate", "r_t = sigmoid(W_a x_t + b_a), the recurrence gate, [batch, seq, lru_width]"
    )
    decays = _lru_value(
        "LOG_DECAY", "decays",
        "log a_t = -8 r_t softplus(recurrent_param) <= 0, [batch, seq, lru_width]; a write changes a_t and the "
        "input's normalization sqrt(1 - a_t^2)",
    )
    recurrent_gate = kernel_argument(
        "a", "a_t = exp(decays), the decay the scan takes, [batch, seq, lru_width]; a write leaves the written input as computed", Channels
    )
    attention_values = kernel_argument(
        "x", "u_t = sqrt(1 - a_t^2) * i_t * x_t (i_0 * x_0 at a reset), what each token adds to the state, [batch, seq, lru_width]", Channels
    )

    effective_attention = RecurrentMixer.effective_attention.variant(
        "the exact effective attention per channel A[c, t, s] = prod_{s<j<=t} a_j[c]: the scan's output at t is "
        "sum_s A[c, t, s] * attention_values[s, c] (+ state_input_readout), [batch, lru_width, seq, seq], float32; "
        "4*batch*lru_width*seq^2 bytes (effective_attention_of(positions=..., channels=...) keeps it bounded)",
        ChannelAttention,
    )
    state_input_readout = RecurrentMixer.state_input_readout.variant(
        "the part of the scan's output read from the state entering the call (None on a prompt, which resets it), "
        "[batch, seq, lru_width]",
        Channels,
    )

    def _effective(self, positions: Any, selection: Any, coefficients: bool) -> tuple:
        out, readout = RecurrentMixer._effective(self, positions, selection, coefficients)
        return out, (readout if self._call()["continues"] else None)

    # -- the convolution window, kept on the block ---------------------------------------

    def _window_entering(self) -> torch.Tensor | None:
        info, written = self._call(), per_call(self, "conv window written", dict).get("window")
        window = self._module.conv1d_state
        # A several-token call pads with zeros whatever the block holds (transformers' prefill), unless written.
        if info["seq"] != 1 or not info["use_cache"] or window is None:
            return None if written is None else written.clone()
        return window.clone()

    def _assign_window_entering(self, value: Any) -> None:
        info, block = self._call(), self._module
        what = "`linear_attn.conv_state_input`"
        if not info["use_cache"] or (info["seq"] == 1 and block.conv1d_state is None):
            raise Unavailable(f"a write to {what}", _NO_WINDOW)
        if info["seq"] == 1:
            check_tensor(what, value, block.conv1d_state)
            block.conv1d_state = value
            return
        # A prefill convolves over zeros: convolve again over the window and the input; keep the window that leaves.
        conv, module = self.conv_1d, block.conv_1d
        x = conv.input
        check_expected(what, value, (x.shape[0], x.shape[1], block.conv1d_width - 1), x.dtype, x.device)
        joined = torch.cat([value, x], -1)
        conv.output = F.conv1d(joined, module.weight, module.bias, padding=module.padding, groups=module.groups)[..., value.shape[-1]:]
        block.conv1d_state = joined[..., x.shape[-1]:]
        per_call(self, "conv window written", dict)["window"] = value

    def _window_kept(self) -> torch.Tensor:
        """The window the block keeps once this call has returned."""
        if not self._call()["use_cache"]:
            raise Unavailable("linear_attn.conv_state_output", _NO_WINDOW)
        Mediator.value(f"{self.path}.output")
        return self._module.conv1d_state

    def _window_leaving(self) -> torch.Tensor:
        return self._window_kept().clone()

    def _assign_window_leaving(self, value: Any) -> None:
        window = self._window_kept()
        check_tensor("`linear_attn.conv_state_output`", value, window)
        self._module.conv1d_state = value

    conv_state_input = DerivedEProperty(
        _window_entering, assign=_assign_window_entering, annotation=ConvWindow, none_on_fresh_prompt=True,
        description="the convolution window entering this call, [batch, lru_width, conv_width - 1], a copy (None on a "
        "several-token call, which convolves over zeros, until assigned: the call then convolves over it)",
    )
    conv_state_output = DerivedEProperty(
        _window_leaving, assign=_assign_window_leaving,
        description="the convolution window the block keeps after this call (its last conv_width - 1 inputs), "
        "[batch, lru_width, conv_width - 1]",
        annotation=ConvWindow,
    )

    def dims(self) -> dict[str, int]:
        module = self._module
        return {"lru_width": module.lru_width, "conv_channels": module.lru_width, "conv_window": module.conv1d_width - 1}
