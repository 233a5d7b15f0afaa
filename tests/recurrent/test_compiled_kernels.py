"""With a compiled kernel bound (fla, mamba_ssm, causal-conv1d), the kernel call's own inputs and return are served.

On every family whose mixer's scan and convolution kernels all go through
transformers' hub dispatcher (derived from the registry: the gated DeltaNet,
Kimi, Mamba-1, Mamba-2 and their hybrids), `Compiled` plays an installed
package that runs on this device: it computes with transformers' pure-torch
body, so every number is the oracle's, but has no source to read inside.
Oracles: the same values read with nothing bound (pure torch, unrouted), and
the plain transformers model's greedy loop with its cache state replaced by
hand (`tests.suites.caches`). What is read inside a kernel (the token loop's
state binding, the chunk scan's boundaries) raises `Unavailable` naming the
fix. Where the kernel itself fails (`refuse`: mamba_ssm on CPU tensors;
`no_driver`: fla's Triton with no GPU), the trace raises `KernelFailure`,
the kernel's error as its message and cause, with `route_kernels` named.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import KernelFailure, Unavailable
from nnterp.families import families
from nnterp.recurrent.kernels import closure, is_dispatcher
from nnterp.recurrent.settings import mark_remote
from tests.suites.caches import Cache
from tests.suites.checkpoint import PROMPT, model_type_params
from tests.suites.contract import NEW, fast_tol, recurrent_layers
from tests.suites.standins import NO_DRIVER, REFUSAL, Compiled, compiled_kernels, mixer_kernels, no_driver, refuse


def hub_dispatched(family) -> bool:
    """Whether the family's mixer is a scan whose kernels and convolution all go through the hub dispatcher."""
    mixer = family.MIXER
    conv = getattr(mixer, "CONV_FUNCTIONS", ())
    names = (getattr(mixer, "CHUNK_FUNCTION", ""), getattr(mixer, "RECURRENT_FUNCTION", ""), *conv)
    return bool(conv) and all(is_dispatcher(family.MODELING.__dict__.get(name)) for name in names)


FAMILIES = model_type_params(sorted(family.MODEL_TYPES[0] for family in families() if hub_dispatched(family)))
#: Values read inside the scan kernel: the token loop's state binding, the chunk scan's boundaries.
INTERIOR = {"state", "states"}
FIX = "route_kernels(model.family, 'torch')"
CACHE = Cache()
#: The values read last, in the order the call makes them (the kernel's return, the window, the module's output).
LAST = dict.fromkeys(("state_output", "conv_state_output", "attention_output"), 1) | {"attention_output": 2}


def bound_kernels(model, stand_in=Compiled):
    return compiled_kernels(model.family.MODELING, mixer_kernels(model.family.MIXER), stand_in)


def reasons(entry) -> set:
    if entry is None:
        return set()
    return set(entry.values()) if isinstance(entry, dict) else set(entry)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def read_all(model, layer: int, names: list[str], ids, step: int) -> dict:
    """``names``, every kernel argument and a few per-call reads of ``layer``'s mixer, on generate's step ``step``."""
    mix = model.layers[layer].linear_attn
    cls = type(mix)
    arguments = sorted(set(cls.CHUNK_ARGUMENTS if step == 0 else cls.RECURRENT_ARGUMENTS) - {"final"})
    got = {}
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for _ in tracer.iter[step]:
            for name in arguments:
                value = mix.argument(name)
                got[f"argument({name})"] = value.save() if isinstance(value, torch.Tensor) else value
            for name in sorted(names, key=lambda name: LAST.get(name, 0)):  # in the order the call makes them: its return last
                if name == "state_output" and step == 0:
                    got["effective_attention_of"] = mix.effective_attention_of(positions=[1, -1]).save()
                value = getattr(mix, name)
                got[name] = value.save() if value is not None else None
            got["logits"] = model.logits.save()
        got["generated"] = tracer.result.save()
    return got


@pytest.fixture(params=FAMILIES)
def model_type(request):
    return request.param


@pytest.fixture
def model(load, model_type):
    return load(model_type)


def test_support_refuses_only_what_is_read_inside_a_kernel(model):
    before = model.support()
    with bound_kernels(model) as bound:
        support = model.support()
        changed = {key for key in support if not key.endswith(".grad") and support[key] != before[key]}
        assert changed == {f"linear_attn.{name}" for name in INTERIOR}, "only the values inside a kernel change"
        for key in changed:
            for reason in reasons(support[key]):
                assert FIX in reason and "fast_states(model)" in reason, reason
                assert any(name in reason for name in bound), reason
        with nnterp.fast_states(model):
            served = model.support()
            assert served["linear_attn.states"] is None, "the fast path serves the states with the kernel bound"
            assert served["linear_attn.steer_state"] is None and served["linear_attn.knockout"] is None
    assert model.support() == before


@pytest.mark.parametrize("step", [0, 1], ids=["prompt", "decode"])
def test_every_served_value_is_the_pure_torch_one(model, step):
    layer = recurrent_layers(model)[-1]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    names = [name for name in type(model.layers[layer].linear_attn).values() if name not in INTERIOR]
    expected = read_all(model, layer, names, ids, step)
    with bound_kernels(model) as bound:
        got = read_all(model, layer, names, ids, step)
        assert sum(kernel.calls for kernel in bound.values()) > 0, "the compiled stand-in ran"
    assert expected.keys() == got.keys()
    for name in expected:
        assert same(got[name], expected[name]), name
    if step:
        assert expected["state_input"] is not None, "a decode step continues a state"


def test_states_of_under_fast_states_is_the_pure_torch_one(model):
    mix = model.layers[recurrent_layers(model)[-1]].linear_attn
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids

    def read():
        with torch.no_grad(), nnterp.fast_states(model), model.trace(ids):
            states = mix.states_of([1, 3, -1]).save()
            final = mix.state_output.save()
        return states, final

    expected, final = read()
    with bound_kernels(model):
        got, bound_final = read()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(bound_final, final)
    torch.testing.assert_close(got[:, -1], final, rtol=1e-4, atol=1e-5)


#: ``(how, step)``: a write on generate's step ``step`` (0: the prompt); on a decode step, ``set_state_after(0, v)``
#: (under ``fast_states``) is the write ``state_output`` makes: the state after its only token.
WRITES = [("state_output", 0), ("state_input", 1), ("state_output", 1), ("set_state_after", 1)]


@pytest.mark.parametrize("write", WRITES, ids=lambda w: f"{w[0]}-step{w[1]}")
def test_a_state_write_generates_like_the_plain_loop_with_the_cache_replaced(model, model_type, plains, write):
    how, step = write
    plain = plains(model_type)
    layer = recurrent_layers(model)[0]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    _, cache = CACHE.prefill(plain, ids)
    like = CACHE.read(cache, layer)
    at = step if how == "state_input" else step + 1  # the cache replaced before the step it enters
    clean = CACHE.greedy(plain, ids, NEW)
    for seed in range(8):  # a donor whose write the continuation shows (a tiny model often ignores one)
        donor = 30.0 * torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)

        def patch(s, cache, donor=donor):
            if s == at:
                CACHE.write(cache, layer, donor)

        expected = CACHE.greedy(plain, ids, NEW, patch=patch)
        if not torch.equal(expected, clean):
            break
    assert not torch.equal(expected, clean), "the write changes the continuation"
    mix = model.layers[layer].linear_attn
    # set_state_after is a per-token write: with the kernel bound, the fast path serves it (support() says so).
    with bound_kernels(model), torch.no_grad(), nnterp.fast_states(model, enabled=how == "set_state_after"):
        with model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[step]:
                if how == "set_state_after":
                    mix.set_state_after(0, CACHE.to_cache(donor))
                else:
                    setattr(mix, how, CACHE.to_cache(donor))
            patched = tracer.result.save()
    assert torch.equal(patched, expected)


def test_knockout_steering_and_a_prompts_state_input_are_their_unbound_results(model):
    mix = model.layers[recurrent_layers(model)[-1]].linear_attn
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    skip = model.support()["linear_attn.knockout.skip"] is None
    with torch.no_grad(), model.trace(ids):
        shape = mix.state_output.shape.save()
        clean = model.logits.save()
    delta = torch.ones(shape[1:])

    def run() -> dict:
        out = {}
        with torch.no_grad():
            with model.trace(ids):
                mix.knockout([1, 2])
                out["knockout"] = model.logits.save()
            if skip:
                with model.trace(ids):
                    mix.knockout(1, mode="skip")
                    out["skip"] = model.logits.save()
            with model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
                for _ in tracer.iter[0]:
                    mix.steer_state(delta, scale=30.0)
                out["steer"] = tracer.result.save()
            with nnterp.fast_states(model), model.trace(ids):
                mix.steer_state(delta, positions=[2], scale=30.0)
                out["steer at 2"] = model.logits.save()
            if "state" in type(mix).CHUNK_ARGUMENTS:  # a prompt kernel taking the entering state (not Mamba-1's)
                with model.trace(ids):
                    mix.state_input = 30.0 * delta.expand(shape)
                    out["state_input"] = model.logits.save()
        return out

    expected = run()
    with bound_kernels(model):
        got = run()
    assert not torch.equal(expected["knockout"], clean), "the knockout changes the logits"
    assert not torch.equal(expected["steer at 2"], clean), "the steering changes the logits"
    assert "state_input" not in expected or not torch.equal(expected["state_input"], clean), "the write changes them"
    for name in ("knockout", "skip", "steer", "state_input"):
        if name in expected:
            assert torch.equal(got[name], expected[name]), name
    # Unbound, the fast path's one pass computes the kernel's output itself; bound, the kernel runs on the split call.
    torch.testing.assert_close(got["steer at 2"], expected["steer at 2"], **fast_tol(expected["steer at 2"]))


def test_a_read_inside_the_kernel_raises_unavailable_naming_the_fix(model):
    mix = model.layers[recurrent_layers(model)[-1]].linear_attn
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    reads = {
        "states": lambda: mix.states,
        "state_after": lambda: mix.state_after(1),
        "states_of": lambda: mix.states_of([1, 2]),
        "set_state_after": lambda: mix.set_state_after(1, torch.zeros(1)),
    }
    with bound_kernels(model):
        (reason,) = reasons(model.support()["linear_attn.states"])
        for name, read in reads.items():
            with pytest.raises(Unavailable) as raised, torch.no_grad(), model.trace(ids):
                read()
            assert raised.value.reason == reason and FIX in str(raised.value), name
        with pytest.raises(Unavailable) as raised, torch.no_grad(), model.trace(ids) as tracer:
            for _ in tracer.iter[1]:
                mix.state.save()
        assert FIX in raised.value.reason
        if type(mix).CHUNKED_SCAN:  # the chunk scan's boundaries are inside the kernel too
            with nnterp.chunk_per_token(model):
                assert reasons(model.support()["linear_attn.states"]) == {reason}
                with pytest.raises(Unavailable, match=r"route_kernels\(model.family, 'torch'\)"), model.trace(ids):
                    mix.states


def _bindings(model) -> list:
    modeling = model.family.MODELING
    return [(name, id(modeling.__dict__[name]), id(closure(modeling.__dict__[name])["implementation"])) for name in mixer_kernels(model.family.MIXER)]


def test_the_bindings_are_as_they_were_after_a_trace_and_after_an_exception_in_it(model):
    mix = model.layers[recurrent_layers(model)[-1]].linear_attn
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    unbound = _bindings(model)
    with bound_kernels(model):
        bound = _bindings(model)
        assert bound != unbound
        with torch.no_grad(), nnterp.fast_states(model), model.trace(ids):
            mix.set_state_after(1, mix.state_after(1) * 2)
            mix.state_output.save()
        assert _bindings(model) == bound
        with pytest.raises(ZeroDivisionError) as raised, torch.no_grad(), model.trace(ids):
            mix.attention_queries.save()
            1 / 0
        assert type(raised.value) is ZeroDivisionError, "an error that is not the kernel's passes unchanged"
        assert _bindings(model) == bound
        with pytest.raises(Unavailable), model.trace(ids):
            mix.states
        assert _bindings(model) == bound
    assert _bindings(model) == unbound


# -- a kernel that fails on this machine (fla with Triton on a CPU, mamba_ssm on CPU tensors) ---------


@pytest.mark.parametrize("stand_in, words", [(refuse, REFUSAL), (no_driver, NO_DRIVER)], ids=["is_cuda", "triton"])
def test_a_kernel_that_fails_raises_its_own_error_naming_the_fix(model, stand_in, words):
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        clean = model.logits.save()
    with bound_kernels(model, stand_in):
        assert model.support()["linear_attn.attention_queries"] is None, "support() cannot know the device fails"
        with pytest.raises(KernelFailure) as raised, torch.no_grad(), model.trace(ids):
            model.logits.save()
        error = raised.value
        assert isinstance(error, RuntimeError) and words in str(error) and FIX in str(error), str(error)
        assert type(error.__cause__) is RuntimeError and str(error.__cause__) == words, "the kernel's own error is the cause"
        with nnterp.route_kernels(model.family, "torch"), torch.no_grad(), model.trace(ids):
            routed = model.logits.save()
    torch.testing.assert_close(routed, clean, rtol=1e-4, atol=1e-5)  # the routed token loop regroups the sums


def test_a_kernel_failure_is_also_the_builtin_the_kernel_raised(load):
    model = load(FAMILIES[0].values[0])

    def wrong_shape(body):
        def kernel(*args, **kwargs):
            raise ValueError("the kernel takes head_dim in (16, 32, 64, 128, 256)")

        return kernel

    with bound_kernels(model, wrong_shape), pytest.raises(ValueError) as raised, model.trace(PROMPT):
        model.logits.save()
    assert isinstance(raised.value, KernelFailure) and FIX in str(raised.value)
    assert "head_dim in (16, 32, 64, 128, 256)" in str(raised.value)


def test_on_a_server_the_reason_names_fast_states_not_routing(checkpoint):
    # A model marked remote (``remote=True``): routing in this process cannot reach the server's kernels.
    family = next(family for family in families() if hub_dispatched(family) and family.MIXER.FAST is not None)
    model = nnterp.StandardizedTransformer(str(checkpoint(family.MODEL_TYPES[0])), dispatch=True, device="cpu")
    mark_remote(model)
    with bound_kernels(model):
        support = model.support()
        assert support["linear_attn.state_output"] is None and support["linear_attn.attention_queries"] is None
        for reason in reasons(support["linear_attn.states"]):
            assert "runs on a server" in reason and "fast_states(model)" in reason and FIX not in reason, reason
