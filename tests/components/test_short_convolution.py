"""The gated short convolution (`ShortConvolution`, LFM2): its suite and its own cases.

Its only state is the convolution window ``[batch, conv_channels, conv_width]``.
`ShortConvolutionSuite` is the state contract (tests/suites/contract.py,
against the window in transformers' cache) plus what the kind adds, against
the recurrence written from the equation (`tests.reference.short_convolution`)
run on the gates and input nnterp serves (states, outputs, a write to the
input, effective attention), a prompt continuing a cache, and two invokes. A
family's test file subclasses it and names ``MODEL_TYPE``.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable
from tests.reference import hf_oracles as hf
from tests.reference.short_convolution import gated_short_convolution
from tests.suites.caches import ConvCache
from tests.suites.checkpoint import PROMPT
from tests.suites.contract import StateContract
from tests.suites.standins import Compiled, compiled_kernels

TOL = dict(rtol=1e-5, atol=1e-6)


CACHE = ConvCache()


class ShortConvolutionSuite(StateContract):
    """A gated short convolution (`ShortConvolution`): set ``MODEL_TYPE``."""

    CACHE = CACHE
    STATE_TOL = TOL
    DECODE_TOL = dict(rtol=0, atol=0)
    STATE_LAYERS = (0, -1)
    WRITE_AT = (0, 1, 5, -2)
    CHANGE_ATOL = 1e-4
    DECODE_LAYERS = (0,)
    DECODE_WRITES = (("set_state_after", 0), ("state_input", 1), ("conv_state_input", 1), ("set_state_after", 1))
    DECODE_STATES = True

    def check_write(self, donor, later):
        assert torch.equal(later[..., :-1], donor[..., 1:]), "the window after t+1 shifts the written one"

    def random_like(self, like: torch.Tensor, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return scale * torch.randn(like.shape, generator=generator).to(like.dtype)

    @pytest.fixture(scope="class")
    @classmethod
    def mixers(cls, model) -> list[int]:
        return [index for index, layer in enumerate(model.layers) if layer.linear_attn is not None]

    # -- what is served, and where ---------------------------------------------------

    def test_a_compiled_convolution_serves_the_windows_from_its_call(self, model, ids, mixers):
        """With causal-conv1d bound (a stand-in running the pure-torch body), the windows, the convolution's input, a
        write and a skip knockout are all cut from the kernel call's own input: equal to the pure-torch run's."""
        layer = mixers[0]
        names = (model.family.MIXER.CHUNK_FUNCTION, model.family.MIXER.RECURRENT_FUNCTION)

        def run():
            mix, got = model.layers[layer].linear_attn, {}
            with torch.no_grad(), model.trace(ids):
                got["conv_input"] = mix.conv_input.save()
                got["states"] = mix.states.save()
            with torch.no_grad(), model.trace(ids):
                mix.set_state_after(1, 2 * mix.state_after(1))
                got["written"] = model.logits.save()
            with torch.no_grad(), model.trace(ids):
                mix.knockout([1, 2], mode="skip")
                got["skipped"] = model.logits.save()
            return got

        before, support = run(), model.support()
        with compiled_kernels(model.family.MODELING, names, Compiled) as bound:
            assert model.support() == support, "a compiled convolution refuses nothing more"
            found = run()
            assert bound[names[0]].calls > 0, "the compiled convolution ran the prompts"
        for name, value in before.items():
            assert torch.equal(found[name], value), name

    def test_the_mixers_are_the_conv_blocks_of_layer_types(self, model, mixers):
        config = model._module.config
        assert mixers == [i for i, kind in enumerate(config.layer_types) if kind == "conv"]
        assert "full_attention" in config.layer_types and mixers[0] == 0
        assert model.layers[mixers[0]].linear_attn.dims() == {"conv_channels": config.hidden_size, "conv_width": config.conv_L_cache}

    def test_state_under_tracer_iter_is_unavailable_with_the_reason_support_gives(self, model, mixers):
        reason = model.support()["linear_attn.state"][mixers[0]]
        assert "no location occurs once per token" in reason
        assert model.support()["linear_attn.states"] is None
        mix = model.layers[mixers[0]].linear_attn
        with pytest.raises(Unavailable) as raised, torch.no_grad(), model.trace(PROMPT) as tracer:
            for _ in tracer.iter[1]:
                mix.state
        assert raised.value.reason == reason

    # -- the states against the cache and the reference recurrence -------------------

    def test_the_reference_recurrence_on_the_served_gates_gives_states_and_output(self, model, ids, mixers):
        mix = model.layers[mixers[0]].linear_attn
        with torch.no_grad(), model.trace(ids):
            B, C, x = mix.input_gates.save(), mix.output_gates.save(), mix.attention_values.save()
            u = mix.conv_input.save()
            states = mix.states.save()
            output = mix.attention_output.save()
        module = mix._module
        y, windows = gated_short_convolution(B, C, x, module.conv.weight.squeeze(1), module.conv.bias)
        torch.testing.assert_close(states, windows, **TOL)
        torch.testing.assert_close(u, B * x, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(output, module.out_proj(y), **TOL)

    def test_a_write_to_the_input_is_what_the_convolution_reads(self, model, ids, mixers):
        mix = model.layers[mixers[0]].linear_attn
        written = self.random_like(torch.zeros(1, ids.shape[1], mix.dims()["conv_channels"]), 1.0)
        with torch.no_grad(), model.trace(ids):
            B, C = mix.input_gates.save(), mix.output_gates.save()
            mix.attention_values = written
            states = mix.states.save()
            output = mix.attention_output.save()
        module = mix._module
        y, windows = gated_short_convolution(B, C, written, module.conv.weight.squeeze(1), module.conv.bias)
        torch.testing.assert_close(states, windows, **TOL)
        with torch.no_grad():
            torch.testing.assert_close(output, module.out_proj(y), **TOL)

    def test_a_prompt_continuing_a_cache_starts_from_its_window(self, model, plain, ids, mixers):
        # Several tokens over a kept window: the kernel sees [window; inputs], and the states continue it.
        layer, split = mixers[1], 6
        with torch.no_grad():
            cache = hf.output_cache(plain(ids[:, :split], use_cache=True))
            entering = hf.conv_state(cache, layer).clone()
        mix = model.layers[layer].linear_attn
        positions = torch.arange(split, ids.shape[1])[None]
        with torch.no_grad(), model.trace(ids[:, split:], position_ids=positions, **{hf.cache_kwarg(model._module): cache}):
            window = mix.state_input.save()
            B, C, x = mix.input_gates.save(), mix.output_gates.save(), mix.attention_values.save()
            states = mix.states.save()
            A, readout = mix.effective_attention.save(), mix.state_input_readout.save()
            last = mix.state_output.save()
        y, windows = gated_short_convolution(B, C, x, mix._module.conv.weight.squeeze(1), mix._module.conv.bias, entering)
        assert torch.equal(window, entering)
        torch.testing.assert_close(states, windows, **TOL)
        assert torch.equal(states[:, -1], last) and states.shape[1] == ids.shape[1] - split
        torch.testing.assert_close(C * (torch.einsum("bcts,bsc->btc", A, x) + readout), y, **TOL)
        torch.testing.assert_close(states, CACHE.prefix_states(plain, ids, layer)[:, split:], **TOL)

    # -- writes inside the prompt against a forward continued from a replaced cache ---

    def test_a_write_in_one_invoke_of_two_leaves_the_other(self, model, mixers):
        mix = model.layers[mixers[0]].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            donor = (mix.state_after(-1) * 3).save()
            alone = mix.state_output.save()
        with torch.no_grad(), model.trace(PROMPT):
            mix.set_state_after(4, donor)
            patched_alone = model.next_token_probs.save()
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                mix.set_state_after(4, donor)
                patched = model.next_token_probs.save()
            with tracer.invoke(PROMPT):
                untouched = mix.state_output.save()
                probs = model.next_token_probs.save()
            with tracer.invoke(PROMPT):
                mix.set_state_after(-1, donor)
                written = mix.state_output.save()
        with torch.no_grad(), model.trace(PROMPT):
            clean = model.next_token_probs.save()
        torch.testing.assert_close(patched, patched_alone, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(probs, clean, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(patched, clean)
        torch.testing.assert_close(untouched, alone, **TOL, msg="the cache's other rows")
        assert torch.equal(written, donor), "this invoke's row of the cache"

    @pytest.mark.parametrize("first, second", [(1, 2), (2, 6), (0, -1)])
    def test_two_writes_in_one_call_convolve_each_part_over_its_window(self, model, ids, mixers, first, second):
        """Each write splits the kernel call (`run_kernel`): against the reference convolution run on each part
        from the window entering it, the written ones included, adjacent writes (both read by the same later
        tokens' predecessors) and one on the last token; the cache keeps the last part's window."""
        layer = mixers[-1]
        mix = model.layers[layer].linear_attn
        width = mix.dims()["conv_width"]
        w1, w2 = (self.random_like(torch.zeros(1, mix.dims()["conv_channels"], width), seed=seed) for seed in (1, 2))
        with torch.no_grad(), model.trace(ids):
            B, C, x = mix.input_gates.save(), mix.output_gates.save(), mix.attention_values.save()
            mix.set_state_after(first, w1)
            mix.set_state_after(second, w2)
            output = mix.attention_output.save()
            kept = mix.state_output.save()
        module, seq = mix._module, ids.shape[1]
        weight, bias = module.conv.weight.squeeze(1), module.conv.bias
        second = second % seq
        y, windows = [], []
        for lo, hi, window in ((0, first + 1, None), (first + 1, second + 1, w1), (second + 1, seq, w2)):
            if hi == lo:
                continue  # the second write on the last token: no token reads it in this call
            part = gated_short_convolution(B[:, lo:hi], C[:, lo:hi], x[:, lo:hi], weight, bias, window)
            y.append(part[0])
            windows.append(part[1])
        with torch.no_grad():
            torch.testing.assert_close(output, module.out_proj(torch.cat(y, 1)), **TOL)
        last = w2 if second == seq - 1 else torch.cat(windows, 1)[:, -1]
        torch.testing.assert_close(kept.float(), last, **TOL)

    def test_under_autograd_states_of_follows_the_inputs_and_states_is_what_the_outputs_read(self, model, ids, mixers):
        """``states_of`` is a function of the inputs (the reference windows' gradient); ``states`` is the tapped
        leaf, with the same values (its gradient against finite differences: tests/recurrent/test_gradients.py)."""
        mix = model.layers[mixers[0]].linear_attn
        with model.trace(ids):
            B, x = mix.input_gates.save(), mix.attention_values.save()
            got = mix.states_of([6, 2]).save()
            states = mix.states.save()
        assert states.is_leaf and states.requires_grad
        _, windows = gated_short_convolution(B, B, x, mix._module.conv.weight.squeeze(1).detach())
        torch.testing.assert_close(states.detach(), windows.detach(), **TOL)
        weights = self.random_like(got)
        (want,) = torch.autograd.grad((windows[:, [6, 2]] * weights).sum(), x, retain_graph=True)
        (grad,) = torch.autograd.grad((got * weights).sum(), x)
        torch.testing.assert_close(grad, want, **TOL)

    def test_states_grad_on_a_prompt_continuing_a_cache(self, model, plain, ids, mixers):
        """Over a kept window the kernel's output holds the window's entries before the call's tokens: ``states.grad``
        (the tap added on the call's own) against central differences of set_state_after, the same loss."""
        layer, split = mixers[0], 6
        mix = model.layers[layer].linear_attn
        positions = torch.arange(split, ids.shape[1])[None]

        def trace():  # a fresh cache each run: the forward writes its window into it
            with torch.no_grad():
                cache = hf.output_cache(plain(ids[:, :split], use_cache=True))
            return model.trace(ids[:, split:], position_ids=positions, **{hf.cache_kwarg(model._module): cache})

        with trace():
            states = mix.states.save()
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                grad = states.grad.save()
        plain_states = states.detach()
        for t, seed in ((0, 1), (2, 2)):
            direction = self.random_like(plain_states[:, t], 1.0, seed) * plain_states[:, t].abs().mean()
            numeric = []
            for eps in (1e-1, 3e-2):
                ends = []
                for sign in (1, -1):
                    with torch.no_grad(), trace():
                        mix.set_state_after(t, plain_states[:, t] + sign * eps * direction)
                        ends.append(model.logits[0, -1].log_softmax(-1)[3].save())
                numeric.append(float((ends[0] - ends[1]) / (2 * eps)))
            analytic = float((grad[:, t] * direction).sum())
            assert any(abs(analytic - n) <= 3e-2 * abs(n) + 1e-5 for n in numeric), (t, analytic, numeric)

    # -- decode steps against a plain greedy loop ---------------------------------------

    # -- effective attention ---------------------------------------------------------

    def test_effective_attention_reproduces_the_gated_convolution(self, model, mixers):
        mix = model.layers[mixers[0]].linear_attn
        got = []
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                A = mix.effective_attention.save()
                readout = mix.state_input_readout
                B, C, x = mix.input_gates.save(), mix.output_gates.save(), mix.attention_values.save()
                entering = mix.state_input
                rows = mix.effective_attention_of(positions=[-1], channels=[0, 5]).save()
                got.append((A, readout.save() if readout is not None else None, B, C, x, entering.save() if entering is not None else None, rows))
        prompt, decode = got
        A, readout, B, C, x, _, rows = prompt
        weight = mix._module.conv.weight.squeeze(1)
        y, _ = gated_short_convolution(B, C, x, weight)
        assert readout is None and A.shape == (1, x.shape[2], x.shape[1], x.shape[1])
        torch.testing.assert_close(C * torch.einsum("bcts,bsc->btc", A, x), y, **TOL)
        assert torch.equal(rows, A[:, [0, 5]][:, :, [-1]])
        assert torch.count_nonzero(A[0, 0].tril(-weight.shape[1])) == 0, "a token reads only the last L inputs"
        A, readout, B, C, x, window, _ = decode
        y, _ = gated_short_convolution(B, C, x, weight, window=window)
        torch.testing.assert_close(C * (torch.einsum("bcts,bsc->btc", A, x) + readout), y, **TOL)
