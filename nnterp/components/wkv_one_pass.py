"""WKV's ``states`` in one loop: the kernel's output and every state computed together, the kernel call skipped.

RWKV-4's kernel on CPU (``rwkv_linear_attention_cpu``) is a Python loop over
tokens, so reading its state after every token inside that loop
(`nnterp.recurrent.per_token.loop.TokenLoop`) costs one hook per token, and
computing the states again from the call's arguments would run the loop
twice. Where the call would run that loop anyway, `every_state` runs the
kernel's own equations once (`nnterp.fast.wkv.wkv_one_pass`), writing
every state into one buffer, and skips the kernel call with its return
``(output, [num, den, max])``, as the fast path does for the delta rules and
Mamba (`nnterp.recurrent.per_token.from_arguments.FromArguments._one_pass`).

It applies only to a call of two tokens or more (not a decode step) served by the token loop (the model's
default; not ``fast_states`` / ``chunk_per_token``), when ``states`` is read
before the kernel call started, with no write to a state of the call, on
float32 arguments, without autograd recording them, with one invoke covering
the batch, and with transformers' pure-torch kernel bound (no CUDA kernel, no
other binding). Everything else (a decode step, ``set_state_after``, a read
of ``state_after`` first, autograd, bfloat16, two invokes, the CUDA kernel)
stays on the token loop, unchanged.

After the one pass, ``state_after(t)`` (and ``states`` again) read the
buffer; ``set_state_after`` is refused, as after ``states`` on every path.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.calls import mediator
from ..core.errors import OrderError
from ..fast.buffers import empty_states
from ..fast.wkv import wkv_one_pass
from ..recurrent.call import order_hint
from ..recurrent.gradients import recording
from ..recurrent.kernels import bound, modeling_of, original_body, runs_pure_torch, torch_function
from ..recurrent.per_token import every_state as strategy_states
from ..recurrent.per_token import strategy_for
from ..recurrent.per_token.from_arguments import covers_the_batch
from ..recurrent.per_token.loop import TOKEN_LOOP
from .recurrent import RecurrentMixer

#: Whether ``states`` runs the one pass where it applies (``False``: the token loop always, as before).
ONE_PASS = True
#: The buffer a call's one pass filled, in its record's per-strategy data.
SERVED = "wkv_one_pass"


def _pure_torch(mixer: Any) -> bool:
    """Whether the prompt's kernel call runs transformers' own pure-torch loop."""
    modeling = modeling_of(mixer._module)
    if not runs_pure_torch(mixer) or torch_function(bound(modeling, type(mixer).CHUNK_FUNCTION)) is not original_body(modeling, type(mixer).CHUNK_FUNCTION):
        return False  # an optimized kernel, or a routed binding: not the loop this pass replaces
    return mixer.kernel_reason() is None  # the CUDA kernel, on CUDA tensors, is not the loop


def _one_pass(mixer: Any) -> torch.Tensor | None:
    """The states by the one pass, the kernel call skipped with its return; ``None`` where it does not apply."""
    if not ONE_PASS or strategy_for(mixer) is not TOKEN_LOOP or TOKEN_LOOP.unavailable(mixer) is not None:
        return None
    mediator("`linear_attn.states`")
    call = mixer.record()
    # One kernel serves prompts and steps (``call.decodes`` always holds): a one-token call (a decode step) stays.
    if call.seq < 2 or call.writes or call.strategy or call.furthest is not None:
        return None  # a step, or something per-token already read or written in this call: the loop serves it
    if call.occurrences(f"{call.op.path}.input") > call.started or not covers_the_batch() or not _pure_torch(mixer):
        return None
    decay, first, k, v = (call.serve(name) for name in ("time_decay", "time_first", "k", "v"))
    state = call.serve("state")
    inputs = (decay, first, k, v, *(state or ()))
    if any(x.dtype != torch.float32 or recording(x) for x in inputs):
        return None
    out = empty_states((k.shape[0], k.shape[1], 3, k.shape[2]), k.device)
    with torch.no_grad():
        result = wkv_one_pass(decay, first, k, v, state, out, bool(call.serve("return_state")))
    call.op.skip(result)
    call.strategy[SERVED] = out
    call.states_read = True
    call.advance(call.seq - 1, "states")
    return out


def _served(mixer: Any) -> tuple:
    """``(call, buffer)``: this call's one-pass states, or ``(call, None)`` (``call`` is ``None`` off a prompt's token loop)."""
    if strategy_for(mixer) is not TOKEN_LOOP or TOKEN_LOOP.unavailable(mixer) is not None:
        return None, None
    mediator("`linear_attn.states`")
    call = mixer.record()
    return call, call.strategy.get(SERVED)


def every_state(mixer: Any) -> torch.Tensor:
    """``states``: the buffer the one pass fills, where it applies; else the model's strategy (the token loop)."""
    _, served = _served(mixer)
    if served is not None:
        return served
    done = _one_pass(mixer)
    return done if done is not None else strategy_states(mixer)


def state_after(self: Any, t: int) -> torch.Tensor:
    call, served = _served(self)
    if served is None:
        return RecurrentMixer.state_after(self, t)
    return served[:, call.position(t, f"state_after({t})")]


def set_state_after(self: Any, t: int, value: torch.Tensor) -> None:
    _, served = _served(self)
    if served is not None:
        raise OrderError(order_hint(f"set_state_after({t}, value)", "states"))
    RecurrentMixer.set_state_after(self, t, value)


state_after.__doc__ = RecurrentMixer.state_after.__doc__
set_state_after.__doc__ = RecurrentMixer.set_state_after.__doc__

__all__ = ["every_state", "state_after", "set_state_after", "ONE_PASS"]
