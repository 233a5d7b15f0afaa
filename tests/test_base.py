"""`RecurrentMixer`'s own machinery, whatever the mixer: per-call records, pins, kernel choice, routing.

Run on tiny Mamba-1 / Mamba-2 checkpoints (the DeltaNet ones work the same
way; tests/components/test_linear_attention.py covers them). Oracles: the
plain HF model's cache, and the identity of the functions bound in the
modeling modules.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import RoutingError
from nnterp.components import kernels
from nnterp.components.routing import STASH, refused_device
from nnterp.core.calls import mediator, per_call, pinned
from nnterp.families import families
from tests.families.standins import compiled_kernels, mixer_kernels
from tests.reference import hf_oracles as hf

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"
RECURRENT = [family for family in families() if family.MIXER is not None]


@pytest.fixture(scope="module")
def mamba(load):
    return load("mamba")


@pytest.fixture(scope="module")
def mamba2(load):
    return load("mamba2")


# -- per_call and pinned ---------------------------------------------------------


def test_per_call_keeps_one_record_per_invoke_and_per_call(mamba):
    mix = mamba.layers[0].linear_attn
    computed, seen = [], []

    def compute():
        computed.append(len(computed))
        return object()

    with torch.no_grad(), mamba.trace() as tracer:
        for prompt in (PROMPT, OTHER):
            with tracer.invoke(prompt):
                first = per_call(mix, "probe", compute)
                again = per_call(mix, "probe", compute)
                seen.append((first is again, first))
    assert [same for same, _ in seen] == [True, True], "asked twice in one call: computed once"
    assert seen[0][1] is not seen[1][1] and len(computed) == 2, "each invoke has its own worker and record"

    kernels_seen = []
    with torch.no_grad(), mamba.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[:3]:
            kernels_seen.append(type(mix).KERNEL(mix))
    cls = type(mix)
    assert kernels_seen == [cls.CHUNK_KERNEL, cls.RECURRENT_KERNEL, cls.RECURRENT_KERNEL], "a new record in every call"


def test_pinned_sets_the_workers_pin_and_restores_it(mamba):
    observed = []
    with torch.no_grad(), mamba.trace(PROMPT):
        med = mediator()
        before = med.iteration
        with pinned(5):
            observed.append(med.iteration)
            with pinned(None):
                observed.append(med.iteration)
            observed.append(med.iteration)
        try:
            with pinned(7):
                raise KeyError("inside")
        except KeyError:
            pass
        observed.append(med.iteration == before)
    assert observed == [5, None, 5, True]


# -- which kernel fires ------------------------------------------------------------


def test_kernel_is_the_prompts_for_several_tokens_over_a_cache_and_the_updates_for_one(mamba2, checkpoint):
    """Mamba-2 continues a cache with several tokens through its prompt kernel, from the cached state."""
    mix = mamba2.layers[1].linear_attn
    cls = type(mix)
    ids = mamba2.tokenizer(PROMPT, return_tensors="pt").input_ids
    head, rest = ids[:, :5], ids[:, 5:]
    with torch.no_grad(), mamba2.trace(head):
        out = mamba2.output.save()
    cache = hf.output_cache(out)
    prefix_final = hf.recurrent_state(cache, 1).clone()
    chosen, entering = [], []
    with nnterp.chunk_per_token(mamba2), torch.no_grad(), mamba2.trace(rest, **{hf.cache_kwarg(mamba2._module): cache}):
        chosen.append(cls.KERNEL(mix))
        entering.append(mix.state_input.save())
        states = mix.states.save()
    with torch.no_grad(), mamba2.trace(ids[:, 5:6], **{hf.cache_kwarg(mamba2._module): hf.output_cache(out)}):
        chosen.append(cls.KERNEL(mix))
    assert chosen == [cls.CHUNK_KERNEL, cls.RECURRENT_KERNEL]
    torch.testing.assert_close(entering[0], prefix_final, rtol=0, atol=0, msg="the prompt kernel starts from the cache")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(checkpoint("mamba2")).eval()
    torch.testing.assert_close(states[0], hf.prefix_states(plain, ids, 1)[0, 5:], rtol=1e-4, atol=1e-5)


# -- routing ------------------------------------------------------------------------


@pytest.mark.parametrize("family", RECURRENT, ids=lambda f: f.NAME)
def test_route_kernels_binds_the_pure_torch_bodies_and_default_restores_identity(family):
    modeling, mixer = family.MODELING, family.MIXER
    names = (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)
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


def test_routing_inside_a_trace_raises_and_changes_nothing(mamba):
    modeling = mamba.family.MODELING
    before = dict(modeling.__dict__)
    with pytest.raises(RoutingError, match="inside a running trace"), mamba.trace(PROMPT):
        nnterp.route_kernels(mamba.family, "torch")
    assert all(modeling.__dict__[name] is before[name] for name in ("mamba_selective_scan", "causal_conv1d_fn"))


def test_routing_reaches_a_mixer_already_instrumented(load):
    """nnsight compiles a forward over a copy of its globals: routing must reach it anyway."""
    model = load("mamba", fresh=True)
    mix = model.layers[0].linear_attn
    with torch.no_grad(), model.trace(PROMPT):
        mix.state_output.save()  # instruments the forward over the dispatcher bindings
    with compiled_kernels(model.family.MODELING, mixer_kernels(model.family.MIXER)):
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        with pytest.raises(RuntimeError, match="is_cuda"), torch.no_grad():
            model._module(ids)  # unrouted, the instrumented forward (inert outside a trace) reaches the stand-in
        with nnterp.route_kernels(model.family, "torch"), torch.no_grad(), model.trace(PROMPT):
            states = mix.states.save()  # routed: the same mixer runs the pure-torch bodies
    assert states.shape[1] == len(model.tokenizer(PROMPT).input_ids)


def test_refused_device_names_route_kernels_only_where_a_compiled_kernel_would_refuse(mamba, load):
    assert refused_device(mamba) is None
    assert refused_device(load("llama")) is None, "a family without a recurrent mixer"
    with compiled_kernels(mamba.family.MODELING, ["causal_conv1d_fn"]):
        reason = refused_device(mamba)
        assert "causal_conv1d" in reason and "route_kernels(model.family, 'torch')" in reason
        with nnterp.route_kernels(mamba.family, "torch"):
            assert refused_device(mamba) is None
