"""Gradients through served values: ``.grad`` inside ``with loss.backward():`` on every recurrent kind.

Oracles: the values are the same bit for bit with autograd on; a gradient's
directional derivative matches central finite differences of the same loss
measured by writing the value (``set_state_after``, an assignment); a derived
value's gradient matches the chain rule from the one it is computed from.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp.families import REGISTRY, families
from nnterp.recurrent.gradients import VIEW_MARK
from nnterp.recurrent.per_token import from_arguments

#: The first family of each distinct recurrent mixer.
KINDS = tuple(sorted({family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}.values()))
PROMPT = "The quick brown fox jumps over"


def per_token(model):
    """The model's per-token setting: routed kernels, or chunk_per_token on Mamba-2."""
    if model.family.MIXER.CHUNKED_SCAN:
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def recurrent(model):
    return [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]


def metric(model):
    logits = model.logits[0, -1]
    return logits.log_softmax(-1)[3] + 0.1 * logits.logsumexp(-1)


@pytest.fixture(scope="module", params=KINDS)
def model(request, load):
    return load(request.param)


def ids_of(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


def central_difference(model, ids, write) -> list:
    """``(metric(+eps) - metric(-eps)) / 2 eps`` for eps in `STEPS`, where ``write(eps)`` writes inside a trace."""
    found = []
    for eps in STEPS:
        values = []
        for sign in (1, -1):
            with torch.no_grad(), model.trace(ids):
                write(sign * eps)
                values.append(metric(model).save())
        found.append(float((values[0] - values[1]) / (2 * eps)))
    return found


#: Finite-difference steps: float32 noise grows as a step shrinks, curvature as it grows; one must agree.
STEPS = (1e-2, 3e-3)


def agrees(analytic: float, numeric: list, scale: float) -> bool:
    return any(abs(analytic - n) <= 3e-2 * abs(n) + 1e-6 * scale / eps for n, eps in zip(numeric, STEPS))


def test_states_grad_matches_finite_differences(model, monkeypatch):
    check_states_grad(model, per_token(model), monkeypatch)


#: The kinds whose fast path serves ``states.grad`` (a spec with a ``tap``: an exact zero through which the call's
#: output reads the states).
TAPPED = [t for t in KINDS if REGISTRY[t].MIXER.FAST is not None and REGISTRY[t].MIXER.FAST.tap is not None]


@pytest.mark.parametrize("model_type", TAPPED)
def test_fast_states_grad_matches_finite_differences(load, model_type, monkeypatch):
    model = load(model_type)
    with nnterp.fast_states(model):
        assert model.layers[recurrent(model)[0]].linear_attn.gradients()["states"] is None, "support() says no states.grad"
    check_states_grad(model, nnterp.fast_states(model), monkeypatch)


@pytest.mark.parametrize("model_type", TAPPED)
def test_tapped_states_read_twice_add_their_zero_once(load, model_type):
    # A second `states` read in the call serves the same leaf, its zero added to the output once: both reads' gradient
    # is a single read's (checked by finite differences above), not twice it, and the logits are the same bits.
    model = load(model_type)
    ids, mix = ids_of(model), model.layers[recurrent(model)[0]].linear_attn
    with nnterp.fast_states(model):
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            states = mix.states.save()
            logits = model.logits.save()
            loss = metric(model).save()
            with loss.backward():
                grad = states.grad.save()
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            first = mix.states.save()
            second = mix.states.save()
            twice = model.logits.save()
            loss = metric(model).save()
            with loss.backward():
                first_grad, second_grad = first.grad.save(), second.grad.save()
    assert torch.equal(twice.detach(), logits.detach()) and torch.equal(second.detach(), states.detach())
    assert grad.abs().sum() > 0
    torch.testing.assert_close(first_grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(second_grad, grad, rtol=0, atol=0)


def check_states_grad(model, setting, monkeypatch):
    """``states.grad`` under ``setting`` against central differences of ``set_state_after`` at two tokens."""
    # Without autograd the mLSTM's and lightning attention's states reads skip their backend or block loop by a one
    # pass, equal to rounding, not bit for bit: the bits compared here are the model's own both times.
    monkeypatch.setattr(from_arguments, "ONE_PASS", False)  # every one pass: the fast path's, the mLSTM's, WKV's, lightning's
    ids = ids_of(model)
    layer = recurrent(model)[0]
    mix = model.layers[layer].linear_attn
    with setting:
        with torch.no_grad(), model.trace(ids):
            plain = mix.states.save()
            plain_logits = model.logits.save()
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            states = mix.states.save()
            logits = model.logits.save()
            loss = metric(model).save()
            with loss.backward():
                grad = states.grad.save()
        assert torch.equal(states.detach(), plain), "the states change with autograd on"
        assert torch.equal(logits.detach(), plain_logits), "the logits change with autograd on"
        assert grad.shape == states.shape and grad[:, :-1].abs().sum() > 0
        generator = torch.Generator().manual_seed(0)
        for t in (1, ids.shape[1] - 3):
            direction = torch.randn(plain[:, t].shape, generator=generator) * plain[:, t].abs().mean()
            numeric = central_difference(model, ids, lambda e, t=t, d=direction: mix.set_state_after(t, plain[:, t] + e * d))
            analytic = float((grad[:, t] * direction).sum())
            assert agrees(analytic, numeric, float(abs(loss))), (model.family.NAME, t, analytic, numeric)


@pytest.mark.parametrize("name", ["attention_queries", "attention_keys", "attention_values", "decays", "betas", "dt"])
def test_argument_grad_matches_finite_differences(model, name):
    ids = ids_of(model)
    mix = model.layers[recurrent(model)[0]].linear_attn
    if name not in type(mix).values() or mix.support()[name] is not None:
        pytest.skip(f"{type(mix).__name__} serves no {name}")
    with model.trace(ids, **model.family.BACKWARD_KWARGS):
        value = getattr(mix, name).save()
        loss = metric(model).save()
        with loss.backward():
            grad = value.grad.save()
    assert grad.shape == value.shape and grad.abs().sum() > 0
    if not type(mix).values()[name].writable:
        pytest.skip(f"{name} is read-only here: checked by the chain rule instead")
    # Relative to each entry, so a positive value (β, Δ) stays positive.
    direction = torch.randn(value.shape, generator=torch.Generator().manual_seed(1)) * value.detach()
    numeric = central_difference(model, ids, lambda e: setattr(mix, name, value.detach() + e * direction))
    analytic = float((grad * direction).sum())
    assert agrees(analytic, numeric, float(abs(loss))), (model.family.NAME, name, analytic, numeric)


def test_mamba_decays_grad_reaches_A(load):
    # Mamba-1's log decay D = Δ ⊗ A is the kernel's only use of A: dL/dA[c, n] = Σ_{b, s} dL/dD[b, s, c, n] · Δ[b, s, c].
    model = load("mamba")
    mix = model.layers[0].linear_attn
    with model.trace(ids_of(model)):
        A = mix.argument("A").save()
        betas = mix.betas.save()
        decays = mix.decays.save()
        loss = metric(model).save()
        with loss.backward():
            g_decays = decays.grad.save()
            g_A = A.grad.save()
    torch.testing.assert_close(g_A, (g_decays * betas.detach()[..., None]).sum((0, 1)), rtol=1e-4, atol=1e-7)


def held(value):
    """The tensor the kernel holds: ``value`` itself, or what a served view (another layout) views."""
    return value._base if getattr(value, VIEW_MARK, False) else value


#: The fast path's kinds whose states are computed beside the kernel; a kind that taps them (its spec's `tap`: lightning
#: attention, the mLSTM, the short convolution) serves a leaf its outputs read through instead, checked by the finite
#: differences above.
BESIDE = [t for t in KINDS if REGISTRY[t].MIXER.FAST is not None and t not in TAPPED]


@pytest.mark.parametrize("model_type", BESIDE)
def test_fast_states_are_a_function_of_the_arguments(load, model_type):
    # The fast path's states under autograd: the same values as without, and a loss on them reaches the arguments.
    # (A tapped spec's states, read before the kernel runs, are instead a leaf the output is read through: TAPPED.)
    model = load(model_type)
    ids = ids_of(model)
    mix = model.layers[recurrent(model)[0]].linear_attn
    name = "attention_values"
    with nnterp.fast_states(model):
        with torch.no_grad(), model.trace(ids):
            plain = mix.states.save()
        others: dict = {}  # bound before the trace: a name first bound inside it does not outlive it
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            value = getattr(mix, name).save()
            states = mix.states.save()
            for other in ("time_decay", "time_first", "k") if "time_first" in type(mix).CHUNK_ARGUMENTS else ():
                others[other] = mix.argument(other).save()
    torch.testing.assert_close(states.detach(), plain, rtol=1e-5, atol=1e-7)  # float32 rounding (no out= under autograd)
    weights = torch.randn(states.shape, generator=torch.Generator().manual_seed(2))
    # Mamba-1's kernel holds x channel-first: each read serves a new view of it, so differentiate by what it views.
    value = held(value)
    (grad,) = torch.autograd.grad((states * weights).sum(), value, retain_graph=True)
    assert grad.abs().sum() > 0
    # Against the kernel's own final state, a function of the same argument.
    if others:
        # RWKV-4 runs a backward without a cache (BACKWARD_KWARGS), so no state leaves its call: transformers' kernel
        # on the call's own arguments (detached, then v a leaf) gives it.
        kernel_value = value.detach().requires_grad_(True)
        plain = {key: x.detach() for key, x in others.items()}
        _, final = REGISTRY[model_type].MODELING.rwkv_linear_attention_cpu(
            plain["time_decay"], plain["time_first"], plain["k"], kernel_value, state=None, return_state=True
        )
        final = torch.stack(final, 1)
    else:
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            kernel_value = getattr(mix, name).save()
            final = mix.state_output.save()
    (expected,) = torch.autograd.grad((final * weights[:, -1]).sum(), held(kernel_value))
    (last,) = torch.autograd.grad((states[:, -1] * weights[:, -1]).sum(), value)
    torch.testing.assert_close(last, expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("strategy", ["own", "fast"])
def test_set_state_after_target_grad_matches_finite_differences(model, strategy):
    ids = ids_of(model)
    mix = model.layers[recurrent(model)[0]].linear_attn
    if strategy == "fast" and type(mix).FAST is None:
        pytest.skip(f"{type(mix).__name__} has no fast path")
    t = 2
    with per_token(model) if strategy == "own" else nnterp.fast_states(model):
        with torch.no_grad(), model.trace(ids):
            clean = mix.state_after(t).save()
        target = (clean * 1.1).requires_grad_(True)
        with model.trace(ids, **model.family.BACKWARD_KWARGS):
            mix.set_state_after(t, target)
            loss = metric(model).save()
            with loss.backward():
                grad = target.grad.save()
        direction = torch.randn(clean.shape, generator=torch.Generator().manual_seed(3)) * clean.abs().mean()
        numeric = central_difference(model, ids, lambda e: mix.set_state_after(t, target.detach() + e * direction))
    analytic = float((grad * direction).sum())
    assert agrees(analytic, numeric, float(abs(loss))), (model.family.NAME, analytic, numeric)


@pytest.mark.parametrize("model_type", sorted(f.NAME for f in families() if f.MIXER is not None and getattr(f.MIXER, "SHARED_ARGUMENTS", False)))
def test_a_value_the_forward_also_uses_elsewhere_gets_the_kernels_gradient_alone(load, model_type):
    # Mamba-1's x feeds x_proj (dt, B, C) as well as the kernel; writing attention_values changes only the kernel's
    # input, so its .grad is the kernel's path alone (it once counted x_proj's too: 2x on Jamba, 3% on Mamba).
    model = load(model_type)
    ids = ids_of(model)
    mix = model.layers[recurrent(model)[0]].linear_attn
    with model.trace(ids, **model.family.BACKWARD_KWARGS):
        value = mix.attention_values.save()
        loss = metric(model).save()
        with loss.backward():
            grad = value.grad.save()
    direction = torch.randn(value.shape, generator=torch.Generator().manual_seed(1)) * value.detach()
    numeric = central_difference(model, ids, lambda e: setattr(mix, "attention_values", value.detach() + e * direction))
    analytic = float((grad * direction).sum())
    assert any(abs(analytic - n) <= 5e-3 * abs(n) for n in numeric), (model_type, analytic, numeric)
