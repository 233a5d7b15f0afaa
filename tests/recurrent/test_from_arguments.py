"""The fast path on a model (`nnterp.fast_states`), against HF-cache oracles.

On Qwen3.5, in depth, against the routed path's oracles: transformers' own
cache after each prefix, a forward continued token by token from a replaced
cached state, and a plain greedy loop with a state replaced. On every
registered family whose mixer has a fast path (a ``FAST`` spec), the state
contract (tests/suites/contract.py) runs its reads and writes on the fast path
too; here, the fast path against the spec's own path, and in bfloat16.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import NnterpError, OrderError, RoutingError, StandardizedTransformer, fast_states
from nnterp.components.mlstm import MLSTM
from nnterp.components.state_space import StateSpace
from nnterp.families import REGISTRY, present
from tests.reference import hf_oracles as hf
from tests.suites.caches import of_kind

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"
NEW = 4

#: Every registered family whose mixer has a fast path, by its own model_type (not an alias).
FAST = [t for t in present() if REGISTRY[t].MODEL_TYPES[0] == t and getattr(REGISTRY[t].MIXER, "FAST", None) is not None]


@pytest.fixture(scope="module")
def model(load):
    loaded = load("qwen3_5_text")
    fast_states(loaded)
    return loaded


@pytest.fixture(scope="module")
def plain(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint("qwen3_5_text")).eval()


@pytest.fixture(scope="module")
def ids(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


def donor(model, layer, scale=3.0, seed=0):
    module = model.layers[layer].linear_attn._module
    shape = (1, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def greedy(plain, ids, new, patch=None):
    return hf.greedy(plain, ids, new, patch=patch, suppress_tokens=(plain.config.eos_token_id,))


# -- reads -------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 2])
def test_states_equal_the_cache_after_each_prefix_and_the_routed_states(model, plain, ids, layer):
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(ids):
        states = mix.states.save()
        final = mix.state_output.save()
    torch.testing.assert_close(states, hf.prefix_states(plain, ids, layer), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states[:, -1], final, rtol=1e-5, atol=1e-7)
    with fast_states(model, enabled=False), nnterp.route_kernels(model.family, "torch"):
        with torch.no_grad(), model.trace(ids):
            routed = mix.states.save()
    torch.testing.assert_close(states, routed, rtol=1e-5, atol=1e-6)


def test_states_of_a_left_padded_batch_are_each_prompts(model, plain):
    with torch.no_grad(), model.trace([PROMPT, OTHER]):
        states = model.layers[1].linear_attn.states.save()
    for row, prompt in enumerate((PROMPT, OTHER)):
        row_ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        pad = states.shape[1] - row_ids.shape[1]
        torch.testing.assert_close(states[row, pad:], hf.prefix_states(plain, row_ids, 1)[0], rtol=1e-4, atol=1e-5)
        assert torch.count_nonzero(states[row, :pad]) == 0
    assert states.shape[1] > model.tokenizer(OTHER, return_tensors="pt").input_ids.shape[1], "one row is padded"


def test_state_after_is_the_kernel_on_the_prefix(model, plain, ids):
    expected = hf.prefix_states(plain, ids, 0)
    got = []
    with torch.no_grad(), model.trace(ids):
        for t in (0, 4, -1):
            got.append(model.layers[0].linear_attn.state_after(t).save())
    for t, value in zip((0, 4, -1), got):
        torch.testing.assert_close(value, expected[:, t], rtol=1e-5, atol=1e-6)


def test_support_follows_the_flag_and_keeps_the_routing_reason_off(checkpoint, model):
    fresh = StandardizedTransformer(str(checkpoint("qwen3_5_text")), dispatch=True, device="cpu")
    reference = StandardizedTransformer(str(checkpoint("qwen3_5_text")), dispatch=True, device="cpu")
    assert fresh.support()["linear_attn.states"] == reference.support()["linear_attn.states"]
    assert "route_kernels" in fresh.support()["linear_attn.states"][0]
    with fast_states(fresh):
        assert fresh.support()["linear_attn.states"] is None
        assert fresh.support()["linear_attn.state"] == reference.support()["linear_attn.state"]
    assert fresh.support()["linear_attn.states"] == reference.support()["linear_attn.states"]
    assert model.support()["linear_attn.states"] is None


# -- writes -------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 3, -2])
def test_set_state_after_continues_like_a_replaced_cache(model, plain, ids, T):
    layer, n = 1, ids.shape[1]
    value = donor(model, layer)
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.set_state_after(T, value)
        logits = model.logits.save()
    expected = hf.continue_from_state(plain, ids, T % n, layer, value)
    torch.testing.assert_close(logits[:, -1], expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        clean = plain(ids).logits
    torch.testing.assert_close(logits[:, : T % n + 1], clean[:, : T % n + 1], rtol=1e-5, atol=1e-5, msg="tokens up to T keep their readout")
    assert not torch.allclose(logits[:, -1], clean[:, -1], atol=1e-3)


def test_reads_around_a_write_see_it(model, ids):
    mix, T = model.layers[0].linear_attn, 3
    value = donor(model, 0)
    with torch.no_grad(), model.trace(ids):
        clean = mix.states.save()
    with torch.no_grad(), model.trace(ids):
        before = mix.state_after(T - 1).save()
        mix.set_state_after(T, value)
        at = mix.state_after(T).save()
        after = mix.state_after(T + 1).save()
        states = mix.states.save()
        final = mix.state_output.save()
    torch.testing.assert_close(before, clean[:, T - 1])
    assert torch.equal(at, value) and torch.equal(states[:, T], value)
    torch.testing.assert_close(states[:, :T], clean[:, :T])
    torch.testing.assert_close(states[:, T + 1], after, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states[:, -1], final, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after, clean[:, T + 1])


def test_two_writes_in_one_call_continue_from_each(model, plain, ids):
    layer, first, second = 2, 2, 5
    v1, v2 = donor(model, layer, seed=1), donor(model, layer, seed=2)
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.set_state_after(first, v1)
        model.layers[layer].linear_attn.set_state_after(second, v2)
        logits = model.logits.save()
    with torch.no_grad():
        out = plain(ids[:, : first + 1], use_cache=True)
        cache = hf.output_cache(out)
        hf.set_recurrent_state(cache, layer, v1)
        for i in range(first + 1, ids.shape[1]):
            if i == second + 1:
                hf.set_recurrent_state(cache, layer, v2)
            out = plain(ids[:, i : i + 1], use_cache=True, **{hf.cache_kwarg(plain): cache})
    torch.testing.assert_close(logits[:, -1], out.logits[:, -1], rtol=1e-4, atol=1e-5)


def test_a_write_on_the_last_token_is_what_generate_continues_from(model, plain, ids):
    layers = [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]
    donors = {layer: donor(model, layer, scale=20.0, seed=layer) for layer in layers}
    with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
        for _ in tracer.iter[0]:
            for layer in layers:
                model.layers[layer].linear_attn.set_state_after(-1, donors[layer])
        patched = tracer.result.save()

    def patch(step, cache):
        if step == 1:
            for layer in layers:
                hf.set_recurrent_state(cache, layer, donors[layer])

    assert torch.equal(patched, greedy(plain, ids, NEW, patch=patch))
    assert not torch.equal(patched, greedy(plain, ids, NEW))


def test_decode_steps_serve_their_new_state_and_take_a_write(model, plain, ids):
    layer = 1
    mix = model.layers[layer].linear_attn
    stacks, outs = [], []
    with torch.no_grad(), model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[:3]:
            stacks.append(mix.states.save())
            outs.append(mix.state_output.save())
    assert [s.shape[1] for s in stacks] == [ids.shape[1], 1, 1]
    assert torch.equal(stacks[1][:, 0], outs[1]) and torch.equal(stacks[2][:, 0], outs[2])
    value = donor(model, layer, scale=20.0)
    with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
        for _ in tracer.iter[1]:
            mix.set_state_after(0, value)
        patched = tracer.result.save()
    expected = greedy(plain, ids, NEW, patch=lambda step, cache: hf.set_recurrent_state(cache, layer, value) if step == 2 else None)
    assert torch.equal(patched, expected)


@pytest.mark.parametrize(
    "first, message",
    [
        (lambda m: m.states, r"after states"),
        (lambda m: m.state_after(4), r"after state_after\(4\)"),
        (lambda m: m.state_output, r"kernel had (already started|returned)"),
    ],
    ids=["states-then-write", "later-read-then-write", "output-then-write"],
)
def test_out_of_order_writes_raise(model, ids, first, message):
    mix = model.layers[0].linear_attn
    with pytest.raises(OrderError, match=message), model.trace(ids):
        first(mix)
        mix.set_state_after(3, donor(model, 0))


def test_a_bad_value_names_what_was_expected(model, ids):
    with pytest.raises(NnterpError, match=r"expects shape \(1, 4, 16, 8\)"), model.trace(ids):
        model.layers[0].linear_attn.set_state_after(1, torch.zeros(1, 4, 16, 9))


# -- an optimized kernel, and the switch -------------------------------------------------------


def test_an_optimized_kernel_stays_bound_and_serves_states_and_writes(model, plain, ids):
    # The stand-in accepts CPU tensors, as fla's kernel accepts the GPU's.
    modeling = model.family.MODELING
    dispatcher = modeling.torch_chunk_gated_delta_rule
    cell = dispatcher.__closure__[dispatcher.__code__.co_freevars.index("implementation")]
    torch_function = cell.cell_contents
    calls = []

    def stand_in(*args, **kwargs):  # plays flash-linear-attention's compiled kernel
        calls.append(args[0].shape[1])
        return torch_function(*args, **kwargs)

    cell.cell_contents = stand_in
    try:
        support = model.support()
        assert support["linear_attn.states"] is None
        assert support["linear_attn.attention_queries"] is None, "the call's own arguments, with the kernel bound"
        value = donor(model, 1)
        with torch.no_grad(), model.trace(ids):
            states = model.layers[0].linear_attn.states.save()
            model.layers[1].linear_attn.set_state_after(3, value)
            logits = model.logits.save()
    finally:
        cell.cell_contents = torch_function
    n = ids.shape[1]
    assert sorted(calls) == sorted([n, 4, n - 4, n]), "layer 1 ran the bound kernel on both halves; 0 and 2 ran it whole"
    torch.testing.assert_close(states, hf.prefix_states(plain, ids, 0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits[:, -1], hf.continue_from_state(plain, ids, 3, 1, value), rtol=1e-4, atol=1e-5)


def test_the_switch_is_per_model_outside_traces(model, checkpoint):
    with pytest.raises(RoutingError, match="inside a running trace"), model.trace(PROMPT):
        fast_states(model)
    llama = StandardizedTransformer(str(checkpoint("llama")), dispatch=True, device="cpu")
    with pytest.raises(NnterpError, match="no mixer with a fast path"):
        fast_states(llama)
    assert model.support()["linear_attn.states"] is None


# -- every family with a fast path: the delta rules (per head, per key channel), Mamba-2's SSD, Mamba-1's scan -----

LONG = PROMPT + " " + OTHER + " " + PROMPT  # several of Mamba-2's 8-token chunks


@pytest.fixture(scope="module")
def loaded(load, checkpoint):
    cache = {}

    def get(model_type):
        if model_type not in cache:
            fast = load(model_type)
            fast_states(fast)
            cache[model_type] = (fast, AutoModelForCausalLM.from_pretrained(checkpoint(model_type)).eval())
        return cache[model_type]

    return get


def state_donor(mix, scale=2.0, seed=3):
    module = mix._module
    if "channels" in mix.dims():  # Mamba-1: a state vector per inner channel
        shape = (1, mix.dims()["channels"], mix.dims()["state_size"])
    elif hasattr(module, "ssm_state_size"):
        shape = (1, module.num_heads, module.head_dim, module.ssm_state_size)
    else:
        shape = (1, mix.dims()["mixer_heads"], mix.dims()["key_dim"], mix.dims()["value_dim"])
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def mixers(model) -> list[int]:
    """The blocks with a recurrent mixer, in order (a hybrid's others have none)."""
    return [index for index, layer in enumerate(model.layers) if layer.linear_attn is not None]


def per_token_path(model):
    """The spec's own way to every token's state on this family (routing, or a chunk size of one)."""
    if issubclass(model.family.MIXER, StateSpace):
        return nnterp.chunk_per_token(model)
    return nnterp.route_kernels(model.family, "torch")


def tolerance(expected):
    return {"rtol": 1e-4, "atol": 1e-5 * max(1.0, expected.abs().max().item())}


# The fast path against the cache after each prefix, a left-padded batch and a forward continued from a replaced
# cache, on every family with a FAST spec: the state contract's "fast" runs (tests/suites/contract.py).


@pytest.mark.parametrize("model_type", FAST)
def test_every_family_states_equal_the_spec_path(loaded, model_type):
    model, plain = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = mixers(model)[1]
    with torch.no_grad(), model.trace(ids):
        states = model.layers[layer].linear_attn.states.save()
    with fast_states(model, enabled=False), per_token_path(model):
        with torch.no_grad(), model.trace(ids):
            spec_states = model.layers[layer].linear_attn.states.save()
    torch.testing.assert_close(states, spec_states, **tolerance(spec_states))


@pytest.mark.parametrize("model_type", FAST)
def test_every_family_in_bfloat16_states_equal_the_spec_path_and_the_cache(checkpoint, model_type):
    # Mamba-2's chunk scan rounds its time step to the model's dtype; the fast path rounds it alike (nnterp.fast.state_space).
    model = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", dtype=torch.bfloat16)
    assert next(model._module.parameters()).dtype == torch.bfloat16
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    layer = next(i for i, block in enumerate(model.layers) if getattr(block, "linear_attn", None) is not None)
    mix = model.layers[layer].linear_attn
    with fast_states(model), torch.no_grad(), model.trace(ids):
        states = mix.states.save()
        final = mix.state_output.save()
    with per_token_path(model), torch.no_grad(), model.trace(ids):
        spec_states = mix.states.save()
    assert states.dtype == spec_states.dtype == torch.float32
    scale = spec_states.abs().max().item()
    # float32 rounding of the largest entry, in a bfloat16 model too (measured: below 2e-7 of it)
    torch.testing.assert_close(states, spec_states, rtol=0, atol=1e-5 * scale)
    if issubclass(model.family.MIXER, MLSTM):
        # The mLSTM's chunkwise kernel computes in the model's dtype (its autocast_kernel_dtype): its final state is
        # bfloat16's, its stabilizer m a bfloat16 rounding off ours, so C and n compare unscaled (C e^m, n e^m).
        ours, its = (s[..., :-1] * torch.exp(s[..., -1:]) for s in (states[:, -1], final.float()))
        torch.testing.assert_close(ours, its, rtol=0, atol=2**-5 * its.abs().max().item())
    else:
        torch.testing.assert_close(states[:, -1], final.float(), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("model_type", FAST)
def test_states_a_reader_drops_are_freed_in_the_trace_and_state_after_recomputes(loaded, model_type):
    """The call's record holds no states of its own: states read and not kept are freed before the next block runs
    (every layer's states read in one trace, unsaved, cost one layer's at a time), and a later `state_after` of that
    call, whose kernel the one pass skipped, is computed again: the cache after that prefix."""
    model, plain = loaded(model_type)
    ids = model.tokenizer(LONG, return_tensors="pt").input_ids
    first, second = (model.layers[layer].linear_attn for layer in mixers(model)[:2])
    freed = []
    with torch.no_grad(), model.trace(ids):
        dropped = weakref.ref(first.states)
        gc.collect()
        freed.append(dropped() is None)
        middle = first.state_after(2).save()
        second.states.save()
    assert freed == [True], "the record kept the states the reader dropped"
    prefixes = of_kind(model.family.MIXER).prefix_states(plain, ids, mixers(model)[0])
    torch.testing.assert_close(middle, prefixes[:, 2], **tolerance(prefixes))
