"""LinearAttention (gated DeltaNet) against oracles that do not use nnterp.

The oracle checks every gated-DeltaNet family shares (states per prefix, the
paper recurrence, writes mid-prompt and on decode steps) run for Qwen3.5 in
tests/families/test_qwen3_5_text.py (`GatedDeltaNetSuite`); this file holds
what the base and the DeltaNet add on one family: ordering, generate steps,
errors, optimized kernels. Routing is tested in tests/recurrent/test_routing.py.

The oracles: transformers' own cache after a plain forward over each prefix;
a plain forward continued token by token from a replaced cached state; a plain
greedy loop with a state replaced before a decode step; the gated delta rule
written from the paper's equations (tests/reference/recurrences.py).
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import NnterpError, OrderError, RoutingError, Unavailable
from tests.reference import hf_oracles as hf
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures
from tests.suites.gated_deltanet import donor_state, greedy, recurrent_layers
from tests.suites.standins import compiled_kernels
from tests.suites.steps import assert_generate_steps_read_their_own_call

NEW = 4
linear_layers = recurrent_layers


class TestLinearAttention(CheckpointFixtures):
    """The DeltaNet component on Qwen3.5's tiny checkpoint."""

    MODEL_TYPE = "qwen3_5_text"

    # -- the state after every token --------------------------------------------------

    def test_states_of_a_left_padded_batch_are_each_prompts(self, routed, plain):
        mix = routed.layers[1].linear_attn
        with torch.no_grad(), routed.trace([PROMPT, OTHER]):
            states = mix.states.save()
        rows = [routed.tokenizer(p, return_tensors="pt").input_ids for p in (PROMPT, OTHER)]
        width = states.shape[1]
        for row, row_ids in enumerate(rows):
            pad = width - row_ids.shape[1]
            expected = hf.prefix_states(plain, row_ids, 1)[0]
            torch.testing.assert_close(states[row, pad:], expected, rtol=1e-4, atol=1e-5, msg=f"row {row}")
            assert torch.count_nonzero(states[row, :pad]) == 0, "a padding position carries no state"
        assert width - rows[1].shape[1] > 0, "the second prompt is the padded one"

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
    def test_a_compiled_kernel_makes_kernel_values_unavailable_until_routed(self, model, kernel, package):
        with compiled_kernels(model.family.MODELING, [kernel]):
            support = model.support()
            reason = support["linear_attn.attention_queries"][0]
            assert f"optimized kernel ({package})" in reason and "route_kernels" in reason
            assert support["linear_attn.states"][0] == reason
            assert support["linear_attn.attention_output"] is None  # the module's own output needs no kernel source
            with pytest.raises(Unavailable) as raised:  # said before anything runs
                model.layers[0].linear_attn.states
            assert raised.value.reason == reason
            # The compiled kernel refuses CPU tensors: the trace refuses first, naming the fix.
            with pytest.raises(RoutingError, match=r"route_kernels\(model.family, 'torch'\)"):
                with model.trace(PROMPT):
                    model.layers[0].linear_attn.attention_output.save()
            with nnterp.route_kernels(model.family, "torch"):
                assert model.support()["linear_attn.states"] is None
                with torch.no_grad(), model.trace(PROMPT):
                    states = model.layers[0].linear_attn.states.save()
            assert states.shape[1] == len(model.tokenizer(PROMPT).input_ids)
        assert model.support()["linear_attn.attention_queries"] is None

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
