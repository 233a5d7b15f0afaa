"""Fault injection: an exception (or a KeyboardInterrupt) raised at each step of `route_kernels`, `fast_states`,
`chunk_per_token` and a trace's setup leaves the process as it was.

Each test wraps one function the operation calls (`TARGETS`: a name looked up in
an nnterp module's globals at call time, the builtin ``setattr`` of
`nnterp.recurrent.routing` included) so that its k-th call raises, for k = 1, 2,
... until the operation completes without reaching the k-th call. After each
failed attempt, on every recurrent family: every kernel name is bound as at
import (`conftest.default_kernels`' check), each mixer's per-token setting
(`per_token_setting`) and ``support()`` are as before, and a trace gives the
logits it gave before, bit for bit (that trace reads kernel arguments, so its
mixers are instrumented: a mixer compiled over a routed binding would run the
routed kernel and change the rounding).
"""

from __future__ import annotations

import builtins
import contextlib

import pytest
import torch

import nnterp
import nnterp.components.recurrent as recurrent_component
import nnterp.recurrent.labels as labels
import nnterp.recurrent.per_token as per_token
import nnterp.recurrent.routing as routing
import nnterp.recurrent.settings as settings
import nnterp.standardized as standardized
from nnterp.families import REGISTRY
from nnterp.recurrent.kernels import STASH
from tests.properties.models import MODEL_TYPES, build, kernel_names, recurrent_layers

#: The steps each operation takes: (module, global name it calls).
ROUTING = [
    (routing, "family_of"),
    (routing, "in_trace"),
    (routing, "mixers_of"),
    (routing, "torch_function"),
    (routing, "labels_for"),
    (routing, "_rebind"),
    (routing, "setattr"),  # each name rebound
    (routing, "reinstrument"),
]
SETTINGS = [
    (settings, "in_trace"),
    (settings, "_mixers"),
    (settings, "per_token_setting"),
    (settings, "_store"),  # each mixer's setting stored
]
TRACE = [
    (standardized, "marked_generating"),
    (labels, "labels_for"),
    (recurrent_component, "per_call"),
    (recurrent_component, "once_per_call"),  # the strategy resolved once per call
    (per_token, "strategy_for"),
]

#: The families with a fast path, and with Mamba-2's chunked scan.
FAST = tuple(t for t in MODEL_TYPES if REGISTRY[t].MIXER.FAST is not None)
CHUNKED = tuple(t for t in MODEL_TYPES if REGISTRY[t].MIXER.CHUNKED_SCAN)

#: Operations: name -> (the families it applies to, the steps to fault).
OPERATIONS = {
    "route_kernels": (MODEL_TYPES, ROUTING),  # route_kernels(family, "torch")
    "with route_kernels": (MODEL_TYPES, ROUTING),  # with route_kernels(family, "torch"): pass
    "route_kernels default": (MODEL_TYPES, ROUTING),  # route_kernels(family, "default") over a routed family
    "fast_states": (FAST, SETTINGS),
    "with fast_states": (FAST, SETTINGS),
    "chunk_per_token": (CHUNKED, SETTINGS),
    "with chunk_per_token": (CHUNKED, SETTINGS),
    "trace": (MODEL_TYPES, TRACE),  # a trace reading and writing states (routed, fast or per-token chunks)
}

#: No operation takes more steps than this; a loop reaching it is a test bug.
MAX_STEPS = 500


class Injected(Exception):
    pass


class Fault:
    """``module.name`` replaced by a wrapper whose ``k``-th call raises ``error`` (its other calls pass through)."""

    def __init__(self, module, name: str, k: int, error: type[BaseException]) -> None:
        self.module, self.name, self.k, self.error = module, name, k, error
        self.had = name in module.__dict__
        self.original = module.__dict__[name] if self.had else getattr(builtins, name)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.k:
            raise self.error(f"injected into {self.module.__name__}.{self.name}, call {self.k}")
        return self.original(*args, **kwargs)

    def __enter__(self) -> Fault:
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        if self.had:
            setattr(self.module, self.name, self.original)
        else:
            delattr(self.module, self.name)


def mixers(model) -> list:
    return [model.layers[i].linear_attn for i in recurrent_layers(model)]


def per_token_settings(model) -> list:
    return [settings.per_token_setting(mixer) for mixer in mixers(model)]


def reference_trace(model, ids) -> torch.Tensor:
    """Logits of a trace that also reads every mixer's kernel arguments (so each forward is instrumented)."""
    with torch.no_grad(), model.trace(ids):
        for mixer in mixers(model):
            mixer.attention_values.save()
        logits = model.logits.save()
    return logits


def state_of(models: dict, only: str | None = None) -> dict:
    """What must be as it was: every family's bindings; each model's (or model ``only``'s) per-token settings and support()."""
    some = {t: m for t, m in models.items() if only in (None, t)}
    return {
        "bindings": {t: {n: m.family.MODELING.__dict__[n] for n in kernel_names(m.family)} for t, m in models.items()},
        "settings": {t: per_token_settings(m) for t, m in some.items()},
        "support": {t: m.support() for t, m in some.items()},
    }


def mess(models: dict, before: dict, logits: dict, ids, operated: str) -> list[str]:
    """What differs from ``before`` (empty when the process is as it was).

    Every family's bindings; the settings, ``support()`` and a following trace of the model ``operated`` on.
    """
    found = []
    now = state_of(models, operated)
    for t, bound in now["bindings"].items():
        stash = models[t].family.MODELING.__dict__.get(STASH, {})
        for name, fn in bound.items():
            if fn is not before["bindings"][t][name] or (name in stash and fn is not stash[name]):
                found.append(f"{t}: {name} is not bound as at import")
    for t in now["settings"]:
        if now["settings"][t] != before["settings"][t]:
            found.append(f"{t}: per-token settings changed: {before['settings'][t]} -> {now['settings'][t]}")
        changed = sorted(k for k, v in now["support"][t].items() if v != before["support"][t].get(k))
        if changed:
            found.append(f"{t}: support() changed for {', '.join(changed)}")
    for t, model in [(operated, models[operated])]:
        try:
            again = reference_trace(model, ids)
        except BaseException as error:  # noqa: BLE001 - a trace that cannot run is a mess too
            found.append(f"{t}: a following trace raised {error!r}")
            continue
        if not torch.equal(again, logits[t]):
            found.append(f"{t}: a following trace's logits differ by {(again - logits[t]).abs().max():.3g}")
    return found


def repair(models: dict, before: dict) -> None:
    """Put back what a failed attempt left, without nnterp's own undo (which may be what failed)."""
    for t, model in models.items():
        modeling = model.family.MODELING
        for name, fn in before["bindings"][t].items():
            setattr(modeling, name, fn)
        routing.reinstrument(modeling, set(before["bindings"][t]))
        for mixer, value in zip(mixers(model), before["settings"][t]):
            settings._store(mixer, value)


def operate(operation: str, model, ids) -> None:
    if operation == "route_kernels":
        nnterp.route_kernels(model.family, "torch")
    elif operation == "with route_kernels":
        with nnterp.route_kernels(model.family, "torch"):
            reference_trace(model, ids)  # mixers instrumented over the routed bindings
    elif operation == "route_kernels default":
        nnterp.route_kernels(model.family, "default")
    elif operation == "fast_states":
        nnterp.fast_states(model)
    elif operation == "with fast_states":
        with nnterp.fast_states(model):
            pass
    elif operation == "chunk_per_token":
        nnterp.chunk_per_token(model)
    elif operation == "with chunk_per_token":
        with nnterp.chunk_per_token(model):
            pass
    elif operation == "trace":
        mix = mixers(model)[0]
        with torch.no_grad(), model.trace(ids):
            first = mix.state_after(0).save()
            mix.set_state_after(1, 2 * first)
            model.logits.save()
    else:
        raise AssertionError(operation)


def undo(operation: str, model) -> None:
    """What a user runs to undo ``operation`` by hand: a repeated ``"default"``, or the setting turned off."""
    if "route_kernels" in operation:
        nnterp.route_kernels(model.family, "default")
    elif "fast_states" in operation:
        nnterp.fast_states(model, enabled=False)
    elif "chunk_per_token" in operation:
        nnterp.chunk_per_token(model, enabled=False)


def serving_for_trace(model) -> contextlib.AbstractContextManager:
    """The strategy a faulted trace reads states under: fast where there is one, else routed (+ chunks on Mamba-2)."""
    stack = contextlib.ExitStack()
    if model.family.MIXER.FAST is not None and not model.family.MIXER.CHUNKED_SCAN:
        stack.enter_context(nnterp.fast_states(model))
    else:
        stack.enter_context(nnterp.route_kernels(model.family, "torch"))
        if model.family.MIXER.CHUNKED_SCAN:
            stack.enter_context(nnterp.chunk_per_token(model))
    return stack


@pytest.fixture(scope="module")
def models():
    return {t: build(t).model for t in MODEL_TYPES}


CASES = [
    pytest.param(
        operation, module, name,
        id=f"{operation}-{module.__name__.rsplit('.', 1)[-1]}.{name}",
    )
    for operation, (_, steps) in OPERATIONS.items()
    for module, name in steps
]


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt], ids=["exception", "interrupt"])
@pytest.mark.parametrize(("operation", "module", "name"), CASES)
def test_a_fault_at_any_step_leaves_the_process_as_it_was(models, operation, module, name, error):
    families, _ = OPERATIONS[operation]
    ids = torch.tensor([[10, 20, 30, 40, 50, 60]])
    logits = {t: reference_trace(m, ids) for t, m in models.items()}
    before = state_of(models)
    messes, faults = [], 0
    for model_type in families:
        model = models[model_type]
        for k in range(1, MAX_STEPS):
            if operation == "route_kernels default":
                # The state the operation undoes, set without faults: routed, with mixers instrumented over it.
                nnterp.route_kernels(model.family, "torch")
                reference_trace(model, ids)
            serving = serving_for_trace(model) if operation == "trace" else contextlib.nullcontext()
            with serving:
                with Fault(module, name, k, error) as fault:
                    try:
                        operate(operation, model, ids)
                    except error:
                        raised = True
                    else:
                        raised = False
            if operation == "route_kernels default" and raised:
                # A repeated "default" always restores the originals.
                nnterp.route_kernels(model.family, "default")
            if not raised:
                assert fault.calls < k, f"{model_type}: call {k} of {name} raised nothing"
                if operation == "route_kernels":
                    nnterp.route_kernels(model.family, "default")
                elif operation in ("fast_states", "chunk_per_token"):
                    for mixer in mixers(model):
                        settings._store(mixer, None)
                found = mess(models, before, logits, ids, model_type)
                assert not found, f"{model_type}: {operation} completed and left: {found}"
                break
            faults += 1
            if operation.startswith("with "):
                # A fault while a block undoes itself leaves the step not taken (each step is atomic): the state
                # inside the block, whole. The documented undo, run again, must then restore everything.
                undo(operation, model)
            found = mess(models, before, logits, ids, model_type)
            if found:
                messes.append(f"{model_type}, {name} call {k}: {found}")
                repair(models, before)
        else:
            raise AssertionError(f"{operation} made {MAX_STEPS} calls of {name}")
    assert not messes, f"{operation}: a fault left a mess in {len(messes)} of {faults} attempts:\n" + "\n".join(messes[:8])
