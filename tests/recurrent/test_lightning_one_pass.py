"""Lightning attention's one pass: reading ``states`` computes the prompt's outputs with them and skips the block loop's products.

Oracles, none from nnterp: a plain transformers forward (its logits and its
cache's ``linear_cache``), that cache after each prefix, the recurrence written
from the paper (`tests.reference.lightning`), a plain greedy loop, and how many
``torch.matmul`` calls the HF mixer's own forward made (counted by a profile
hook on C calls from that forward's frame). The cases where the loop must run
(two invokes, autograd, a write, a read inside the loop first, the switch off)
are checked to run it and to give the same answers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer
from nnterp.core.errors import OrderError
from nnterp.recurrent.per_token import from_arguments
from tests.components.test_lightning_attention import ATOL, CACHE, KW, lightning_layers
from tests.reference import hf_oracles as hf
from tests.reference.calls import counting_builtin
from tests.reference.lightning import lightning_recurrence
from tests.suites.checkpoint import PROMPT, CheckpointFixtures

TOL = {"atol": ATOL, "rtol": 1e-4}


def products(plain):
    """Counts the ``torch.matmul`` calls made under a frame of the HF lightning mixer's ``forward``: ``len(calls)``."""
    mixer = type(plain.model.layers[0].self_attn)
    return counting_builtin(torch.matmul, lambda frame: frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), mixer))


def blocks(model, ids) -> int:
    return -(-ids.shape[1] // model._module.config.block_size)


class TestLightningOnePass(CheckpointFixtures):
    MODEL_TYPE = "minimax"

    def test_reading_every_layers_states_skips_the_block_loop_and_keeps_the_forward(self, model, plain, ids):
        layers = lightning_layers(model)
        states, finals = [], []
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            for i in layers:
                states.append(model.layers[i].linear_attn.states.save())
                finals.append(model.layers[i].linear_attn.state_output.save())
            logits = model.logits.save()
        assert calls == [], "a block loop product ran although every call's states were read"
        with torch.no_grad():
            out = plain(ids, use_cache=True)
        torch.testing.assert_close(logits, out.logits, **TOL)
        cache = hf.output_cache(out)
        assert ids.shape[1] > 2 * model._module.config.block_size, "several blocks"
        for i, read, final in zip(layers, states, finals):
            torch.testing.assert_close(read, CACHE.prefix_states(plain, ids, i), **TOL)
            torch.testing.assert_close(final, cache.linear_cache[i], **TOL)
            assert torch.equal(read[:, -1], final), "the call's final state is the pass's last"

    def test_the_outputs_before_the_norm_are_the_papers(self, model, ids):
        mix = model.layers[lightning_layers(model)[1]].linear_attn
        with torch.no_grad(), model.trace(ids):
            q, k, v, g = (x.save() for x in (mix.attention_queries, mix.attention_keys, mix.attention_values, mix.decays))
            mix.states.save()
            output = mix.kernel_output().save()
        expected, _ = lightning_recurrence(q, k, v, -g[0, 0])
        torch.testing.assert_close(output, expected.to(output.dtype), **TOL)

    def test_generate_continues_from_the_one_pass_final_state(self, model, plain, ids):
        layers = lightning_layers(model)
        with torch.no_grad(), model.generate(ids, **KW) as tracer:
            for _ in tracer.iter[0]:
                for i in layers:
                    model.layers[i].linear_attn.states.save()
            result = tracer.result.save()
        assert torch.equal(result, CACHE.greedy(plain, ids, KW["max_new_tokens"]))

    # -- the paths where the block loop runs ---------------------------------------------

    def test_with_one_pass_off_the_loop_runs_and_the_answers_are_the_same(self, model, plain, ids, monkeypatch):
        layer = lightning_layers(model)[0]
        monkeypatch.setattr(from_arguments, "ONE_PASS", False)
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            states = model.layers[layer].linear_attn.states.save()
            logits = model.logits.save()
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model))
        torch.testing.assert_close(states, CACHE.prefix_states(plain, ids, layer), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, **TOL)

    def test_two_invokes_sharing_the_call_run_the_loop(self, model, plain):
        layer = lightning_layers(model)[0]
        with products(plain) as calls, torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                states = model.layers[layer].linear_attn.states.save()
            with tracer.invoke(PROMPT):
                logits = model.logits.save()
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model)), "a skip must cover every row"
        torch.testing.assert_close(states[:1], CACHE.prefix_states(plain, ids, layer), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(logits[-1:], plain(ids).logits, **TOL)

    def test_under_autograd_the_loop_runs_and_the_states_carry_gradients(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix = model.layers[layer].linear_attn
        with products(plain) as calls, model.trace(ids):
            states = mix.states
            kept = states.save()
            loss = model.logits.sum()
            with loss.backward():
                grad = states.grad.save()
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model))
        torch.testing.assert_close(kept.detach(), CACHE.prefix_states(plain, ids, layer), **TOL)
        assert grad.shape == kept.shape and grad[:, :-1].abs().sum() > 0

    def test_a_write_or_a_read_inside_the_loop_first_keeps_the_loop(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            reference = mix.states.save()
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            mix.set_state_after(2, reference[:, 2] * 2)
            written = mix.states.save()
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model))
        assert torch.equal(written[:, 2], reference[:, 2] * 2)
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            final = mix.state_output.save()
            late = mix.states.save()
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model)), "state_output first: the loop had run"
        torch.testing.assert_close(late, reference, **TOL)
        torch.testing.assert_close(late[:, -1], final, **TOL)
        with pytest.raises(OrderError, match="states"):
            with torch.no_grad(), model.trace(ids):
                mix.states.save()
                mix.set_state_after(1, reference[:, 1])

    def test_decay_buffers_a_cast_left_apart_from_slope_rate_keep_the_loop(self, checkpoint, ids):
        # load(bfloat16).to(float32) rounds the loop's decay buffers apart from what slope_rate gives (about 2e-3):
        # the one pass would compute the outputs from slope_rate, not from the buffers the forward reads.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", dtype=torch.bfloat16)
        model._module.to(torch.float32)
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().to(torch.float32)
        mixer = plain.model.layers[lightning_layers(model)[0]].self_attn
        assert not torch.allclose(mixer.query_decay, mixer.decay_factors(mixer.slope_rate)[0], rtol=1e-4, atol=0)
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            for i in lightning_layers(model):
                model.layers[i].linear_attn.states.save()
            logits = model.logits.save()
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, rtol=0, atol=1e-6)
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model)), "the block loop ran"
