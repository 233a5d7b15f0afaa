"""Which of a recurrent mixer's values carry a gradient: ``support()``'s ``linear_attn.<value>.grad`` rows.

nnsight serves ``x.grad`` inside ``with loss.backward():`` by hooking the
tensor ``x``, so a value has a gradient exactly when the loss was computed
through it (`nnterp.recurrent.gradients` makes views, computed values and the
per-token states so). A served value the model does not read has none, and
its ``.grad`` fails with nnsight's ``OutOfOrderError`` ("requested but the
model already ran past it") once the backward pass ends without reaching it.
`gradient_reasons` says, per value and per the live settings, which case
holds, and why (a component adds its own gradient-less values in
``GRADIENTLESS``, value name -> reason): `RecurrentMixer.gradients` returns it, and ``support()`` lists
it beside the values.

The ``set_state_after.grad`` row is the gradient of a ``set_state_after(t,
target)`` target (``target.grad``): the derivative by the state after ``t`` as
the tokens after it read it, served wherever ``set_state_after`` is.
"""

from __future__ import annotations

from typing import Any

from .per_token import FromArguments, strategy_for
from .per_token.loop import needs_recurrent_routing

ANALYSIS = (
    "computed for analysis from the kernel call's arguments; the model never reads it, so no gradient of a loss on "
    "the model's outputs reaches it (differentiate the arguments it is computed from, or a loss computed from it)"
)
COPY = "served as a copy of what the kernel reads, so that reading it cannot alias the cache; no gradient reaches the copy"
WINDOW_LEAVING = (
    "the window leaving the call is kept for the next call and nothing in this call reads it, so no gradient of this "
    "call's outputs reaches it"
)
FAST_STATES = (
    "the fast path (fast_states) computes the states beside the kernel, which never reads them, so a loss on the "
    "model's outputs does not reach them: read states.grad under the model's own per-token setting "
    "(route_kernels(family, 'torch'); chunk_per_token(model) on Mamba-2), or .grad of a set_state_after target, "
    "which the fast path serves"
)
FINAL_STATE = (
    "a prompt's chunked kernel returns its final state beside its outputs, which do not read it, so no gradient "
    "reaches it: states.grad[:, -1] is the derivative by the state after the last token, and state_output.grad is "
    "served once the token loop runs the prompt (route_kernels(family, 'torch'); chunk_per_token(model) on Mamba-2)"
)

#: Values no gradient of the model's outputs reaches, whatever the settings.
NEVER = {
    "effective_attention": ANALYSIS,
    "state_input_readout": ANALYSIS,
    "state_input": COPY,
    "conv_state_input": COPY,
    "conv_state_output": WINDOW_LEAVING,
}
#: Not a row: ``state`` under ``tracer.iter`` is one token's ``states``.
SKIPPED = ("state",)


def gradient_reasons(mixer: Any, through_kernel: bool = False) -> dict[str, str | None]:
    """``value name -> None`` (its ``.grad`` is served now) or why not; plus ``set_state_after`` (its target's).

    ``through_kernel``: whether the mixer's ``state_input`` is one the kernel reads through under autograd
    (`nnterp.recurrent.call.Call.state_input`, not a one-step decode's buffer), so its ``.grad`` is served.
    """
    reasons: dict[str, str | None] = {}
    for name, value in type(mixer).values().items():
        if name in SKIPPED:
            continue
        reason = value.reason(mixer)
        if reason is None and name == "state_input" and through_kernel:
            pass  # read through the served copy under autograd (Call.state_input)
        elif reason is None:
            reason = type(mixer).GRADIENTLESS.get(name, NEVER.get(name))
        # A fast path that taps its states (its spec's `tap`) serves states.grad: the call's output reads them through
        # an exact zero.
        if reason is None and name == "states" and isinstance(strategy_for(mixer), FromArguments):
            reason = FAST_STATES if type(mixer).FAST.tap is None else None
        if reason is None and name == "state_output" and needs_recurrent_routing(mixer) is not None:
            reason = FINAL_STATE
        reasons[name] = reason
    # A write's target is read wherever the states are served (a component serving them its own way included).
    states = type(mixer).values().get("states")
    reasons["set_state_after"] = states.reason(mixer) if states is not None else strategy_for(mixer).unavailable(mixer)
    return reasons


__all__ = ["gradient_reasons", "NEVER", "ANALYSIS", "COPY", "WINDOW_LEAVING", "FAST_STATES", "FINAL_STATE"]
