"""The gated DeltaNet (`LinearAttention`; Kimi's delta attention extends it): its suite and its own cases.

`GatedDeltaNetSuite` is the state contract (tests/suites/contract.py: states
against transformers' cache after each prefix, writes against a plain forward
continued from a replaced cache, decode steps against a plain greedy loop, a
left-padded batch) plus what every DeltaNet family passes: the values served,
the layer map read from the config, the kernel's arguments through the paper's
gated delta rule (tests/reference/recurrences.py). A family's test file
subclasses it and names ``MODEL_TYPE``. `TestLinearAttention` holds what the
component adds on one family (Qwen3.5): ordering, generate steps, errors,
optimized kernels. Routing is tested in tests/recurrent/test_routing.py.

The ``assert_*`` functions take the standardized model, for a family's own
tests to call with other arguments.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import KernelFailure, NnterpError, OrderError, StandardizedTransformer, Unavailable
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.testing import tiny_config, tiny_tokenizer
from tests.reference import hf_oracles as hf
from tests.reference.recurrences import gated_delta_rule
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures
from tests.suites.contract import PaddedBatch, StateContract, recurrent_layers
from tests.suites.standins import compiled_kernels
from tests.suites.steps import assert_generate_steps_read_their_own_call

NEW = 4
#: Values read inside the token-by-token kernel, served only after ``route_kernels(family, "torch")``.
PER_TOKEN = ("state", "states")
linear_layers = recurrent_layers


def donor_state(model, layer: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """A random float32 state of layer ``layer``'s shape, ``[1, mixer_heads, key_dim, value_dim]``."""
    dims = model.layers[layer].linear_attn.dims()
    shape = (1, dims["mixer_heads"], dims["key_dim"], dims["value_dim"])
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def greedy(plain, ids, new, patch=None):
    """The plain greedy loop, never choosing EOS (``generate`` runs with ``min_new_tokens``)."""
    return hf.greedy(plain, ids, new, patch=patch, suppress_tokens=(plain.config.get_text_config().eos_token_id,))


def assert_support_serves_every_value(model) -> None:
    """Every value `LinearAttention` serves is declared and served: ``support()`` is ``None`` for each.

    The per-token ones (`PER_TOKEN`) only after ``route_kernels(family, "torch")``,
    and before it they say so.
    """
    mixers = [model.layers[i].linear_attn for i in recurrent_layers(model)]
    assert mixers, "a recurrent family has recurrent blocks"
    names = set(type(mixers[0]).values())
    assert set(LinearAttention.values()) <= names, set(LinearAttention.values()) - names
    support = model.support()
    for name in names:
        entry = support[f"linear_attn.{name}"]
        if name in PER_TOKEN:
            assert entry is not None and all("route_kernels" in reason for reason in entry.values()), name
        else:
            assert entry is None, f"linear_attn.{name}: {entry}"
    with nnterp.route_kernels(model.family, "torch"):
        support = model.support()
        for name in names:
            assert support[f"linear_attn.{name}"] is None, f"routed linear_attn.{name}: {support[f'linear_attn.{name}']}"


def assert_layer_map_follows_the_config(model_type: str, layer_types: list[str]) -> None:
    """A model built from the family's tiny config with ``layer_types`` has its mixers where they say."""
    config = tiny_config(model_type).get_text_config()
    config.layer_types = list(layer_types)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(config).eval()
    model = StandardizedTransformer(built, tokenizer=tiny_tokenizer())
    expected = {"linear_attention": "linear_attn", "full_attention": "self_attn"}
    for index, (layer, kind) in enumerate(zip(model.layers, layer_types)):
        other = {"linear_attn": "self_attn", "self_attn": "linear_attn"}[expected[kind]]
        assert getattr(layer, expected[kind]) is not None, f"layer {index} ({kind})"
        assert getattr(layer, other) is None, f"layer {index} ({kind}) has no {other}"
    assert [set(parts) for parts in model.family.layer_parts(config)] == [set(layer.parts()) for layer in model.layers]


def assert_kernel_arguments_reproduce_states(model, layer: int, recurrence=gated_delta_rule) -> dict:
    """The kernel's arguments as served (q, k, v, β, g), fed to the paper's recurrence, give ``states`` and the kernel's output.

    Returns the arguments, for a family's own checks on them.
    """
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(PROMPT):
        q, k, v = mix.attention_queries.save(), mix.attention_keys.save(), mix.attention_values.save()
        beta, g = mix.betas.save(), mix.decays.save()
        states = mix.states.save()
        out = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
    outputs, expected = recurrence(q, k, v, g, beta)
    torch.testing.assert_close(states, expected, rtol=1e-4, atol=1e-5, msg=f"layer {layer}: states")
    torch.testing.assert_close(out.float(), outputs, rtol=1e-4, atol=1e-5, msg=f"layer {layer}: kernel output")
    assert (g <= 0).all(), "a log decay"
    return {"q": q, "k": k, "v": v, "beta": beta, "g": g, "states": states}


class GatedDeltaNetSuite(StateContract, PaddedBatch):
    """A gated-DeltaNet mixer (`LinearAttention`, `KimiDeltaAttention`): set ``MODEL_TYPE``; reads and writes routed."""

    STATE_TOL = dict(rtol=1e-5, atol=1e-6)
    CONTINUED_TOL = dict(rtol=1e-4, atol=1e-5)
    CHANGE_PROB_ATOL = 1e-5  # ten times PROB_TOL: the decay forgets an early write, but not to nothing
    STATE_LAYERS = (0, 2)
    WRITE_AT = (0, 3, -2)
    DECODE_LAYERS = (2,)
    DECODE_WRITES = (("state_input", 1), ("state_input", 2))
    DECODE_WRITE_LAYERS = None
    DECODE_SCALE = 20.0
    RECURRENCE = staticmethod(gated_delta_rule)

    def reading(self, model):
        return nnterp.route_kernels(model.family, "torch")

    def test_every_linear_attention_value_is_served(self, model):
        assert_support_serves_every_value(model)

    def test_layer_map_follows_the_config_not_a_pattern(self):
        assert_layer_map_follows_the_config(self.MODEL_TYPE, ["full_attention", "linear_attention", "full_attention", "linear_attention"])

    def test_mlp_is_the_whole_feed_forward_block(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            assert layer.mlp is not None and layer.mlp._module is hf_layers[index]._module.mlp, f"layer {index}"

    def test_kernel_arguments_reproduce_states_through_the_paper_recurrence(self, routed):
        assert_kernel_arguments_reproduce_states(routed, 1, self.RECURRENCE)


class TestLinearAttention(CheckpointFixtures):
    """The DeltaNet component on Qwen3.5's tiny checkpoint."""

    MODEL_TYPE = "qwen3_5_text"

    # -- the state after every token --------------------------------------------------

    def test_state_iterates_over_tokens_with_tracer_iter(self, routed, ids):
        mix = routed.layers[0].linear_attn
        n = ids.shape[1]
        collected = []
        with torch.no_grad(), routed.trace(ids) as tracer:
            for t in tracer.iter[:n]:
                collected.append(mix.state.save())
        with torch.no_grad(), routed.trace(ids):
            states = mix.states.save()
        assert len(collected) == n
        assert torch.equal(torch.stack(collected, 1), states)

    def test_unrouted_states_say_why_and_support_says_the_same(self, model):
        reason = model.support()["linear_attn.states"][0]
        assert "route_kernels(model.family, 'torch')" in reason
        with pytest.raises(Unavailable) as raised, model.trace(PROMPT):
            model.layers[0].linear_attn.states
        assert raised.value.reason == reason
        with pytest.raises(Unavailable, match="route_kernels"), model.trace(PROMPT):
            model.layers[0].linear_attn.set_state_after(1, donor_state(model, 0))

    # -- writing the state --------------------------------------------------------------

    def test_reads_bracket_a_write_in_forward_order(self, routed, ids):
        mix = routed.layers[0].linear_attn
        T = 3
        value = donor_state(routed, 0)
        with torch.no_grad(), routed.trace(ids):
            clean = mix.states.save()
        with torch.no_grad(), routed.trace(ids):
            before = mix.state_after(T - 1).save()
            mix.set_state_after(T, value)
            at = mix.state_after(T).save()
            after = mix.state_after(T + 1).save()
        assert torch.equal(before, clean[:, T - 1])
        assert torch.equal(at, value)
        assert not torch.allclose(after, clean[:, T + 1])

    @pytest.mark.parametrize(
        "first, second, message",
        [
            (lambda m: m.state_after(4), lambda m, v: m.set_state_after(3, v), r"set_state_after\(3, value\) was asked for after state_after\(4\)"),
            (lambda m: m.states, lambda m, v: m.set_state_after(2, v), r"after states"),
            (lambda m: m.state_output, lambda m, v: m.state_after(1), r"kernel had (already run|returned)"),
        ],
        ids=["later-read-then-write", "states-then-write", "output-then-position"],
    )
    def test_out_of_order_requests_raise(self, routed, ids, first, second, message):
        mix = routed.layers[0].linear_attn
        value = donor_state(routed, 0)
        with pytest.raises(OrderError, match=message):
            with routed.trace(ids):
                first(mix)
                second(mix, value)

    def test_bad_writes_raise_naming_what_was_expected(self, routed, ids):
        mix = routed.layers[0].linear_attn
        good = donor_state(routed, 0)
        n = ids.shape[1]
        cases = [
            (lambda: mix.set_state_after(1, good[:, :2]), r"expects shape \(1, 4, 16, 8\)"),
            (lambda: mix.set_state_after(1, good.double()), r"expects dtype torch.float32"),
            (lambda: mix.set_state_after(n, good), rf"outside this call's {n} tokens"),
            (lambda: mix.set_state_after(1, good.tolist()), r"takes a tensor"),
            (lambda: setattr(mix, "state_input", good[:, :1]), r"expects shape \(1, 4, 16, 8\)"),
        ]
        for bad, message in cases:
            with pytest.raises(NnterpError, match=message), routed.trace(ids):
                bad()

    def test_states_is_read_only(self, routed):
        with pytest.raises(NnterpError, match="set_state_after"), routed.trace(PROMPT):
            routed.layers[0].linear_attn.states = torch.zeros(1)

    # -- generate -----------------------------------------------------------------------------

    def test_seqs_and_firsts_under_generate(self, routed):
        assert_generate_steps_read_their_own_call(routed, routed.layers[0].linear_attn)

    @pytest.mark.parametrize("first_read", ["state_output", "state_input", "states", "layer_output"])
    def test_each_step_serves_its_own_call_whatever_is_read_first(self, routed, plain, ids, first_read):
        layer = 2
        mix = routed.layers[layer].linear_attn
        outs = []
        with torch.no_grad(), routed.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for step in tracer.iter[:NEW]:
                if first_read == "states":
                    mix.states.save()
                elif first_read == "state_input":
                    mix.state_input
                if first_read == "layer_output":
                    routed.layers[layer - 1].layer_output.save()
                outs.append(mix.state_output.save())
                if first_read == "state_output":
                    continue
            result = tracer.result.save()
        seen = {}
        greedy(plain, ids, NEW, patch=lambda step, cache: seen.__setitem__(step, hf.recurrent_state(cache, layer).clone()))
        for step in range(1, NEW):
            torch.testing.assert_close(outs[step - 1], seen[step], rtol=1e-5, atol=1e-6, msg=f"state after step {step - 1}")
        assert torch.equal(result, greedy(plain, ids, NEW))

    def test_state_input_on_a_decode_step_is_the_previous_output_copied(self, routed, ids):
        mix = routed.layers[0].linear_attn
        ins, outs = [], []
        with torch.no_grad(), routed.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:3]:
                entering = mix.state_input
                ins.append(entering.save() if entering is not None else None)
                outs.append(mix.state_output.save())
        assert ins[0] is None
        assert torch.equal(ins[1], outs[0]) and torch.equal(ins[2], outs[1])
        assert not torch.equal(ins[1], outs[1]), "a copy, not the cache's buffer the step overwrites"

    def test_assigning_state_output_of_the_prompt_is_what_the_first_step_continues_from(self, model, plain, ids):
        layers = linear_layers(model)
        donors = {layer: donor_state(model, layer, scale=20.0, seed=layer) for layer in layers}
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[0]:
                for layer in layers:
                    model.layers[layer].linear_attn.state_output = donors[layer]
            patched = tracer.result.save()

        def patch(at, cache):
            if at == 1:
                for layer in layers:
                    hf.set_recurrent_state(cache, layer, donors[layer])

        assert torch.equal(patched, greedy(plain, ids, NEW, patch=patch))

    def test_convolution_windows_follow_the_cache_and_a_written_one_is_convolved(self, model, plain, ids):
        layer = 0
        mix = model.layers[layer].linear_attn
        window = 5.0 * torch.randn(1, mix._module.conv_dim, mix._module.conv_kernel_size, generator=torch.Generator().manual_seed(1))
        got = []
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                entering = mix.conv_state_input
                got.append(entering.save() if entering is not None else None)
                got.append(mix.conv_state_output.save())
        assert got[0] is None and torch.equal(got[2], got[1])
        seen = {}
        greedy(plain, ids, 2, patch=lambda step, cache: seen.__setitem__(step, hf.conv_state(cache, layer).clone()))
        torch.testing.assert_close(got[1], seen[1], rtol=0, atol=0)

        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                mix.conv_state_input = window
            patched = tracer.result.save()
        expected = greedy(plain, ids, NEW, patch=lambda step, cache: hf.set_conv_state(cache, layer, window) if step == 1 else None)
        assert torch.equal(patched, expected)

    # -- optimized kernels, and what a trace leaves behind --------------------------------------

    @pytest.mark.parametrize(
        "kernel, package",
        [("torch_chunk_gated_delta_rule", "fla"), ("causal_conv1d_fn", "causal_conv1d")],
        ids=["flash-linear-attention", "causal-conv1d"],
    )
    def test_a_compiled_kernel_serves_the_calls_values_and_refuses_only_its_interior(self, model, kernel, package):
        before = model.support()
        with compiled_kernels(model.family.MODELING, [kernel]):
            support = model.support()
            assert support["linear_attn.attention_queries"] is None, "the call's own argument, read at the call"
            assert support["linear_attn.state_output"] is None and support["linear_attn.attention_output"] is None
            reason = support["linear_attn.states"][0]
            if package == "fla":
                assert "optimized kernel (fla)" in reason and "route_kernels" in reason and "fast_states" in reason
            else:  # a compiled convolution leaves the scan's interior as readable as before
                assert reason == before["linear_attn.states"][0]
            with pytest.raises(Unavailable) as raised:  # said before anything runs
                model.layers[0].linear_attn.states
            assert raised.value.reason == reason
            # The stand-in refuses CPU tensors, as the CUDA kernels do: the trace fails with its error and the fix.
            with pytest.raises(KernelFailure, match=r"(?s)is_cuda.*route_kernels\(model.family, 'torch'\)"):
                with model.trace(PROMPT):
                    model.layers[0].linear_attn.attention_output.save()
            with nnterp.route_kernels(model.family, "torch"):
                assert model.support()["linear_attn.states"] is None
                with torch.no_grad(), model.trace(PROMPT):
                    states = model.layers[0].linear_attn.states.save()
            assert states.shape[1] == len(model.tokenizer(PROMPT).input_ids)
        assert model.support() == before

    def test_traces_leave_weights_bindings_and_config_as_they_were(self, model, ids):
        modeling = model.family.MODELING
        weights = {name: p.detach().clone() for name, p in model._module.state_dict().items()}
        config = model._module.config.to_dict()
        names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
        bound = {name: modeling.__dict__[name] for name in names}
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(ids):
            mix.state_output = mix.state_output * 2
            model.layers[1].layer_output = model.layers[1].layer_output * 0.5
        with torch.no_grad(), model.generate(ids, max_new_tokens=2, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                mix.state_input = mix.state_input * 3
        for name, tensor in model._module.state_dict().items():
            assert torch.equal(tensor, weights[name]), name
        assert model._module.config.to_dict() == config
        assert {name: modeling.__dict__[name] for name in names} == bound

    def test_two_invokes_each_read_and_write_their_own_row(self, routed):
        mix = routed.layers[0].linear_attn
        value = donor_state(routed, 0)
        alone = {}
        for prompt in (PROMPT, OTHER):
            with torch.no_grad(), routed.trace(prompt):
                alone[prompt] = mix.states.save()
        with torch.no_grad(), routed.trace() as tracer:
            with tracer.invoke(PROMPT):
                first = mix.states.save()
            with tracer.invoke(OTHER):
                second = mix.states.save()
        # each invoke sees its own row, left-padded to the batch's length
        for got, prompt in ((first, PROMPT), (second, OTHER)):
            torch.testing.assert_close(got[:, -alone[prompt].shape[1]:], alone[prompt], rtol=1e-4, atol=1e-5, msg=prompt)
        with torch.no_grad(), routed.trace() as tracer:
            with tracer.invoke(PROMPT):
                mix.set_state_after(2, value)
                patched = routed.next_token_probs.save()
            with tracer.invoke(OTHER):
                untouched = routed.next_token_probs.save()
        with torch.no_grad(), routed.trace(OTHER):
            other_alone = routed.next_token_probs.save()
        with torch.no_grad(), routed.trace(PROMPT):
            mix.set_state_after(2, value)
            patched_alone = routed.next_token_probs.save()
        torch.testing.assert_close(untouched, other_alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(patched, patched_alone, rtol=1e-4, atol=1e-5)
