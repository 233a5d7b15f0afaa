"""``support()``'s ``.grad`` rows are true: a row it serves gives a gradient, a row with a reason gives none.

For each recurrent kind, with the model as loaded, with its own per-token
setting and with the fast path, every ``linear_attn.<value>.grad`` row of the
first recurrent layer is tried in a trace with ``loss.backward()``: served,
``.grad`` is a tensor of the value's shape that is not all zero; with a
reason, the read fails (the backward pass never reaches the value). Values
that are ``None`` on a prompt (``state_input``, ``conv_state_input``,
``state_input_readout``) have nothing to differentiate there and are checked
for their reason only.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

import nnterp
from nnterp.core.errors import NnterpError
from nnterp.families import families

KINDS = tuple(sorted({f.MIXER: f.NAME for f in reversed(families()) if f.MIXER is not None}.values()))
PROMPT = "The quick brown fox jumps"
SETTINGS = ("loaded", "own", "fast")


def setting(model, name: str):
    if name == "loaded":
        return contextlib.nullcontext()
    if name == "fast":
        return nnterp.fast_states(model)
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def rows(model, layer: int) -> dict:
    found = {}
    for key, entry in model.support().items():
        if key.startswith("linear_attn.") and key.endswith(".grad"):
            name = key[len("linear_attn."):-len(".grad")]
            found[name] = entry if entry is None else entry[layer]
    return found


def read_grad(model, mix, name: str):
    """``.grad`` of value ``name`` (or of a ``set_state_after`` target) under ``loss.backward()``; raises if none reaches it."""
    with model.trace(PROMPT, **model.family.BACKWARD_KWARGS):
        if name == "set_state_after":
            value = mix.state_after(1).detach().clone().requires_grad_(True).save()
            mix.set_state_after(1, value)
        else:
            value = getattr(mix, name).save()
        loss = model.logits[0, -1].logsumexp(-1).save()
        with loss.backward():
            grad = value.grad.save()
    return value, grad


@pytest.mark.parametrize("setting_name", SETTINGS)
@pytest.mark.parametrize("model_type", KINDS)
def test_grad_rows_match_what_backward_reaches(load, model_type, setting_name):
    model = load(model_type)
    if setting_name == "fast" and model.family.MIXER.FAST is None:
        pytest.skip(f"{model.family.MIXER.__name__} has no fast path")
    layer = next(i for i, block in enumerate(model.layers) if getattr(block, "linear_attn", None) is not None)
    mix = model.layers[layer].linear_attn
    with setting(model, setting_name):
        table = rows(model, layer)
        assert "states" in table and "set_state_after" in table, sorted(table)
        checked = 0
        for name, reason in table.items():
            if name != "set_state_after":
                flags: list = []  # bound before the trace: a name first bound inside it does not outlive it
                try:
                    with torch.no_grad(), model.trace(PROMPT):
                        flags.append(getattr(mix, name) is not None)
                except NnterpError:
                    flags.append(False)
                if not flags[0]:
                    # None on a prompt: nothing to differentiate here. A served state_input.grad is checked on a trace
                    # continuing a cache instead (test_gradients_hf.py).
                    assert reason is not None or name == "state_input", f"{name}.grad is said served, but the value is not there on a prompt"
                    continue
            if reason is None:
                value, grad = read_grad(model, mix, name)
                assert grad.shape == value.shape and grad.abs().sum() > 0, (model_type, setting_name, name)
            else:
                with pytest.raises(NnterpError):  # nnterp's own error, not nnsight's OutOfOrderError
                    read_grad(model, mix, name)
            checked += 1
    assert checked >= 5


#: Every family whose prompt runs a chunked kernel that returns the final state beside its outputs.
CHUNKED = tuple(
    f.NAME for f in reversed(families())
    if f.MIXER is not None and f.MIXER.__name__ in ("LinearAttention", "KimiDeltaAttention", "StateSpace")
)


@pytest.mark.parametrize("model_type", CHUNKED)
def test_state_output_grad_under_the_chunked_kernel_is_refused_with_supports_reason(load, model_type):
    """Not nnsight's raw OutOfOrderError: nnterp's `Unavailable`, with the sentence support() lists for the row."""
    model = load(model_type)
    layer = next(i for i, block in enumerate(model.layers) if getattr(block, "linear_attn", None) is not None)
    reason = rows(model, layer)["state_output"]
    assert reason is not None and "chunked kernel" in reason
    with pytest.raises(nnterp.Unavailable) as raised:
        read_grad(model, model.layers[layer].linear_attn, "state_output")
    assert raised.value.reason == reason and "state_output.grad" in str(raised.value)
    assert not isinstance(raised.value, OutOfOrderError)
