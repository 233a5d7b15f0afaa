"""RWKV-4's one pass: reading ``states`` computes the WKV kernel's output with every state and skips the kernel call.

Oracles, none from nnterp: a plain transformers forward (its logits and its
returned state list), that state after each prefix, a plain forward from a
replaced state, and whether transformers' loop body (``rwkv_linear_attention_cpu``)
ran at all (counted by a profile hook, `tests.reference.calls`). The cases kept on
the token loop (two invokes, autograd, a write, a decode step, the switch
off) are checked to run the loop and to give the same answers.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import OrderError
from nnterp.recurrent.per_token import from_arguments
from tests.components.test_wkv import (
    CACHE,
    TOL,
    continue_from_state,
    fresh_state,
    prefix_states,
    set_wkv_state,
    wkv_state,
)
from tests.reference.calls import counting
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures


class TestWkvOnePass(CheckpointFixtures):
    MODEL_TYPE = "rwkv"

    @pytest.fixture
    def loop(self, model):
        """transformers' token loop, the body the kernel call runs on CPU."""
        return model.family.MODELING.rwkv_linear_attention_cpu

    def layers(self, model):
        return range(len(model.layers))

    def test_reading_every_layers_states_skips_the_loop_and_keeps_the_forward(self, model, plain, ids, loop):
        states, finals = [], []
        with counting(loop) as calls, torch.no_grad(), model.trace(ids):
            for i in self.layers(model):
                states.append(model.layers[i].linear_attn.states.save())
                finals.append(model.layers[i].linear_attn.state_output.save())
            logits = model.logits.save()
        assert calls == [], "the loop ran although every call's states were read"
        with torch.no_grad():
            out = plain(ids, use_cache=True)
        torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)
        for i, read, final in zip(self.layers(model), states, finals):
            assert read.shape == (ids.shape[0], ids.shape[1], 3, model.layers[i].linear_attn.dims()["channels"])
            torch.testing.assert_close(read, prefix_states(plain, ids, i), **TOL)  # prefixes round their matmuls apart
            assert torch.equal(final, wkv_state(out.state, i)) and torch.equal(read[:, -1], final)

    def test_state_after_reads_the_one_pass_and_a_later_write_is_refused(self, model, plain, ids, loop):
        mix = model.layers[1].linear_attn
        with counting(loop) as calls, torch.no_grad(), model.trace(ids):
            states = mix.states.save()
            middle = mix.state_after(2).save()
            last = mix.state_after(-1).save()
        assert len(calls) == 1, "layer 0's call runs its loop; layer 1's is skipped"
        expected = prefix_states(plain, ids, 1)
        torch.testing.assert_close(middle, expected[:, 2], **TOL)
        assert torch.equal(last, states[:, -1])
        with pytest.raises(OrderError, match="states"):
            with torch.no_grad(), model.trace(ids):
                mix.states.save()
                mix.set_state_after(1, torch.zeros_like(expected[:, 1]))

    def test_a_written_state_input_is_where_the_one_pass_starts(self, model, plain, ids, loop):
        with torch.no_grad():
            donor = wkv_state(plain(model.tokenizer(OTHER, return_tensors="pt").input_ids, use_cache=True).state, 0)
        mix = model.layers[0].linear_attn
        with counting(loop) as calls, torch.no_grad(), model.trace(ids):
            mix.state_input = donor
            states = mix.states.save()
            logits = model.logits.save()
        assert len(calls) == 1, "only layer 1's loop runs"
        state = fresh_state(plain, ids.shape[0])
        set_wkv_state(state, 0, donor)
        with torch.no_grad():
            out = plain(ids, state=state, use_cache=True)
        torch.testing.assert_close(logits, out.logits, **TOL)
        torch.testing.assert_close(states[:, -1], wkv_state(out.state, 0), **TOL)

    # -- the paths kept on the token loop --------------------------------------------

    def test_two_invokes_sharing_the_call_run_the_loop(self, model, plain, loop):
        with counting(loop) as calls, torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                states = model.layers[0].linear_attn.states.save()
            with tracer.invoke(PROMPT):
                logits = model.logits.save()
        assert len(calls) == len(model.layers), "a skip must cover every row: each layer's loop runs"
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        torch.testing.assert_close(states, prefix_states(plain, ids, 0), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(logits[-1:], plain(ids).logits, **TOL)

    def test_under_autograd_the_loop_runs_and_the_states_carry_gradients(self, model, plain, ids, loop):
        mix = model.layers[0].linear_attn
        with counting(loop) as calls, model.trace(ids, **model.family.BACKWARD_KWARGS):
            states = mix.states
            kept = states.save()
            loss = model.logits.sum()
            with loss.backward():
                grad = states.grad.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(kept.detach(), prefix_states(plain, ids, 0), **TOL)
        assert grad.shape == kept.shape and grad.abs().sum() > 0

    def test_a_write_keeps_the_loop_and_continues_from_it(self, model, plain, ids, loop):
        with torch.no_grad():
            donor = wkv_state(plain(model.tokenizer(OTHER, return_tensors="pt").input_ids, use_cache=True).state, 0)
        mix = model.layers[0].linear_attn
        with counting(loop) as calls, torch.no_grad(), model.trace(ids):
            before = mix.state_after(1).save()
            mix.set_state_after(2, donor)
            after = mix.state_after(2).save()
            logits = model.logits.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(before, prefix_states(plain, ids, 0)[:, 1], **TOL)
        assert torch.equal(after, donor)
        torch.testing.assert_close(logits[:, 3:], continue_from_state(plain, ids, 2, 0, donor), **TOL)

    def test_with_the_switch_off_the_loop_runs_and_the_answers_are_the_same(self, model, ids, loop, monkeypatch):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(ids):
            one = mix.states.save()
            one_logits = model.logits.save()
        monkeypatch.setattr(from_arguments, "ONE_PASS", False)
        with counting(loop) as calls, torch.no_grad(), model.trace(ids):
            two = mix.states.save()
            two_logits = model.logits.save()
        assert len(calls) == len(model.layers)
        assert torch.equal(one, two) and torch.equal(one_logits, two_logits)

    def test_decode_steps_keep_the_loop_and_continue_from_the_skipped_calls_state(self, model, plain, ids, loop):
        out = []
        with counting(loop) as calls, torch.no_grad():
            with model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3) as tracer:
                model.layers[0].linear_attn.states  # the prompt's call: layer 0's loop skipped
                out.append(tracer.result.save())
        assert len(calls) == len(model.layers) - 1 + 2 * len(model.layers), "layer 1's prompt call and the two steps run"
        assert torch.equal(out[0], CACHE.greedy(plain, ids, 3))
