"""`MLSTMSuite`: the oracle checks every mLSTM family (xLSTM) passes.

A family's test file mixes it in and names its checkpoint::

    class TestXLSTM(MLSTMSuite):
        MODEL_TYPE = "xlstm"

Every check compares what nnterp reads or writes on a family's ``linear_attn``
with an oracle that does not use nnterp: the plain model's ``xLSTMCache`` after
a forward over each prefix (`mlstm.prefix_states`), a plain forward whose
cached state was replaced after a token and continued one token at a time
(`mlstm.continue_from_state`), a plain greedy loop with a state replaced
before a decode step (`mlstm.greedy`), and the recurrence written from the
paper (`mlstm.mlstm`). A donor state comes from another prompt, so a patch
carries its own C, n and m together (the packed state).
"""

from __future__ import annotations

import pytest
import torch

from nnterp.components.mlstm import MLSTM
from tests.reference import hf_oracles as hf
from tests.reference import mlstm as ref
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures

NEW = 4
#: What the mLSTM does not serve, and the words its reason must contain.
UNAVAILABLE = {"state": "tracer.iter"}


def donor(model, layer: int, prompt: str = OTHER) -> torch.Tensor:
    """Layer ``layer``'s packed state after another prompt's last token."""
    with torch.no_grad(), model.trace(prompt):
        state = model.layers[layer].linear_attn.state_output.save()
    return state


def strong(state: torch.Tensor, gain: float = 30.0) -> torch.Tensor:
    """``state`` with its memory C amplified (n and m kept): a patch a one-token decode step cannot ignore."""
    c, n, m = MLSTM.unpack(state)
    return MLSTM.pack(c * gain, n, m)


def unpacked(states: torch.Tensor) -> tuple:
    """``(C, n, m)`` of packed states ``[..., key_dim, value_dim + 2]``, ``m`` without its last axis."""
    c, n, m = MLSTM.unpack(states)
    return c, n, m[..., 0]


def suppressed(plain) -> tuple:
    return (plain.config.eos_token_id,)


class MLSTMSuite(CheckpointFixtures):
    """Tests of an mLSTM mixer (`MLSTM`): set ``MODEL_TYPE``."""

    def test_support_serves_every_value_but_the_iterated_state(self, model):
        support = model.support()
        for name in MLSTM.values():
            entry = support[f"linear_attn.{name}"]
            if name in UNAVAILABLE:
                assert entry is not None and all(UNAVAILABLE[name] in reason for reason in entry), name
            else:
                assert entry is None, f"linear_attn.{name}: {entry}"

    def test_the_packed_state_is_c_then_n_then_m(self):
        c, n, m = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), torch.randn(2, 3, 1)
        packed = MLSTM.pack(c, n, m)
        assert packed.shape == (2, 3, 4, 7)
        assert torch.equal(packed[..., :5], c) and torch.equal(packed[..., 5], n) and torch.equal(packed[..., 2, 6:], m)
        for got, expected in zip(MLSTM.unpack(packed), (c, n, m)):
            assert torch.equal(got, expected)

    @pytest.mark.parametrize("layer", [0, 1])
    def test_states_equal_the_cache_after_each_prefix(self, model, plain, ids, layer):
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
            final = mix.state_output.save()
        expected = ref.prefix_states(plain, ids, layer)
        for name, got, want in zip("Cnm", unpacked(states), (*expected[:2], expected[2][..., 0])):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"layer {layer}: {name} vs the cache per prefix")
        torch.testing.assert_close(states[:, -1], final, rtol=1e-5, atol=1e-6)

    def test_state_after_is_the_state_of_states(self, model, ids):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(ids):
            early = mix.state_after(2).save()
            late = mix.state_after(-1).save()
        with torch.no_grad(), model.trace(ids):
            some = mix.states_of([5, -1, 2, 5]).save()
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        assert torch.equal(early, states[:, 2]) and torch.equal(late, states[:, -1])
        assert torch.equal(some, states[:, [5, -1, 2, 5]])

    def test_kernel_arguments_reproduce_states_through_the_paper_recurrence(self, model):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            q, k, v = mix.attention_queries.save(), mix.attention_keys.save(), mix.attention_values.save()
            i, f, decays = mix.input_gates.save(), mix.forget_gates.save(), mix.decays.save()
            states = mix.states.save()
            h = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        out, c, n, m = ref.mlstm(q, k, v, i, f)
        for name, got, want in zip("Cnm", unpacked(states), (c, n, m)):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(h.transpose(1, 2).double(), out, rtol=1e-4, atol=1e-5, msg="the kernel's output")
        assert (decays <= 0).all() and torch.equal(decays, torch.nn.functional.logsigmoid(f))

    @pytest.mark.parametrize("T", [0, 3, -2, -1])
    def test_set_state_after_continues_like_a_replaced_cache(self, model, plain, ids, T):
        layer, value = 1, donor(model, 1)
        with torch.no_grad(), model.trace(ids):
            mix = model.layers[layer].linear_attn
            mix.set_state_after(T, value)
            read = mix.state_after(T).save()
            final = mix.state_output.save()
            logits = model.logits.save()
        position = T % ids.shape[1]
        with torch.no_grad():
            expected = ref.continue_from_state(plain, ids, position, layer, MLSTM.unpack(value))
            clean = plain(ids).logits
        torch.testing.assert_close(logits[:, -1], expected, rtol=1e-4, atol=1e-5)
        # Token T's own output read the state it computed: logits up to T are the clean run's.
        torch.testing.assert_close(logits[:, : position + 1], clean[:, : position + 1], rtol=1e-4, atol=1e-5)
        assert torch.equal(read, value)
        if position == ids.shape[1] - 1:
            assert torch.equal(final, value)
        else:
            assert not torch.allclose(logits[:, -1], clean[:, -1], atol=1e-4), "the patch changes the prediction"

    def test_state_input_on_a_prompt_continues_like_a_cache_holding_it(self, model, plain, ids):
        # transformers' prompt kernel starts from the cached state (unlike Mamba-1's): a fresh cache with one layer's
        # state replaced, then the whole prompt in one call.
        from transformers.models.xlstm.modeling_xlstm import xLSTMCache

        layer, value = 1, donor(model, 1)
        with torch.no_grad(), model.trace(ids):
            model.layers[layer].linear_attn.state_input = value
            logits = model.logits.save()
        cache = xLSTMCache(plain.config, ids.shape[0], dtype=torch.float32)
        ref.set_layer_state(cache, layer, MLSTM.unpack(value))
        with torch.no_grad():
            expected = plain(ids, use_cache=True, **{hf.cache_kwarg(plain): cache}).logits
            clean = plain(ids).logits
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(logits, clean, atol=1e-4), "the entering state changes the outputs"

    @pytest.mark.parametrize("step", [1, 2])
    def test_state_input_on_a_decode_step_generates_like_hf(self, model, plain, ids, step):
        donors = {layer: strong(donor(model, layer)) for layer in range(len(model.layers))}
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[step]:
                for layer, value in donors.items():
                    model.layers[layer].linear_attn.state_input = value
            patched = tracer.result.save()

        def patch(at, cache):
            if at == step:
                for layer, value in donors.items():
                    ref.set_layer_state(cache, layer, MLSTM.unpack(value))

        assert torch.equal(patched, ref.greedy(plain, ids, NEW, patch, suppressed(plain)))
        assert not torch.equal(patched, ref.greedy(plain, ids, NEW, suppress=suppressed(plain))), "the patch changes the continuation"

    def test_set_state_after_on_a_decode_step_is_the_next_steps_cache(self, model, plain, ids):
        value = donor(model, 0)
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                model.layers[0].linear_attn.set_state_after(0, value)
            patched = tracer.result.save()

        def patch(at, cache):
            if at == 2:
                ref.set_layer_state(cache, 0, MLSTM.unpack(value))

        assert torch.equal(patched, ref.greedy(plain, ids, NEW, patch, suppressed(plain)))
        assert not torch.equal(patched, ref.greedy(plain, ids, NEW, suppress=suppressed(plain))), "the patch changes the continuation"

    def test_state_output_of_each_step_is_the_cache(self, model, plain, ids):
        mix = model.layers[1].linear_attn
        outs, ins = [], []
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[:NEW]:
                entering = mix.state_input
                ins.append(entering.save() if entering is not None else None)
                outs.append(mix.state_output.save())
            result = tracer.result.save()
        seen = {}
        ref.greedy(plain, ids, NEW, lambda at, cache: seen.__setitem__(at, MLSTM.pack(*cache.rnn_state[1])), suppressed(plain))
        assert ins[0] is None
        for step in range(1, NEW):
            torch.testing.assert_close(outs[step - 1], seen[step], rtol=1e-5, atol=1e-6, msg=f"state after step {step - 1}")
            assert torch.equal(ins[step], outs[step - 1]), f"step {step} enters from step {step - 1}'s state"
        assert torch.equal(result, ref.greedy(plain, ids, NEW, suppress=suppressed(plain)))

    def test_gradients_reach_the_arguments_and_a_written_state(self, model, ids):
        # transformers copies each block's state into its cache in place: a backward pass needs use_cache=False.
        assert model.family.BACKWARD_KWARGS == {"use_cache": False}
        mix = model.layers[0].linear_attn
        with model.trace(ids, use_cache=False):
            values = mix.attention_values.save()
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                g_values = values.grad.save()
        with model.trace(ids, use_cache=False):
            forget = mix.forget_gates.save()
            decays = mix.decays.save()
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                # In the order the backward pass reaches them: the decays the kernel reads, then the gates they come from.
                g_decays, g_forget = decays.grad.save(), forget.grad.save()
        assert g_values.abs().sum() > 0 and g_decays.abs().sum() > 0
        # The chain rule through d = log sigmoid(f): dL/df = dL/dd * sigmoid(-f).
        torch.testing.assert_close(g_forget, g_decays * torch.sigmoid(-forget.detach()), rtol=1e-4, atol=1e-8)
        with torch.no_grad(), model.trace(ids):
            state = mix.state_after(2).save()
        target = (state * 1.1).requires_grad_(True)
        with model.trace(ids, use_cache=False):
            mix.set_state_after(2, target)
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                g_target = target.grad.save()
        assert g_target.abs().sum() > 0, "the split backend reads the written state"

    def test_writes_after_the_kernel_ran_or_out_of_order_raise(self, model, ids):
        from nnterp import OrderError

        mix = model.layers[0].linear_attn
        value = donor(model, 0)
        with pytest.raises(OrderError), torch.no_grad(), model.trace(ids):
            mix.state_output.save()
            mix.set_state_after(1, value)
        with pytest.raises(OrderError), torch.no_grad(), model.trace(ids):
            mix.state_after(4).save()
            mix.set_state_after(2, value)
