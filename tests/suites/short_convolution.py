"""`ShortConvolutionSuite`: the tests a gated short convolution (LFM2's `ShortConvolution`) passes.

Its only state is the convolution window ``[batch, conv_channels, conv_width]``.
Oracles, none of which uses nnterp: transformers' own cache after each prefix
(the states), a plain forward whose cached window is replaced after token ``t``
and the rest fed one token at a time (``set_state_after``), a plain greedy loop
with a replaced window (decode-step writes), and the recurrence written from
the equation (`tests.reference.short_convolution`) run on the gates and input
nnterp serves (states, outputs, a write to the input, effective attention).
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable
from tests.reference import hf_oracles as hf
from tests.reference.short_convolution import gated_short_convolution
from tests.suites.checkpoint import PROMPT, CheckpointFixtures

NEW = 4
TOL = dict(rtol=1e-5, atol=1e-6)


def windows_after_each_prefix(plain, ids, layer) -> torch.Tensor:
    """``[batch, T, D, L]``: the window transformers caches after each prefix, from independent forwards."""
    found = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            found.append(hf.conv_state(hf.output_cache(plain(ids[:, : t + 1], use_cache=True)), layer).clone())
    return torch.stack(found, dim=1)


def continued_from_window(plain, ids, t, layer, window) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [batch, T, vocab], the last window)``: the prefix up to ``t`` with a cache, its window replaced, the rest one token at a time."""
    with torch.no_grad():
        out = plain(ids[:, : t + 1], use_cache=True)
        cache = hf.output_cache(out)
        hf.set_conv_state(cache, layer, window)
        logits = [out.logits]
        for i in range(t + 1, ids.shape[1]):
            step = plain(ids[:, i : i + 1], use_cache=True, position_ids=torch.tensor([[i]]), **{hf.cache_kwarg(plain): cache})
            logits.append(step.logits)
    return torch.cat(logits, dim=1), hf.conv_state(cache, layer).clone()


class ShortConvolutionSuite(CheckpointFixtures):
    """Set ``MODEL_TYPE``; every test runs on the family's tiny checkpoint against the oracles above."""

    def donor(self, like: torch.Tensor, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return scale * torch.randn(like.shape, generator=generator).to(like.dtype)

    @pytest.fixture(scope="class")
    @classmethod
    def mixers(cls, model) -> list[int]:
        return [index for index, layer in enumerate(model.layers) if layer.linear_attn is not None]

    # -- what is served, and where ---------------------------------------------------

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

    @pytest.mark.parametrize("nth", [0, -1])
    def test_states_are_the_cache_after_each_prefix(self, model, plain, ids, mixers, nth):
        layer = mixers[nth]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
            after = mix.state_after(3).save()
            last = mix.state_output.save()
        expected = windows_after_each_prefix(plain, ids, layer)
        torch.testing.assert_close(states, expected, **TOL)
        assert torch.equal(after, states[:, 3]) and torch.equal(last, states[:, -1])

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
        written = self.donor(torch.zeros(1, ids.shape[1], mix.dims()["conv_channels"]), 1.0)
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
        torch.testing.assert_close(states, windows_after_each_prefix(plain, ids, layer)[:, split:], **TOL)

    # -- writes inside the prompt against a forward continued from a replaced cache ---

    @pytest.mark.parametrize("t", [0, 1, 5, -2])
    def test_set_state_after_is_a_forward_continued_from_a_replaced_window(self, model, plain, ids, mixers, t):
        t = t % ids.shape[1]  # -2: the written window is still part of the one leaving the call
        layer = mixers[1]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            clean = mix.state_after(t).save()
        donor = self.donor(clean)
        with torch.no_grad(), model.trace(ids):
            mix.set_state_after(t, donor)
            read = mix.state_after(t + 1).save()
            last = mix.state_output.save()
            logits = model.logits.save()
        expected, window = continued_from_window(plain, ids, t, layer, donor)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last, window, **TOL, msg="the window leaving the call")
        with torch.no_grad():
            # Close, not equal: a sparse block batches each expert's tokens, so another token's routing moves the rounding.
            torch.testing.assert_close(logits[:, : t + 1], plain(ids).logits[:, : t + 1], rtol=1e-4, atol=1e-5, msg="tokens up to t keep their output")
        assert not torch.allclose(logits[:, t + 1:], plain(ids).logits[:, t + 1:]), "the later tokens read the window"
        assert torch.equal(read[..., :-1], donor[..., 1:]), "the window after t+1 shifts the written one"

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

    def test_set_state_after_the_last_token_is_what_the_next_step_continues_from(self, model, plain, ids, mixers):
        layer = mixers[0]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            donor = self.donor(mix.state_output).save()
        kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        with torch.no_grad(), model.generate(PROMPT, **kwargs) as tracer:
            for step in tracer.iter[0]:
                mix.set_state_after(-1, donor)
            patched = tracer.result.save()

        def patch(step, cache):
            if step == 1:
                hf.set_conv_state(cache, layer, donor)

        assert torch.equal(patched, hf.greedy(plain, ids, NEW, patch=patch))
        assert not torch.equal(patched, hf.greedy(plain, ids, NEW)), "the write changes the continuation"

    # -- decode steps against a plain greedy loop ---------------------------------------

    def test_decode_state_input_and_output_are_the_cache_before_and_after(self, model, plain, ids, mixers):
        layer = mixers[0]
        mix = model.layers[layer].linear_attn
        entering, leaving, states = [], [], []
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for step in tracer.iter[:NEW]:
                state = mix.state_input
                entering.append(state.save() if state is not None else None)
                states.append(mix.states.save())
                leaving.append(mix.state_output.save())
            generated = tracer.result.save()
        before = {}
        expected = hf.greedy(plain, ids, NEW, patch=lambda step, cache: before.__setitem__(step, hf.conv_state(cache, layer).clone()))
        assert torch.equal(generated, expected)
        assert entering[0] is None, "nothing enters the prompt"
        for step in range(1, NEW):
            torch.testing.assert_close(entering[step], before[step], rtol=0, atol=0, msg=f"window entering step {step}")
            torch.testing.assert_close(leaving[step - 1], before[step], rtol=0, atol=0, msg=f"window leaving step {step - 1}")
            assert states[step].shape[1] == 1 and torch.equal(states[step][:, 0], leaving[step]), f"states on step {step}"

    @pytest.mark.parametrize("how", ["state_input", "conv_state_input", "set_state_after"])
    def test_a_decode_step_write_changes_ids_as_hf_greedy(self, model, plain, ids, mixers, how):
        layer = mixers[0]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            donor = self.donor(mix.state_output, scale=30.0).save()
        kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        with torch.no_grad(), model.generate(PROMPT, **kwargs) as tracer:
            for step in tracer.iter[1]:
                if how == "set_state_after":
                    mix.set_state_after(0, donor)
                else:
                    setattr(mix, how, donor)
            patched = tracer.result.save()
        # Entering step 1, or leaving it (so entering step 2).
        at = 2 if how == "set_state_after" else 1

        def patch(step, cache):
            if step == at:
                hf.set_conv_state(cache, layer, donor)

        assert torch.equal(patched, hf.greedy(plain, ids, NEW, patch=patch))
        assert not torch.equal(patched, hf.greedy(plain, ids, NEW)), "the patch changes the continuation"

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
