"""`SelectiveScanSuite`: the tests every Mamba-1-like family passes, against oracles that do not use nnterp.

A family's test file mixes it in and names its checkpoint::

    class TestMamba(SelectiveScanSuite):
        MODEL_TYPE = "mamba"

The oracles: transformers' own cache after a plain forward over each prefix;
a plain forward continued token by token from a replaced cached state; a plain
greedy loop with the state replaced before a decode step; the selective scan
written from the paper's equations (tests/reference/recurrences.py). The
decode-step and optimized-kernel tests come from `MambaSuite`, shared with the
Mamba-2 suite.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import NnterpError, NotInTrace, OrderError, ReadOnlyValue
from tests.reference import hf_oracles as hf
from tests.reference.recurrences import selective_scan
from tests.suites.mamba import OTHER, PROMPT, TOL, MambaSuite
from tests.suites.steps import assert_generate_steps_read_their_own_call


class SelectiveScanSuite(MambaSuite):
    """Tests of a Mamba-1-like mixer (`SelectiveScan`): set ``MODEL_TYPE``."""

    def test_labels_are_resolved_from_the_kernels_source(self, model):
        cls = type(model.layers[0].linear_attn)
        assert (cls.STATE_OP, cls.STEP_STATE_OP) == ("ssm_state_3", "ssm_state_0")
        assert cls.CHUNK_KERNEL == "mamba_selective_scan_0" and cls.RECURRENT_KERNEL == "mamba_selective_state_update_0"

    # -- the state after every token ---------------------------------------------

    @pytest.mark.parametrize("layer", [0, 1])
    def test_states_equal_the_cache_after_each_prefix(self, model, plain, ids, layer):
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
            final = mix.state_output.save()
        torch.testing.assert_close(states, hf.prefix_states(plain, ids, layer), **TOL, msg="states vs HF cache per prefix")
        assert torch.equal(states[:, -1], final)

    def test_routed_states_are_the_same(self, model, ids):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(ids):
            unrouted = mix.states.save()
        with nnterp.route_kernels(model.family, "torch"):
            assert model.support()["linear_attn.states"] is None
            with torch.no_grad(), model.trace(ids):
                routed = mix.states.save()
        assert torch.equal(routed, unrouted)

    def test_states_of_a_left_padded_batch_are_each_prompts(self, model, plain):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace([PROMPT, OTHER]):
            batch = mix.states.save()
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                first = mix.states.save()
            with tracer.invoke(OTHER):
                second = mix.states.save()
        assert torch.equal(first[0], batch[0]) and torch.equal(second[0], batch[1]), "one invoke each, one row each"
        width = batch.shape[1]
        for row, prompt in enumerate((PROMPT, OTHER)):
            row_ids = model.tokenizer(prompt, return_tensors="pt").input_ids
            pad = width - row_ids.shape[1]
            torch.testing.assert_close(batch[row, pad:], hf.prefix_states(plain, row_ids, 1)[0], **TOL, msg=f"row {row}")
            assert torch.count_nonzero(batch[row, :pad]) == 0, "a padding position carries no state"
        assert width > len(model.tokenizer(OTHER).input_ids), "the second prompt is the padded one"

    def test_state_iterates_over_tokens_with_tracer_iter(self, model, ids):
        mix = model.layers[0].linear_attn
        collected = []
        with torch.no_grad(), model.trace(ids) as tracer:
            for t in tracer.iter[: ids.shape[1]]:
                collected.append(mix.state.save())
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        assert torch.equal(torch.stack(collected, 1), states)

    def test_arguments_reproduce_states_and_output_through_the_paper_recurrence(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            x, dt = mix.attention_values.save(), mix.dt.save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            A, D, z, bias = (mix.argument(name).save() for name in ("A", "D", "z", "dt_bias"))
            betas, decays = mix.betas.save(), mix.decays.save()
            states = mix.states.save()
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        outputs, expected = selective_scan(x, dt, A, B, C, D, z, dt_bias=bias)
        torch.testing.assert_close(states, expected, **TOL, msg="states")
        torch.testing.assert_close(y.transpose(1, 2), outputs, **TOL, msg="kernel output")
        _, from_betas = selective_scan(x, betas, A, B, C, D, z, dt_softplus=False)
        torch.testing.assert_close(from_betas, expected, **TOL, msg="betas are the step sizes")
        assert torch.equal(decays, betas[..., None] * A) and (decays <= 0).all() and (betas > 0).all()

    def test_betas_written_reach_the_kernel(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            x, A = mix.attention_values.save(), mix.argument("A").save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            doubled = (2 * mix.betas).save()
            mix.betas = doubled
            states = mix.states.save()
        _, expected = selective_scan(x, doubled, A, B, C, dt_softplus=False)
        torch.testing.assert_close(states, expected, **TOL)

    def test_several_tokens_over_a_cache_run_the_prompt_kernel_from_zeros(self, model, ids):
        mix = model.layers[0].linear_attn
        cls = type(mix)
        with torch.no_grad(), model.trace(ids[:, :4]):
            out = model.output.save()
        cache = hf.output_cache(out)
        entering, chosen = [], []
        with torch.no_grad(), model.trace(ids[:, 4:], **{hf.cache_kwarg(model._module): cache}):
            chosen.append(cls.KERNEL(mix))
            entering.append(mix.state_input)
            states = mix.states.save()
        assert chosen == [cls.CHUNK_KERNEL] and entering == [None], "transformers' Mamba-1 restarts from zeros there"
        assert states.shape[1] == ids.shape[1] - 4

    def test_generate_steps_each_read_their_own_call(self, model):
        assert_generate_steps_read_their_own_call(model, model.layers[0].linear_attn)

    def test_a_decode_step_serves_one_token_and_a_write_reaches_its_update(self, model):
        mix = model.layers[1].linear_attn
        read = {}
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                read["entering"] = mix.state_input.save()
                read["x"], read["B"], read["C"] = mix.attention_values.save(), mix.attention_keys.save(), mix.attention_queries.save()
                read["A"] = mix.argument("A").save()
                read["betas"] = (mix.betas * 2).save()
                mix.betas = read["betas"]
                read["out"] = mix.state_output.save()
        x, B, C, A, betas = (read[k] for k in ("x", "B", "C", "A", "betas"))
        assert x.shape[1] == B.shape[1] == betas.shape[1] == 1, "a sequence axis of one"
        _, expected = selective_scan(x, betas, A, B, C, dt_softplus=False, initial_state=read["entering"])
        torch.testing.assert_close(read["out"], expected[:, -1], **TOL)

    # -- writing the state inside a prompt ---------------------------------------

    @pytest.mark.parametrize("T", [2, 5])
    def test_set_state_after_continues_as_hf_from_a_replaced_cache(self, model, plain, ids, T):
        layer = 1
        donor = self.donor(self.cached_state(plain, ids, layer))
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            before = mix.state_after(T - 1).save()
            mix.set_state_after(T, donor)
            after = mix.state_after(T).save()
            probs = model.next_token_probs.save()
        expected = torch.softmax(hf.continue_from_state(plain, ids, T, layer, donor), -1)
        torch.testing.assert_close(probs, expected, **TOL)
        assert torch.equal(after, donor)
        torch.testing.assert_close(before, hf.prefix_states(plain, ids[:, :T], layer)[:, -1], **TOL)

    # -- bad input ---------------------------------------------------------------

    def test_bad_input_raises_nnterp_errors(self, model, plain, ids):
        mix = model.layers[0].linear_attn
        good = self.cached_state(plain, ids, 0)
        n = ids.shape[1]
        cases = {
            "dtype": (lambda: mix.set_state_after(1, good.double()), NnterpError, "dtype"),
            "shape": (lambda: mix.set_state_after(1, good[:, :3]), NnterpError, "shape"),
            "range": (lambda: mix.state_after(n), NnterpError, "outside"),
            "not an int": (lambda: mix.state_after(1.0), NnterpError, "int"),
            "later read first": (lambda: (mix.state_after(3), mix.set_state_after(1, good)), OrderError, "increasing order"),
            "argument after the kernel": (lambda: (mix.states, setattr(mix, "dt", mix.dt)), OrderError, "kernel had started"),
            "argument shape": (lambda: setattr(mix, "attention_values", mix.attention_values[:, :1]), NnterpError, "shape"),
            "prompt state_input": (lambda: setattr(mix, "state_input", good), NnterpError, "zeros"),
            "read-only": (lambda: setattr(mix, "states", None), ReadOnlyValue, "set_state_after"),
            "unknown argument": (lambda: mix.argument("nope"), NnterpError, "one of"),
        }
        for name, (action, error, words) in cases.items():
            with pytest.raises(error, match=words):
                with torch.no_grad(), model.trace(ids):
                    action()
        with pytest.raises(NotInTrace):
            mix.states
