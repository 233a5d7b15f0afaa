"""`MambaSuite`: the tests every Mamba-like mixer passes, Mamba-1 (`SelectiveScan`) and Mamba-2 (`StateSpace`) alike.

`SelectiveScanSuite` and `StateSpaceSuite` extend it; a family's test file
mixes in one of those. What both mixers share is tested here: decode steps
against a plain greedy loop and transformers' cache (``state_input``,
``state_output``, the convolution windows), and the refusals when an optimized
kernel package (mamba_ssm, causal-conv1d; stood in by `tests.suites.standins`)
is bound.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import RoutingError, Unavailable
from tests.reference import hf_oracles as hf
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures  # noqa: F401  (OTHER: for the suites)
from tests.suites.standins import compiled_kernels, mixer_kernels

NEW = 4
TOL = dict(rtol=1e-4, atol=1e-5)


class MambaSuite(CheckpointFixtures):
    """Tests shared by the Mamba-1 and Mamba-2 suites, with the helpers they use: set ``MODEL_TYPE``."""

    def donor(self, like: torch.Tensor, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return scale * torch.randn(like.shape, generator=generator)

    @pytest.fixture(scope="class")
    @classmethod
    def mixers(cls, model) -> list[int]:
        """The blocks with a recurrent mixer, in order (a hybrid's others have none); the tests use the first two."""
        return [index for index, layer in enumerate(model.layers) if layer.linear_attn is not None]

    def cached_state(self, plain, ids, layer):
        with torch.no_grad():
            return hf.recurrent_state(hf.output_cache(plain(ids, use_cache=True)), layer).clone()

    # -- decode steps against a plain greedy loop (both families) --------------

    @pytest.mark.parametrize("nth", [0, 1])
    def test_decode_state_input_and_output_are_the_cache_before_and_after(self, model, plain, ids, mixers, nth):
        layer = mixers[nth]
        mix = model.layers[layer].linear_attn
        entering, leaving = [], []
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for step in tracer.iter[:NEW]:
                state = mix.state_input
                entering.append(state.save() if state is not None else None)
                leaving.append(mix.state_output.save())
            generated = tracer.result.save()
        before = {}
        expected_ids = hf.greedy(plain, ids, NEW, patch=lambda step, cache: before.__setitem__(step, hf.recurrent_state(cache, layer).clone()))
        assert torch.equal(generated, expected_ids)
        assert entering[0] is None, "nothing enters the prompt"
        for step in range(1, NEW):
            torch.testing.assert_close(entering[step], before[step], **TOL, msg=f"state entering step {step}")
            torch.testing.assert_close(leaving[step - 1], before[step], **TOL, msg=f"state leaving step {step - 1}")

    def test_assigning_state_input_on_a_decode_step_changes_ids_as_hf_greedy(self, model, plain, ids, mixers):
        layer = mixers[0]
        donor = self.donor(self.cached_state(plain, ids, layer), scale=30.0)
        mix = model.layers[layer].linear_attn
        kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        with torch.no_grad(), model.generate(PROMPT, **kwargs) as tracer:
            for step in tracer.iter[1]:
                mix.state_input = donor
            patched = tracer.result.save()

        def patch(step, cache):
            if step == 1:
                hf.set_recurrent_state(cache, layer, donor)

        expected = hf.greedy(plain, ids, NEW, patch=patch)
        assert torch.equal(patched, expected)
        assert not torch.equal(patched, hf.greedy(plain, ids, NEW)), "the patch changes the continuation"

    def test_state_output_written_on_a_decode_step_is_what_the_next_step_starts_from(self, model, mixers):
        mix = model.layers[mixers[1]].linear_attn
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                zeros = torch.zeros_like(mix.state_output)
                mix.state_output = zeros
            for step in tracer.iter[2]:
                entering = mix.state_input.save()
        assert torch.count_nonzero(entering) == 0

    def test_conv_windows_are_the_caches_and_carry_from_step_to_step(self, model, plain, ids, mixers):
        layer = mixers[1]
        mix = model.layers[layer].linear_attn
        with torch.no_grad():
            expected = hf.conv_state(hf.output_cache(plain(ids, use_cache=True)), layer).clone()
        windows = []
        with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                window = mix.conv_state_input
                windows.append((window.save() if window is not None else None, mix.conv_state_output.save()))
        assert windows[0][0] is None, "a fresh prompt's convolution pads with zeros"
        torch.testing.assert_close(windows[0][1], expected, rtol=0, atol=0)
        assert torch.equal(windows[1][0], windows[0][1])
        assert not torch.equal(windows[1][1], windows[0][1]), "the step shifts its input into the window"

    # -- the optimized kernels ---------------------------------------------------

    def test_with_compiled_kernels_values_inside_say_why_and_traces_refuse_to_start(self, model):
        mixer = model.family.MIXER
        with compiled_kernels(model.family.MODELING, mixer_kernels(mixer)):
            support = model.support()
            reason = support["linear_attn.attention_values"][0]
            assert "optimized kernel (mamba_ssm)" in reason and "route_kernels" in reason
            for name, value in mixer.values().items():
                if name not in ("attention_output", "conv_state_input", "conv_state_output"):
                    assert support[f"linear_attn.{name}"] is not None, name
            assert support["layer.layer_output"] is None and support["linear_attn.attention_output"] is None
            reached = []
            with pytest.raises(RoutingError, match="route_kernels"):
                with model.trace(PROMPT):
                    reached.append(True)
                    model.layers[0].layer_output.save()
            assert reached == [], "the trace failed before running anything"
            with nnterp.route_kernels(model.family, "torch"):
                assert model.support()["linear_attn.attention_values"] is None
                with torch.no_grad(), model.trace(PROMPT):
                    routed = model.logits.save()
        with torch.no_grad(), model.trace(PROMPT):
            plain_logits = model.logits.save()
        torch.testing.assert_close(routed, plain_logits, rtol=0, atol=1e-6)

    def test_inside_a_kernel_a_read_raises_unavailable_with_the_reason(self, model, mixers):
        with compiled_kernels(model.family.MODELING, mixer_kernels(model.family.MIXER)):
            reason = model.support()["linear_attn.betas"][0]
            with pytest.raises(Unavailable) as raised:  # said before anything runs, inside a trace or not
                model.layers[mixers[0]].linear_attn.betas
            assert raised.value.reason == reason


