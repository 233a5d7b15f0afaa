"""The mLSTM's one pass: reading ``states`` computes the backend's output with every state and skips the backend call.

Oracles, none from nnterp: a plain transformers forward (its logits and its
``xLSTMCache``), the cache after each prefix, a plain forward from a cache
holding a replaced state, the paper's recurrence (`tests.reference.mlstm`),
and whether transformers' backend body (``wrap_chunkwise_arbitrary_sequence_length``)
ran at all (counted by a profile hook, `tests.reference.calls`). The cases
where the backend must run (two invokes, autograd, a write, a state read after
it ran, a one-token call, the switch off) are checked to run it and to give the
same answers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import OrderError, StandardizedTransformer
from nnterp.components.mlstm import MLSTM
from nnterp.recurrent.per_token import from_arguments
from tests.reference import hf_oracles as hf
from tests.reference import mlstm as ref
from tests.reference.calls import counting
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures

TOL = {"rtol": 1e-4, "atol": 1e-5}


def packed_prefixes(plain, ids, layer):
    return MLSTM.pack(*ref.prefix_states(plain, ids, layer))


class TestMlstmOnePass(CheckpointFixtures):
    MODEL_TYPE = "xlstm"

    @pytest.fixture
    def backend(self, model):
        """transformers' backend body: the chunkwise kernel and the token loop past the last whole chunk."""
        return model.family.MODELING.wrap_chunkwise_arbitrary_sequence_length

    def test_reading_every_layers_states_skips_the_backend_and_keeps_the_forward(self, model, plain, ids, backend):
        states, finals = [], []
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            for layer in model.layers:
                states.append(layer.linear_attn.states.save())
                finals.append(layer.linear_attn.state_output.save())
            logits = model.logits.save()
        assert calls == [], "the backend ran although every call's states were read"
        with torch.no_grad():
            out = plain(ids, use_cache=True)
        torch.testing.assert_close(logits, out.logits, **TOL)
        cache = hf.output_cache(out)
        for i, (read, final) in enumerate(zip(states, finals)):
            torch.testing.assert_close(read, packed_prefixes(plain, ids, i), **TOL)
            torch.testing.assert_close(final, MLSTM.pack(*cache.rnn_state[i]), **TOL)
            assert torch.equal(read[:, -1], final), "the call's final state is the last one the pass wrote"

    def test_the_skipped_backends_output_is_the_papers(self, model, backend):
        mix = model.layers[1].linear_attn
        with counting(backend) as calls, torch.no_grad(), model.trace(PROMPT):
            q, k, v = mix.attention_queries.save(), mix.attention_keys.save(), mix.attention_values.save()
            i, f = mix.input_gates.save(), mix.forget_gates.save()
            mix.states.save()
            h = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        assert len(calls) == len(model.layers) - 1, "only layer 1's backend is skipped"
        out, _, _, _ = ref.mlstm(q, k, v, i, f)
        torch.testing.assert_close(h.transpose(1, 2).double(), out, rtol=1e-4, atol=1e-5)

    def test_state_after_reads_the_one_pass_and_a_later_write_is_refused(self, model, plain, ids, backend):
        mix = model.layers[1].linear_attn
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            states = mix.states.save()
            middle = mix.state_after(2).save()
            last = mix.state_after(-1).save()
        assert len(calls) == len(model.layers) - 1
        assert torch.equal(middle, states[:, 2]) and torch.equal(last, states[:, -1])
        torch.testing.assert_close(middle, packed_prefixes(plain, ids, 1)[:, 2], **TOL)
        with pytest.raises(OrderError, match="states"):
            with torch.no_grad(), model.trace(ids):
                mix.states.save()
                mix.set_state_after(1, torch.zeros_like(states[:, 1]))

    def test_a_written_state_input_is_where_the_one_pass_starts(self, model, plain, ids, backend):
        from transformers.models.xlstm.modeling_xlstm import xLSTMCache

        with torch.no_grad(), model.trace(OTHER):
            donor = model.layers[1].linear_attn.state_output.save()
        mix = model.layers[1].linear_attn
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            mix.state_input = donor
            states = mix.states.save()
            logits = model.logits.save()
        assert len(calls) == len(model.layers) - 1
        cache = xLSTMCache(plain.config, ids.shape[0], dtype=torch.float32)
        ref.set_layer_state(cache, 1, MLSTM.unpack(donor))
        with torch.no_grad():
            out = plain(ids, use_cache=True, **{hf.cache_kwarg(plain): cache})
        torch.testing.assert_close(logits, out.logits, **TOL)
        torch.testing.assert_close(states[:, -1], MLSTM.pack(*hf.output_cache(out).rnn_state[1]), **TOL)

    # -- the paths where the backend runs ----------------------------------------------

    def test_two_invokes_sharing_the_call_run_the_backend(self, model, plain, backend):
        with counting(backend) as calls, torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                states = model.layers[0].linear_attn.states.save()
            with tracer.invoke(PROMPT):
                logits = model.logits.save()
        assert len(calls) == len(model.layers), "a skip must cover every row: each layer's backend runs"
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        torch.testing.assert_close(states[:1], packed_prefixes(plain, ids, 0), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(logits[-1:], plain(ids).logits, **TOL)

    def test_under_autograd_the_backend_runs_and_the_states_carry_gradients(self, model, plain, ids, backend):
        mix = model.layers[0].linear_attn
        with counting(backend) as calls, model.trace(ids, **model.family.BACKWARD_KWARGS):
            states = mix.states
            kept = states.save()
            loss = model.logits.sum()
            with loss.backward():
                grad = states.grad.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(kept.detach(), packed_prefixes(plain, ids, 0), **TOL)
        assert grad.shape == kept.shape and grad.abs().sum() > 0

    def test_a_write_or_a_read_after_the_backend_ran_keeps_the_backend(self, model, plain, ids, backend):
        with torch.no_grad(), model.trace(OTHER):
            donor = model.layers[0].linear_attn.state_output.save()
        mix = model.layers[0].linear_attn
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            mix.set_state_after(2, donor)
            written = mix.states.save()
        assert len(calls) >= len(model.layers), "the write splits the backend call and runs both parts"
        assert torch.equal(written[:, 2], donor)
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            final = mix.state_output.save()
            late = mix.states.save()
        assert len(calls) == len(model.layers), "state_output first: the backend had run"
        torch.testing.assert_close(late, packed_prefixes(plain, ids, 0), **TOL)
        torch.testing.assert_close(late[:, -1], final, **TOL)

    def test_a_one_token_call_and_the_switch_off_run_the_backend(self, model, plain, ids, backend, monkeypatch):
        one = ids[:, :1]
        with counting(backend) as calls, torch.no_grad(), model.trace(one):
            single = model.layers[0].linear_attn.states.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(single, packed_prefixes(plain, one, 0), **TOL)
        monkeypatch.setattr(from_arguments, "ONE_PASS", False)
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            states = model.layers[0].linear_attn.states.save()
            logits = model.logits.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(states, packed_prefixes(plain, ids, 0), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, **TOL)

    def test_a_backend_keeping_its_state_in_bfloat16_runs(self, checkpoint, ids, backend):
        # inference_state_dtype="bfloat16": the arguments stay float32 but the backend's token loop rounds its state.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", inference_state_dtype="bfloat16")
        plain = AutoModelForCausalLM.from_pretrained(path, inference_state_dtype="bfloat16").eval()
        assert ids.shape[1] % model._module.config.chunk_size, "the prompt ends inside a chunk: the token loop runs"
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            for layer in model.layers:
                layer.linear_attn.states.save()
            logits = model.logits.save()
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, rtol=0, atol=1e-6)
        assert len(calls) == len(model.layers), "the backend ran"

    def test_the_one_pass_divides_by_the_backends_own_eps(self, checkpoint, ids, backend):
        # The backend call does not carry config.eps: the spec reads it off the module (MLSTM.FAST_CONSTANTS). A large
        # one moves every output, so a pass that used xLSTM's default instead would miss the plain forward.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", eps=0.05)
        plain = AutoModelForCausalLM.from_pretrained(path, eps=0.05).eval()
        logits = []
        with counting(backend) as calls, torch.no_grad(), model.trace(ids):
            for layer in model.layers:
                layer.linear_attn.states.save()
            logits.append(model.logits.save())
        assert calls == [], "the backend ran although every call's states were read"
        with torch.no_grad():
            expected, default = plain(ids).logits, AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
        assert (expected - default).abs().max() > 1e2 * TOL["atol"], "eps moves the outputs"
        torch.testing.assert_close(logits[0], expected, **TOL)
