"""The RWKV-4 time mixing (`WKV`): its suite and its own cases.

The model carries no cache object: its state is the list of five
``[batch, hidden, layers]`` tensors it returns as ``state`` and takes back
with ``state=`` (`tests.suites.caches.WKVState`). `WKVSuite` is the state
contract (tests/suites/contract.py) against that state, plus what the kind
adds: the kernel's arguments and written ones through the WKV written from the
paper (tests/reference/wkv.py), a read-modify-write, the token shift, effective
attention, the errors. A family's test file subclasses it and names ``MODEL_TYPE``.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import NnterpError, NotInTrace, OrderError, ReadOnlyValue
from tests.reference.wkv import wkv
from tests.suites.caches import WKVState
from tests.suites.checkpoint import OTHER, PROMPT
from tests.suites.contract import StateContract

NEW = 4
TOL = dict(rtol=1e-4, atol=1e-5)
WKV_PARTS = (2, 3, 4)
SHIFT = 1


CACHE = WKVState()
wkv_state, set_wkv_state, fresh_state, prefix_states = CACHE.read, CACHE.write, CACHE.fresh, CACHE.prefix_states


def continue_from_state(plain, ids: torch.Tensor, T: int, layer: int, value: torch.Tensor) -> torch.Tensor:
    """The logits of every token after ``T`` once ``layer``'s WKV state after ``T`` is replaced, ``[batch, seq - T - 1, vocab]``."""
    return CACHE.continue_from(plain, ids, T, layer, value)[0]


class WKVSuite(StateContract):
    """An RWKV-4 time mixing (`WKV`): set ``MODEL_TYPE``."""

    CACHE = CACHE
    PROB_TOL = TOL
    DECODE_WRITES = (("state_input", 1), ("state_output", 1))
    DECODE_WRITE_LAYERS = (1,)

    def donor(self, model, plain, layer: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
        """Another prompt's state at ``layer``: a real state, far from this prompt's."""
        with torch.no_grad():
            return wkv_state(plain(model.tokenizer(OTHER, return_tensors="pt").input_ids, use_cache=True).state, layer)

    # -- labels -------------------------------------------------------------------

    def test_labels_are_found_in_the_kernels_source(self, model):
        cls = type(model.layers[0].linear_attn)
        assert cls.CHUNK_KERNEL == cls.RECURRENT_KERNEL == "rwkv_linear_attention_0"
        assert (cls.NUM_OP, cls.DEN_OP, cls.STATE_OP) == ("num_state_1", "den_state_1", "max_state_1")
        assert (cls.NUMERATOR_OP, cls.DENOMINATOR_OP, cls.LOOP_CALL) == ("numerator_0", "denominator_0", "rwkv_linear_attention_cpu_0")
        assert model.support()["linear_attn.states"] is None, "served on CPU with no routing"

    # -- the state after every token ---------------------------------------------

    def test_state_iterates_over_tokens_with_tracer_iter(self, model, ids):
        mix = model.layers[0].linear_attn
        collected = []
        with torch.no_grad(), model.trace(ids) as tracer:
            for t in tracer.iter[: ids.shape[1]]:
                collected.append(mix.state.save())
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        assert torch.equal(torch.stack(collected, 1), states)

    def test_arguments_reproduce_states_and_output_through_the_paper(self, model):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            gate = mix.receptances.save()
            k, v = mix.attention_keys.save(), mix.attention_values.save()
            decay, first, decays = mix.decay_rates.save(), mix.bonus.save(), mix.decays.save()
            states = mix.states.save()
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
            out = mix.attention_output.save()
        outputs, expected = wkv(decay, first, k, v)
        torch.testing.assert_close(states, expected, **TOL, msg="states")
        torch.testing.assert_close(y, outputs, **TOL, msg="kernel output")
        every = mix._module.config.rescale_every
        scale = 2 ** (1 // every) if every > 0 else 1  # the eval forward runs with the output weight divided (block 1)
        torch.testing.assert_close(out, mix._module.output(gate * y) / scale, rtol=0, atol=0, msg="the gate is applied after")
        assert torch.equal(decays, -torch.exp(decay)) and (decays < 0).all()
        assert torch.equal(decay, mix._module.time_decay) and torch.equal(first, mix._module.time_first)

    def test_written_arguments_reach_the_kernel(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            k, v = mix.attention_keys.save(), mix.attention_values.save()
            decay = (mix.decay_rates + 1.0).save()
            first = (mix.bonus * 0).save()
            mix.decay_rates, mix.bonus = decay, first
            keys = (k * 0.5).save()
            mix.attention_keys = keys
            states = mix.states.save()
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        outputs, expected = wkv(decay, first, keys, v)
        torch.testing.assert_close(states, expected, **TOL)
        torch.testing.assert_close(y, outputs, **TOL)
        assert not torch.equal(decay, mix._module.time_decay + 0), "the write changed the call, not the parameter"

    def test_receptances_written_gate_the_output(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            mix.receptances = torch.zeros_like(mix.receptances)
            out = mix.attention_output.save()
        assert torch.count_nonzero(out) == 0

    # -- decode steps against a plain greedy loop ------------------------------

    def test_generate_steps_each_read_their_own_call(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            prompt_states = mix.states.save()
        seqs, stacks, outs = [], [], []
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:3]:
                seqs.append(mix._token_op().seq)
                stacks.append(mix.states.save())
                outs.append(mix.state_output.save())
        assert seqs == [prompt_states.shape[1], 1, 1]
        assert torch.equal(stacks[0], prompt_states)
        assert torch.equal(stacks[2][:, 0], outs[2]) and not torch.equal(stacks[2][:, 0], outs[1])

    # -- writing the state inside a prompt ---------------------------------------

    def test_a_read_then_a_write_at_the_same_token_and_the_next_read(self, model, plain, ids):
        # Read-modify-write at T: the tokens after T continue from the halved state.
        layer, T = 0, 3
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            state = mix.state_after(T)
            halved = state.clone()
            halved[:, :2] = state[:, :2] * 0.5  # numerator and denominator: the same average, half the weight
            mix.set_state_after(T, halved)
            following = mix.state_after(T + 1).save()
            logits = model.logits.save()
            halved = halved.save()
        torch.testing.assert_close(logits[:, T + 1 :], continue_from_state(plain, ids, T, layer, halved), **TOL)
        with torch.no_grad(), model.trace(ids):
            k, v = mix.attention_keys.save(), mix.attention_values.save()
        _, reference = wkv(mix._module.time_decay, mix._module.time_first, k[:, T + 1 :], v[:, T + 1 :], halved)
        torch.testing.assert_close(following, reference[:, 0], **TOL)

    def test_set_state_after_the_last_token_is_the_returned_state(self, model, plain, ids):
        layer = 1
        donor = self.donor(model, plain, layer)
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            mix.set_state_after(-1, donor)
            final = mix.state_output.save()
            returned = model.output.state[WKV_PARTS[0]].save()
        assert torch.equal(final, donor) and torch.equal(returned[:, :, layer], donor[:, 0])

    def test_state_input_written_on_a_prompt_continues_from_it(self, model, plain, ids):
        layer = 0
        donor = self.donor(model, plain, layer)
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            mix.state_input = donor
            probs = model.next_token_probs.save()
        state = fresh_state(plain, ids.shape[0])
        set_wkv_state(state, layer, donor)
        with torch.no_grad():
            expected = torch.softmax(plain(ids, state=state, use_cache=True).logits[:, -1], -1)
        torch.testing.assert_close(probs, expected, **TOL)

    # -- the token shift --------------------------------------------------------

    def test_token_shift_windows_are_the_models_and_carry_from_step_to_step(self, model, plain, ids):
        layer = 1
        mix = model.layers[layer].linear_attn
        with torch.no_grad():
            expected = plain(ids, use_cache=True).state[SHIFT][:, :, layer].clone()
        windows = []
        with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                window = mix.conv_state_input
                windows.append((window.save() if window is not None else None, mix.conv_state_output.save()))
        assert windows[0][0] is None, "a fresh prompt shifts in zeros"
        torch.testing.assert_close(windows[0][1][..., 0], expected, rtol=0, atol=0)
        assert torch.equal(windows[1][0], windows[0][1])
        assert not torch.equal(windows[1][1], windows[0][1])

    def test_token_shift_written_on_a_decode_step_is_what_it_mixes_with(self, model, plain, ids):
        layer = 0
        mix = model.layers[layer].linear_attn
        zeros = torch.zeros(1, mix.dims()["conv_channels"], 1)
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                mix.conv_state_input = zeros
            patched = tracer.result.save()

        def patch(step, state):
            if step == 1:
                state[SHIFT][:, :, layer] = 0

        assert torch.equal(patched, CACHE.greedy(plain, ids, 3, patch=patch))

    # -- bad input ---------------------------------------------------------------

    def test_bad_input_raises_nnterp_errors(self, model, plain, ids):
        mix = model.layers[0].linear_attn
        good = self.donor(model, plain, 0)
        n = ids.shape[1]
        cases = {
            "dtype": (lambda: mix.set_state_after(1, good.double()), NnterpError, "dtype"),
            "shape": (lambda: mix.set_state_after(1, good[:, :2]), NnterpError, "shape"),
            "range": (lambda: mix.state_after(n), NnterpError, "outside"),
            "not an int": (lambda: mix.state_after(1.0), NnterpError, "int"),
            "later read first": (lambda: (mix.state_after(3), mix.set_state_after(1, good)), OrderError, "increasing order"),
            "argument after the kernel": (lambda: (mix.states, setattr(mix, "bonus", mix.bonus)), OrderError, "kernel had started"),
            "argument shape": (lambda: setattr(mix, "attention_keys", mix.attention_keys[:, :1]), NnterpError, "shape"),
            "read-only": (lambda: setattr(mix, "states", None), ReadOnlyValue, "set_state_after"),
            "read-only decays": (lambda: setattr(mix, "decays", None), ReadOnlyValue, "computed"),
            "unknown argument": (lambda: mix.argument("nope"), NnterpError, "one of"),
        }
        for name, (action, error, words) in cases.items():
            with pytest.raises(error, match=words):
                with torch.no_grad(), model.trace(ids):
                    action()
        with pytest.raises(NotInTrace):
            mix.states
        with pytest.raises(NnterpError, match="use_cache"):
            with torch.no_grad(), model.trace(ids, use_cache=False):
                mix.state_output

    # -- effective attention -------------------------------------------------------

    def test_effective_attention_reproduces_the_kernel_output(self, model):
        mix = model.layers[1].linear_attn
        readout = []  # bound outside: a list first bound in the block does not survive it
        with torch.no_grad(), model.trace(PROMPT):
            v = mix.attention_values.save()
            A = mix.effective_attention.save()
            some = mix.effective_attention_of(positions=[-1, 2], channels=[5, 0]).save()
            readout.append(mix.state_input_readout)
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        assert readout == [None], "a fresh prompt reads nothing from a state"
        torch.testing.assert_close(torch.einsum("bcts,bsc->btc", A, v), y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(A.sum(-1), torch.ones_like(A[..., 0]), rtol=1e-5, atol=1e-5, msg="an average")
        assert torch.equal(A.triu(1), torch.zeros_like(A)), "causal"
        torch.testing.assert_close(some, A[:, [5, 0]][:, :, [-1, 2]], rtol=1e-6, atol=1e-7)

    def test_effective_attention_on_a_decode_step_with_the_entering_state(self, model):
        mix = model.layers[0].linear_attn
        read = {}
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                read["v"] = mix.attention_values.save()
                read["A"] = mix.effective_attention.save()
                read["readout"] = mix.state_input_readout.save()
                read["y"] = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        A, v, readout, y = read["A"], read["v"], read["readout"], read["y"]
        assert A.shape[2:] == (1, 1) and readout.shape == y.shape
        torch.testing.assert_close(torch.einsum("bcts,bsc->btc", A, v) + readout, y, rtol=1e-5, atol=1e-5)
        assert (A < 1).all() and (readout != 0).any(), "the entering state takes a share"
