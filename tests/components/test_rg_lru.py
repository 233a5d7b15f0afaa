"""The RG-LRU (`RGLRU`, RecurrentGemma): its suite and its own cases.

The plain model keeps the RG-LRU's state on its modules
(`tests.suites.caches.ModuleState`). `RGLRUSuite` is the state contract
(tests/suites/contract.py) against that state, plus what the kind adds: the
RG-LRU written from the paper's equation reproducing the states from the
values nnterp serves, a decode-step write against the scan, several tokens
continuing a state, the convolution window (written entering a decode step or
several tokens), the errors
(tests/reference/rg_lru.py). A family's test file subclasses it and names ``MODEL_TYPE``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from nnterp import NnterpError, NotInTrace, OrderError, ReadOnlyValue
from tests.reference import hf_oracles as hf
from tests.reference import rg_lru as ref
from tests.suites.caches import ModuleState
from tests.suites.contract import StateContract

TOL = dict(rtol=1e-4, atol=2e-5)


class RGLRUSuite(StateContract):
    """An RG-LRU mixer (`RGLRU`): set ``MODEL_TYPE``; ``LAYERS`` are two recurrent blocks."""

    LAYERS = (0, 1)
    CACHE = ModuleState()
    STATE_TOL = LOGIT_TOL = PROB_TOL = TOL
    DECODE_WRITES = (("state_output", 1),)

    WRITE_SCALE = 1.0

    def donor(self, model, plain, layer: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
        """Another prompt's state at ``layer``, a real state; on a decode step scaled, so that one step cannot ignore it."""
        ids = model.tokenizer("A completely different prompt here", return_tensors="pt").input_ids
        return scale * ref.prefix_states(plain, ids, layer)[:, -1]

    def test_labels_are_resolved_from_the_scan_method(self, model):
        mix = model.layers[self.LAYERS[0]].linear_attn
        assert mix.SCAN_KERNEL == "self__rnn_scan_0" and mix.STATE_OP == "recurrent_states_2"
        assert (mix.INPUT_GATE, mix.RECURRENCE_GATE, mix.LOG_DECAY) == ("input_gate_0", "recurrent_gate_0", "log_recurrent_gate_0")
        assert model.support()["linear_attn.states"] is None, "no routing needed: the scan is pure torch"

    # -- the state after every token ---------------------------------------------

    def test_state_iterates_over_tokens_with_tracer_iter(self, model, ids):
        mix = model.layers[self.LAYERS[0]].linear_attn
        collected = []
        with torch.no_grad(), model.trace(ids) as tracer:
            for t in tracer.iter[: ids.shape[1]]:
                collected.append(mix.state.save())
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        with torch.no_grad(), model.trace(ids):
            middle = mix.state_after(3).save()
        assert torch.equal(torch.stack(collected, 1), states) and torch.equal(middle, states[:, 3])

    def test_values_reproduce_states_through_the_paper_recurrence(self, model, ids):
        layer = self.LAYERS[1]
        mix = model.layers[layer].linear_attn
        lru = mix._module.rg_lru
        entering = []  # a None bound inside the trace would not survive it
        with torch.no_grad(), model.trace(ids):
            x = mix.lru_input.save()
            i, r, log_a = mix.input_gates.save(), mix.recurrence_gate.save(), mix.decays.save()
            a, u = mix.recurrent_gate.save(), mix.attention_values.save()
            entering.append(mix.state_input)
            states = mix.states.save()
        expected, g = ref.rg_lru(x, lru, torch.arange(ids.shape[1])[None])
        assert entering == [None], "a prompt starts at position 0, which resets the state"
        for name, got, want in (("i", i, g["i"]), ("r", r, g["r"]), ("log a", log_a, g["log_a"]), ("a", a, g["a"]), ("u", u, g["u"])):
            torch.testing.assert_close(got, want, **TOL, msg=name)
        torch.testing.assert_close(states, expected, **TOL, msg="states")
        torch.testing.assert_close(states, ref.scan(u, a, torch.zeros_like(u, dtype=torch.bool)[..., :1] | (torch.arange(u.shape[1]) == 0)[None, :, None]), rtol=0, atol=1e-6)

    def test_a_written_input_gate_reaches_the_states(self, model, ids):
        mix = model.layers[self.LAYERS[0]].linear_attn
        lru = mix._module.rg_lru
        with torch.no_grad(), model.trace(ids):
            x = mix.lru_input.save()
            mix.input_gates = torch.zeros_like(mix.input_gates)
            mix.recurrent_gate = mix.recurrent_gate * 0 + 0.5
            states = mix.states.save()
        assert torch.count_nonzero(states) == 0, "no input written"
        with torch.no_grad(), model.trace(ids):
            mix.lru_input = x * 2
            u = mix.attention_values.save()
        _, g = ref.rg_lru(x * 2, lru, torch.arange(ids.shape[1])[None])
        torch.testing.assert_close(u, g["u"], **TOL)

    def test_effective_attention_reproduces_the_scan_output(self, model, ids):
        mix = model.layers[self.LAYERS[0]].linear_attn
        with torch.no_grad(), model.trace(ids):
            u = mix.attention_values.save()
            A = mix.effective_attention.save()
            rows = mix.effective_attention_of(positions=[2, -1], channels=[5]).save()
            out = getattr(mix._lru().source, mix.SCAN_KERNEL).output[0].save()
        torch.testing.assert_close(torch.einsum("bcts,bsc->btc", A, u.float()), out, rtol=0, atol=1e-5)
        assert torch.equal(rows[:, 0], A[:, 5, [2, ids.shape[1] - 1]])
        assert torch.equal(torch.triu(A, 1), torch.zeros_like(A)), "causal"

    # -- writing the state inside a prompt ---------------------------------------

    # -- decode steps --------------------------------------------------------------

    def test_generate_steps_each_read_their_own_call(self, model, ids):
        mix = model.layers[self.LAYERS[0]].linear_attn
        with torch.no_grad(), model.trace(ids):
            prompt_states = mix.states.save()
        stacks, outs, entering = [], [], []  # entering: list.append keeps a None across the trace
        with torch.no_grad(), model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:3]:
                entering.append(mix.state_input)
                stacks.append(mix.states.save())
                outs.append(mix.state_output.save())
        assert [s.shape[1] for s in stacks] == [ids.shape[1], 1, 1]
        assert torch.equal(stacks[0], prompt_states) and entering[0] is None
        assert torch.equal(entering[1], outs[0]) and torch.equal(entering[2], outs[1])
        assert torch.equal(stacks[2][:, 0], outs[2]) and not torch.equal(outs[2], outs[1])

    def test_a_decode_step_state_write_continues_as_a_plain_greedy_loop(self, model, plain, ids):
        layer = self.LAYERS[1]
        mix = model.layers[layer].linear_attn
        donor = ref.prefix_states(plain, model.tokenizer("Something else entirely", return_tensors="pt").input_ids, layer)[:, -1]
        read = {}
        with torch.no_grad(), model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                mix.state_input = donor
                read["a"], read["u"] = mix.recurrent_gate.save(), mix.attention_values.save()
                read["out"] = mix.state_output.save()
            tokens = tracer.result.save()
        expected_tokens, _ = ref.greedy(plain, ids, 3, 1, layer, state=donor)
        assert torch.equal(tokens[:, ids.shape[1]:], expected_tokens)
        expected = ref.scan(read["u"], read["a"], torch.zeros_like(read["u"][..., :1], dtype=torch.bool), donor)
        torch.testing.assert_close(read["out"], expected[:, -1], rtol=0, atol=1e-6)

    def test_several_tokens_continuing_a_state_read_it_and_restart_the_convolution(self, model, plain, ids):
        layer = self.LAYERS[0]
        mix = model.layers[layer].linear_attn
        n = ids.shape[1]
        with torch.no_grad(), model.trace(ids[:, :4]):
            first = mix.state_output.save()
        got = []
        positions = torch.arange(4, n)[None]
        # The model returns no cache; a cache passed in keeps the forward from resetting the modules' states.
        cache = DynamicCache(config=model._module.config)
        with torch.no_grad(), model.trace(ids[:, 4:], position_ids=positions, **{hf.cache_kwarg(model._module): cache}):
            got.append(mix.state_input)
            got.append(mix.conv_state_input)
            states = mix.states.save()
        # The oracle: the same two plain calls; the RG-LRU continues, the convolution pads with zeros. The second
        # gets a fresh cache too, as the trace did: before 5.23 the config has no layer_types, every cache layer is a
        # sliding-window one and transformers' own mask misreads the prompt's keys (a several-token call fails).
        ref.prefill(plain, ids[:, :4])
        with torch.no_grad():
            fresh = DynamicCache(config=plain.config)
            plain(ids[:, 4:], use_cache=True, position_ids=positions, **{hf.cache_kwarg(plain): fresh})
        assert torch.equal(got[0], first) and got[1] is None
        torch.testing.assert_close(states[:, -1], ref.block(plain, layer).rg_lru.recurrent_states, **TOL)

    def test_conv_windows_are_the_modules_and_a_written_one_is_convolved(self, model, plain, ids):
        layer = self.LAYERS[0]
        mix = model.layers[layer].linear_attn
        entering = []
        with torch.no_grad(), model.trace(ids):
            entering.append(mix.conv_state_input)
            window = mix.conv_state_output.save()
        ref.prefill(plain, ids)
        assert entering == [None]
        assert torch.equal(window, ref.block(plain, layer).conv1d_state)
        other = torch.randn(window.shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                kept = mix.conv_state_input.save()
                mix.conv_state_input = other
            tokens = tracer.result.save()
        expected_tokens, seen = ref.greedy(plain, ids, 3, 1, layer, window=other)
        assert kept.shape == window.shape
        assert torch.equal(tokens[:, ids.shape[1]:], expected_tokens)

    def test_a_window_written_entering_several_tokens_is_convolved_as_decode_steps_convolve_it(self, model, plain, ids):
        """Every block continues the prefix from the window it kept, one from a random window instead. Oracle:
        transformers' own decode steps, the module's window replaced by hand after the prefix."""
        if not model.family.MENDABLE:
            # transformers itself cannot run the oracle's setting there: nothing for nnterp to match
            pytest.skip(f"transformers {transformers.__version__} misplaces the attention mask of a several-token call "
                        "continuing a RecurrentGemma cache (before 5.23: the family's MENDABLE)")
        k, layer, n = 3, self.LAYERS[1], ids.shape[1]
        mixers = [i for i, block in enumerate(model.layers) if block.linear_attn is not None]
        cache, kept = DynamicCache(config=model._module.config), {}  # the model returns none; its attention needs one
        with torch.no_grad(), model.trace(ids[:, :k], **{hf.cache_kwarg(model._module): cache}):
            for i in mixers:
                kept[i] = model.layers[i].linear_attn.conv_state_output.save()
        other = torch.randn(kept[layer].shape, generator=torch.Generator().manual_seed(0))
        kept[layer] = other
        inputs = {"input_ids": ids[:, k:], "attention_mask": torch.ones_like(ids)}
        with torch.no_grad(), model.trace(inputs, position_ids=torch.arange(k, n)[None], **{hf.cache_kwarg(model._module): cache}):
            for i in mixers:
                model.layers[i].linear_attn.conv_state_input = kept[i]
                if i == layer:
                    entering = model.layers[i].linear_attn.conv_state_input.save()
                    leaving = model.layers[i].linear_attn.conv_state_output.save()
            logits = model.logits.save()
        _, plain_cache = ref.prefill(plain, ids[:, :k])
        ref.block(plain, layer).conv1d_state = other.clone()
        expected = torch.stack([ref.step(plain, ids[:, t : t + 1], t, plain_cache) for t in range(k, n)], 1)
        assert torch.equal(entering, other)
        torch.testing.assert_close(leaving, ref.block(plain, layer).conv1d_state, **TOL)
        torch.testing.assert_close(logits, expected, **TOL)

    def test_the_modules_hold_the_last_calls_state_after_a_trace_as_after_a_plain_forward(self, model, plain, ids):
        layer = self.LAYERS[0]
        weights = {k: v.clone() for k, v in model._module.state_dict().items()}
        with torch.no_grad(), model.trace(ids):
            final = model.layers[layer].linear_attn.state_output.save()
        block = model._module.model.layers[layer].temporal_block
        assert torch.equal(block.rg_lru.recurrent_states, final), "transformers leaves the last call's state there"
        assert all(torch.equal(v, model._module.state_dict()[k]) for k, v in weights.items())

    # -- bad input ---------------------------------------------------------------

    def test_bad_input_raises_nnterp_errors(self, model, ids):
        mix = model.layers[self.LAYERS[0]].linear_attn
        good = torch.zeros(1, mix.dims()["lru_width"])
        n = ids.shape[1]
        cases = {
            "dtype": (lambda: mix.set_state_after(1, good.double()), NnterpError, "dtype"),
            "shape": (lambda: mix.set_state_after(1, good[:, :3]), NnterpError, "shape"),
            "range": (lambda: mix.state_after(n), NnterpError, "outside"),
            "later read first": (lambda: (mix.state_after(3), mix.set_state_after(1, good)), OrderError, "increasing order"),
            "argument after the scan": (lambda: (mix.states, setattr(mix, "recurrent_gate", mix.recurrent_gate)), OrderError, "kernel had started"),
            "gate after the scan": (lambda: (mix.recurrent_gate, mix.input_gates), OrderError, "RG-LRU had computed it"),
            "x after a gate": (lambda: (mix.decays, setattr(mix, "lru_input", mix.decays)), OrderError, "RG-LRU had computed it"),
            "prompt state_input": (lambda: setattr(mix, "state_input", good), NnterpError, "position 0"),
            "prompt conv window": (lambda: setattr(mix, "conv_state_input", torch.zeros(1, 1, 1)), NnterpError, "shape"),
            "read-only": (lambda: setattr(mix, "states", None), ReadOnlyValue, "set_state_after"),
        }
        for name, (action, error, words) in cases.items():
            with pytest.raises(error, match=words):
                with torch.no_grad(), model.trace(ids):
                    action()
        with pytest.raises(NotInTrace):
            mix.states
