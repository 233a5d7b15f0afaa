"""`route_kernels` (and its alias `route_delta_rule`), and a compiled kernel that fails: which kernel a family's modeling module binds.

Routing is process-wide: it rebinds the kernel names in transformers' modeling
module, so every test here leaves them as transformers bound them at import
(conftest's autouse check). Oracles: the identity of the functions bound in the
modeling modules, transformers' own pure-torch bodies, and the logits of the
unrouted model.
"""

from __future__ import annotations

import signal

import pytest
import torch

import nnterp
from nnterp import KernelFailure, RoutingError
from nnterp.core.interrupts import interrupts_held
from nnterp.families import families
from nnterp.recurrent import kernels
from nnterp.recurrent.kernels import STASH
from tests.suites.standins import compiled_kernels, mixer_kernels

PROMPT = "The Eiffel Tower is in the city of"
RECURRENT = [family for family in families() if family.MIXER is not None and getattr(family.MIXER, "CHUNK_FUNCTION", "")]
#: Recurrent families whose mixer computes in its own forward (lightning attention): nothing to route.
UNROUTED = [family for family in families() if family.MIXER is not None and not getattr(family.MIXER, "CHUNK_FUNCTION", "")]
#: One family per mixer kind whose routing the tests below exercise on a model: Mamba-1 and a gated DeltaNet.
ON_A_MODEL = ["mamba", "qwen3_5_text"]


@pytest.fixture(scope="module")
def mamba(load):
    return load("mamba")


@pytest.fixture(scope="module")
def qwen(load):
    return load("qwen3_5_text")


@pytest.mark.parametrize("family", RECURRENT, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_route_kernels_binds_the_pure_torch_bodies_and_default_restores_identity(family):
    modeling, mixer = family.MODELING, family.MIXER
    names = tuple(name for name in (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS) if name)
    if not names:  # the recurrence is the mixer's own method (the RG-LRU's scan): routing rebinds nothing
        before = {key: value for key, value in vars(modeling).items() if key != STASH}
        with nnterp.route_kernels(family, "torch"):
            assert all(vars(modeling)[key] is value for key, value in before.items())
        return
    originals = {name: modeling.__dict__[name] for name in names}
    nnterp.route_kernels(family, "torch")
    try:
        for name in names:
            assert modeling.__dict__[name] is kernels.torch_function(originals[name]) or name == mixer.CHUNK_FUNCTION
        chunk = modeling.__dict__[mixer.CHUNK_FUNCTION]
        if mixer.STATE_OP is not None and mixer.STEP_STATE_OP is None:  # a DeltaNet: prompts run the loop
            assert chunk is kernels.torch_function(originals[mixer.RECURRENT_FUNCTION])
        else:  # Mamba-1's prompt kernel is its own loop; Mamba-2 keeps its chunk scan
            assert chunk is kernels.torch_function(originals[mixer.CHUNK_FUNCTION])
    finally:
        nnterp.route_kernels(family, "default")
    for name, fn in originals.items():
        assert modeling.__dict__[name] is fn and modeling.__dict__[STASH][name] is fn, name


@pytest.mark.parametrize("family", UNROUTED, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_routing_a_mixer_without_kernel_functions_binds_nothing(family):
    def bindings():
        return {name: value for name, value in family.MODELING.__dict__.items() if name != STASH}

    before = bindings()
    with nnterp.route_kernels(family, "torch"):
        assert bindings() == before
    assert bindings() == before


def test_chunked_and_routed_kernels_agree_and_default_restores(qwen):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    originals = {name: modeling.__dict__[name] for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
    with torch.no_grad(), qwen.trace(PROMPT):
        chunked = qwen.next_token_probs.save()
    nnterp.route_delta_rule(qwen.family, "recurrent")
    assert modeling.torch_chunk_gated_delta_rule is not originals["torch_chunk_gated_delta_rule"]
    try:
        with torch.no_grad(), qwen.trace(PROMPT):
            recurrent = qwen.next_token_probs.save()
    finally:
        nnterp.route_delta_rule(qwen.family, "chunked")
    for name, fn in originals.items():
        assert modeling.__dict__[name] is fn, name
        assert modeling.__dict__[STASH][name] is fn, name
    torch.testing.assert_close(recurrent, chunked, rtol=0, atol=1e-5)


def test_route_kernels_as_a_with_block_restores_the_previous_binding(qwen):
    modeling = qwen.family.MODELING
    before = modeling.torch_chunk_gated_delta_rule
    with nnterp.route_kernels(qwen.family, "torch"):
        routed_fn = modeling.torch_chunk_gated_delta_rule
        with nnterp.route_kernels(qwen.family, "default"):
            assert modeling.torch_chunk_gated_delta_rule is before
        assert modeling.torch_chunk_gated_delta_rule is routed_fn
    assert modeling.torch_chunk_gated_delta_rule is before


@pytest.mark.parametrize("model_type", ON_A_MODEL)
def test_routing_inside_a_trace_raises_and_changes_nothing(load, model_type):
    model = load(model_type)
    modeling = model.family.MODELING
    names = mixer_kernels(model.family.MIXER)
    before = {name: modeling.__dict__[name] for name in names}
    with pytest.raises(RoutingError, match="inside a running trace"), model.trace(PROMPT):
        nnterp.route_kernels(model.family, "torch")
    assert all(modeling.__dict__[name] is before[name] for name in names)


@pytest.mark.parametrize("model_type", ON_A_MODEL)
def test_routing_reaches_a_mixer_already_instrumented(checkpoint, model_type):
    """nnsight compiles a forward over a copy of its globals: routing must reach it anyway, past a compiled kernel too."""
    model = nnterp.StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu")
    mix = model.layers[0].linear_attn
    with torch.no_grad(), model.trace(PROMPT):
        mix.state_output.save()  # instruments the forward over the bindings of the moment
    with compiled_kernels(model.family.MODELING, mixer_kernels(model.family.MIXER)):
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        with pytest.raises(RuntimeError, match="is_cuda"), torch.no_grad():
            model._module(ids)  # unrouted, the instrumented forward (inert outside a trace) reaches the stand-in
        with nnterp.route_kernels(model.family, "torch"):
            assert model.support()["linear_attn.states"] is None
            with torch.no_grad(), model.trace(PROMPT):  # routed: the same mixer runs the pure-torch bodies
                states = mix.states.save()
                final = mix.state_output.save()
    assert states.shape[1] == len(model.tokenizer(PROMPT).input_ids)
    assert torch.equal(states[:, -1], final)


def test_a_compiled_kernel_that_refuses_the_device_fails_the_trace_naming_route_kernels(mamba, load):
    with torch.no_grad(), load("llama").trace(PROMPT):  # a family without a recurrent mixer: nothing to say
        pass
    with compiled_kernels(mamba.family.MODELING, ["causal_conv1d_fn"]):
        with pytest.raises(KernelFailure, match=r"(?s)is_cuda.*causal_conv1d_fn.*route_kernels\(model.family, 'torch'\)"):
            with torch.no_grad(), mamba.trace(PROMPT):
                mamba.logits.save()
        with nnterp.route_kernels(mamba.family, "torch"), torch.no_grad(), mamba.trace(PROMPT):
            mamba.logits.save()


# -- interrupts and repairs: names and compiled forwards never disagree -------------------


def _bound(family) -> dict:
    return {name: family.MODELING.__dict__[name] for name in family.MODELING.__dict__.get(STASH, {})}


def _sourced(model) -> list:
    from nnsight.intervention.source import STATE

    return [layer.linear_attn._module.__dict__[STATE].sourced for layer in model.layers if layer.linear_attn is not None]


def test_an_exception_while_routing_puts_the_previous_bindings_back(qwen, monkeypatch):
    import nnterp.recurrent.routing as routing

    nnterp.route_kernels(qwen.family, "default")  # stash the originals
    before, support = _bound(qwen.family), qwen.support()
    original = routing.reinstrument
    calls = []

    def interrupted(modeling, names):
        calls.append(names)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as a Ctrl-C landing in the middle of the step
        return original(modeling, names)

    monkeypatch.setattr(routing, "reinstrument", interrupted)
    with pytest.raises(KeyboardInterrupt):
        nnterp.route_kernels(qwen.family, "torch")
    assert _bound(qwen.family) == before and qwen.support() == support


def test_a_real_sigint_while_routing_is_held_until_the_step_is_done(qwen, monkeypatch):
    import signal

    import nnterp.recurrent.routing as routing

    original = routing.reinstrument

    def signalled(modeling, names):
        signal.raise_signal(signal.SIGINT)
        return original(modeling, names)

    nnterp.route_kernels(qwen.family, "default")  # stash the originals
    before = _bound(qwen.family)
    monkeypatch.setattr(routing, "reinstrument", signalled)
    try:
        with pytest.raises(KeyboardInterrupt):
            nnterp.route_kernels(qwen.family, "torch")
        # Held until the step was done, then raised before the caller got the Routing: the step is undone.
        assert _bound(qwen.family) == before and qwen.support()["linear_attn.states"] is not None
    finally:
        monkeypatch.setattr(routing, "reinstrument", original)
        nnterp.route_kernels(qwen.family, "default")


class _InterruptAtLine:
    """A tracer raising ``KeyboardInterrupt`` at the ``at``-th line nnterp executes (as a Ctrl-C landing there).

    Lines run while an `interrupts_held` region holds SIGINT are not counted: a Ctrl-C there is held and raised
    when the region ends (`tests/properties/test_faults.py` raises exceptions inside them). Raising one there
    anyway could land where no real signal can, between a ``with`` block's last line and its ``__exit__``, and
    leave the hold's handler installed.
    """

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.fired = at, 0, False

    def __call__(self, frame, event, arg):
        if "/nnterp/" not in frame.f_code.co_filename:
            return None  # no line events inside torch, nnsight, transformers: their own steps are atomic to us
        if isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), interrupts_held):
            return self  # inside a held region a real Ctrl-C is recorded by the hold, not raised at a line
        if event == "line" and not self.fired:
            self.seen += 1
            if self.seen == self.at:
                self.fired = True
                raise KeyboardInterrupt
        return self


@pytest.mark.parametrize("model_type", ON_A_MODEL)
def test_an_interrupt_at_any_line_of_route_kernels_leaves_the_process_unrouted(load, model_type):
    """Ctrl-C at each line route_kernels (and what it calls in nnterp) executes: bindings, support() and logits as unrouted."""
    import sys

    model = load(model_type)
    family = model.family
    nnterp.route_kernels(family, "default")  # stash the originals; warm the label caches
    with nnterp.route_kernels(family, "torch"):
        pass
    before, support = _bound(family), model.support()
    with nnterp.route_kernels(family, "torch"):
        assert _bound(family) != before  # routing changes something this test can see
    with torch.no_grad(), model.trace(PROMPT):
        plain = model.logits.save()
    at = 0
    while True:
        at += 1
        tracer = _InterruptAtLine(at)
        sys.settrace(tracer)
        try:
            routing = nnterp.route_kernels(family, "torch")
        except KeyboardInterrupt:
            routing = None
        finally:
            sys.settrace(None)
        if routing is not None:  # past every line: the call completed
            assert not tracer.fired
            routing.__exit__(None, None, None)
            break
        assert tracer.fired, f"line {at}: an interrupt not injected by the test"
        assert _bound(family) == before, f"line {at}: kernel names left routed"
        assert model.support() == support, f"line {at}: support() says routed"
        with torch.no_grad(), model.trace(PROMPT):
            logits = model.logits.save()
        torch.testing.assert_close(logits, plain, rtol=0, atol=0, msg=f"line {at}")
    assert at > 10, "route_kernels ran fewer lines than expected: the tracer missed them"
    assert _bound(family) == before


def test_a_repeated_default_repairs_a_mixer_compiled_over_the_routed_kernels(qwen):
    nnterp.route_kernels(qwen.family, "torch")
    try:
        with torch.no_grad(), qwen.trace(PROMPT):
            qwen.layers[0].linear_attn.states.save()  # compiled over the routed names
        assert _sourced(qwen)[0]
    finally:
        stash = qwen.family.MODELING.__dict__[STASH]
        for name, original in stash.items():  # the names put back behind routing's back (an interrupted undo)
            setattr(qwen.family.MODELING, name, original)
    assert _sourced(qwen)[0], "the names alone do not reach the compiled forward"
    nnterp.route_kernels(qwen.family, "default")
    assert not _sourced(qwen)[0], "the mixer compiled over the routed kernels is reset"
    with pytest.raises(nnterp.Unavailable), qwen.trace(PROMPT):
        qwen.layers[0].linear_attn.states


_FRESH = r'''
import importlib, json, sys
import torch
order, out = sys.argv[1], sys.argv[2]
cases = json.loads(sys.argv[3])
modules = {model_type: importlib.import_module(name) for model_type, name in cases}  # first thing: the modeling modules
import nnterp
from nnterp.testing import tiny_checkpoint

found, states = {}, {}
for model_type, _ in cases:
    modeling = modules[model_type]
    if order == "route-then-load":
        routing = nnterp.route_kernels(modeling, "torch")
    model = nnterp.StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device="cpu")
    if order == "load-then-route":
        routing = nnterp.route_kernels(model.family, "torch")
    bound = {name: f"{modeling.__dict__[name].__module__}.{modeling.__dict__[name].__qualname__}" for name in routing.previous}
    support = model.support()["linear_attn.states"]
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    if model.support()["linear_attn.states"] is None or isinstance(support, (list, dict)) and support[layer] is None:
        with torch.no_grad(), model.trace("The Eiffel Tower is in the city of"):
            states[model_type] = model.layers[layer].linear_attn.states.save()
    changed = sorted(name for name in routing.previous if modeling.__dict__[name] is not routing.previous[name])
    routing.__exit__(None, None, None)
    restored = all(modeling.__dict__[name] is routing.previous[name] for name in routing.previous)
    found[model_type] = dict(bound=bound, support=json.loads(json.dumps(support)), changed=changed, restored=restored)
torch.save(states, out + ".pt")
print(json.dumps(found))
'''


def _fresh_process(order: str, cases: list, tmp_path) -> tuple[dict, dict]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = str(tmp_path / order)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, order, out, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out + ".pt")


def test_routing_a_modeling_module_works_first_thing_in_a_fresh_process(tmp_path):
    """The spec's order: import the modeling module, route it, then load a model of it; as routing ``model.family`` after loading binds."""
    cases = sorted({(family.NAME, family.MODELING.__name__) for family in RECURRENT}, key=lambda case: case[1])
    cases = [case for index, case in enumerate(cases) if case[1] not in {c[1] for c in cases[:index]}]  # one per module
    routed_first, states_first = _fresh_process("route-then-load", cases, tmp_path)
    loaded_first, states_loaded = _fresh_process("load-then-route", cases, tmp_path)
    assert routed_first == loaded_first
    for model_type, found in routed_first.items():
        assert found["bound"] and found["restored"], model_type  # RWKV's kernel is pure torch already: none changed
    assert sum(bool(found["changed"]) for found in routed_first.values()) > len(routed_first) // 2
    assert set(states_first) == set(states_loaded) and states_first
    for model_type in states_first:
        torch.testing.assert_close(states_first[model_type], states_loaded[model_type], rtol=0, atol=0, msg=model_type)
