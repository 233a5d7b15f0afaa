"""RWKV-4 (`nnterp.families.rwkv`): the WKV suite, and what the family adds (the rescaling, the padding refusal)."""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import NnterpError
from tests.components.test_wkv import WKVSuite
from tests.suites.checkpoint import OTHER, PROMPT


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model._module.named_parameters()}


def _same(before: dict, model) -> bool:
    return all(torch.equal(before[name], p) for name, p in model._module.named_parameters())


class TestRwkv(WKVSuite):
    MODEL_TYPE = "rwkv"

    def test_the_tiny_config_rescales_a_weight(self, model):
        # rescale_every=1 on 2 blocks: transformers' eval forward divides block 1's weights by 2 in place.
        assert model._module.config.rescale_every == 1 and len(model.layers) == 2

    def test_a_trace_and_generate_leave_the_weights_as_they_were(self, model, plain, ids):
        rwkv = model._module.rwkv
        before = _weights(model)
        assert not rwkv.layers_are_rescaled
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        assert _same(before, model) and not rwkv.layers_are_rescaled
        with torch.no_grad():
            expected = plain(ids).logits  # transformers rescales its own model on this first eval forward
        assert plain.rwkv.layers_are_rescaled, "the oracle ran rescaled, as transformers does"
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
            out = tracer.result.save()
        assert _same(before, model) and not rwkv.layers_are_rescaled
        assert out.shape[1] == ids.shape[1] + 3

    def test_a_model_the_user_rescaled_stays_rescaled(self, model, ids):
        rwkv = model._module.rwkv
        before = _weights(model)
        with torch.no_grad():
            model._module(ids)  # the user's own forward: transformers rescales in place
        assert rwkv.layers_are_rescaled and not _same(before, model)
        rescaled = _weights(model)
        try:
            with torch.no_grad(), model.trace(ids):
                model.logits.save()
            assert rwkv.layers_are_rescaled and _same(rescaled, model)
        finally:
            rwkv.train()
            with torch.no_grad():
                model._module(ids)  # a training forward undoes it, as transformers does
            rwkv.eval()
        assert not rwkv.layers_are_rescaled and _same(before, model)

    def test_a_padded_batch_is_refused_before_it_runs(self, model):
        reached = []
        with pytest.raises(NnterpError, match="ignores the attention mask"):
            with torch.no_grad(), model.trace([PROMPT, OTHER]):
                reached.append(True)
                model.logits.save()
        assert reached == []
        with torch.no_grad(), model.trace([PROMPT, PROMPT]):
            batch = model.logits.save()
        assert torch.equal(batch[0], batch[1]), "one length: no padding, served"

    def test_blocks_have_a_mixer_and_a_channel_mixing_mlp(self, model):
        for layer in model.layers:
            assert set(layer.parts()) == {"linear_attn", "mlp"}
            assert type(layer.mlp._module).__name__ == "RwkvFeedForward"


class TestRwkvBatchedDecode:
    """transformers' decode step mixes a batch's rows; the oracle is each prompt generated alone by transformers."""

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, load):
        return load("rwkv")

    @pytest.fixture(scope="class")
    @classmethod
    def rows(cls, model):
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids[0]
        return torch.stack([ids, ids.flip(0)])  # two prompts of one length: no padding

    def test_generate_on_two_rows_is_refused_and_each_row_alone_is_transformers(self, model, checkpoint, rows):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint("rwkv")).eval()
        before = _weights(model)
        with pytest.raises(NnterpError, match="mixes the rows") as raised:
            with torch.no_grad(), model.generate(rows, max_new_tokens=4, do_sample=False) as tracer:
                tracer.result.save()
        assert str(raised.value) == model.family.DECODE_BATCH_REFUSED
        assert _same(before, model) and not model._module.rwkv.layers_are_rescaled
        for row in rows:
            with torch.no_grad(), model.generate(row[None], max_new_tokens=4, do_sample=False) as tracer:
                alone = tracer.result.save()
            with torch.no_grad():
                expected = hf.generate(row[None], max_new_tokens=4, do_sample=False)
            assert torch.equal(alone, expected)

    def test_two_rows_without_a_decode_step_are_served(self, model, checkpoint, rows):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint("rwkv")).eval()
        with torch.no_grad(), model.generate(rows, max_new_tokens=1, do_sample=False) as tracer:
            first = tracer.result.save()
        with torch.no_grad(), model.trace(rows):
            logits = model.logits.save()
        with torch.no_grad():
            expected = torch.cat([hf(row[None]).logits for row in rows])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(first[:, -1], expected[:, -1].argmax(-1))

    def test_several_sequences_from_one_prompt_are_refused(self, model, rows):
        with pytest.raises(NnterpError, match="mixes the rows"):
            with torch.no_grad(), model.generate(rows[:1], max_new_tokens=3, do_sample=True, num_return_sequences=2):
                pass


class TestRwkvRescaleInterrupted:
    """A Ctrl-C at any point of the rescale transformers' forward makes, or of nnterp's undo, leaves the weights as loaded."""

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, load):
        return load("rwkv", fresh=True)

    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls, checkpoint):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint("rwkv")).eval()
        return {name: p.detach().clone() for name, p in hf.named_parameters()}, hf

    @staticmethod
    def interrupting(op: str, at: int | None, monkeypatch) -> list:
        """Patch ``torch.Tensor.<op>`` to send SIGINT (a real Ctrl-C) on its ``at``-th call; returns the call count."""
        original = getattr(torch.Tensor, op)
        calls = []

        def patched(tensor, *args, **kwargs):
            calls.append(threading.current_thread().name)  # a real Ctrl-C reaches Python in the main thread only
            result = original(tensor, *args, **kwargs)
            if len(calls) - 1 == at:
                signal.raise_signal(signal.SIGINT)
            return result

        monkeypatch.setattr(torch.Tensor, op, patched)
        return calls

    @pytest.fixture
    def ctrl_c(self):
        """Ctrl-C raising KeyboardInterrupt for the test: a process started in the background by a shell ignores
        SIGINT (SIG_IGN), and there a real Ctrl-C never interrupts anything."""
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, previous)

    @pytest.mark.parametrize("op", ["div_", "mul_"])
    def test_an_interrupt_at_every_in_place_op_leaves_the_weights_and_the_logits(self, model, loaded, ids_of, op, ctrl_c):
        weights, hf = loaded
        ids = ids_of(model)
        with torch.no_grad(), model.trace(ids):  # a first trace of the model may make one-off calls: count a later one's
            model.logits.save()
        with pytest.MonkeyPatch.context() as monkeypatch:
            calls = self.interrupting(op, None, monkeypatch)
            with torch.no_grad(), model.trace(ids):
                model.logits.save()
        assert len(calls) >= 4, f"the rescale and its undo make {len(calls)} {op} calls"
        for at in range(len(calls)):
            with pytest.MonkeyPatch.context() as monkeypatch:
                seen = self.interrupting(op, at, monkeypatch)
                try:
                    with torch.no_grad(), model.trace(ids):
                        model.logits.save()
                except KeyboardInterrupt:
                    pass
                else:
                    pytest.fail(f"{op} call {at} of the {len(calls)} counted sent no interrupt; this trace made {len(seen)} calls, "
                                f"in threads {seen}; SIGINT's handler is now {signal.getsignal(signal.SIGINT)!r}")
            for name, p in model._module.named_parameters():
                assert torch.equal(p, weights[name]), f"{op} call {at}: {name}"
            assert not model._module.rwkv.layers_are_rescaled, f"{op} call {at}"
            with torch.no_grad(), model.trace(ids):
                logits = model.logits.save()
            with torch.no_grad():
                expected = hf(ids).logits
            torch.testing.assert_close(logits, expected, rtol=0, atol=0, msg=f"{op} call {at}")

    @pytest.fixture
    def ids_of(self):
        return lambda model: model.tokenizer(PROMPT, return_tensors="pt").input_ids
