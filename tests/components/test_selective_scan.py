"""SelectiveScan (Mamba-1): its suite, what it shares with Mamba-2, and its own cases.

`SelectiveScanSuite` is the state contract (tests/suites/contract.py, against
transformers' cache) plus what every Mamba-1 family passes; a family's test
file subclasses it and names ``MODEL_TYPE``. `MambaCases` holds what Mamba-1
and Mamba-2 (tests/components/test_state_space.py) share: the convolution
windows on decode steps and the refusals while an optimized kernel package
(mamba_ssm, causal-conv1d; stood in by `tests.suites.standins`) is bound. The
own oracles: the selective scan written from the paper's equations
(tests/reference/recurrences.py). Last, the kernels' argument tables and the
spec's block as written on the tiny ``mamba`` checkpoint.
"""

from __future__ import annotations

import pytest
import torch

import nnterp
from nnterp import KernelFailure, NnterpError, NotInTrace, OrderError, ReadOnlyValue, Unavailable
from nnterp.components.selective_scan import SelectiveScan
from nnterp.recurrent.arguments import CHANNELS_FIRST, ONE_TOKEN
from tests.blocks import check_printed, run_block
from tests.reference import hf_oracles as hf
from tests.reference.recurrences import selective_scan
from tests.suites.caches import Cache
from tests.suites.checkpoint import PROMPT, CheckpointFixtures
from tests.suites.contract import PaddedBatch, StateContract
from tests.suites.standins import compiled_kernels, mixer_kernels
from tests.suites.steps import assert_generate_steps_read_their_own_call

TOL = dict(rtol=1e-4, atol=1e-5)


class MambaCases(CheckpointFixtures):
    """What the Mamba-1 and Mamba-2 suites share, with the helpers they use."""

    def random_like(self, like: torch.Tensor, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
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

    # -- the convolution window, on decode steps -------------------------------

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

    def test_with_compiled_kernels_only_values_inside_say_why_and_a_refused_device_names_the_fix(self, model):
        mixer = model.family.MIXER
        with compiled_kernels(model.family.MODELING, mixer_kernels(mixer)):
            support = model.support()
            reason = support["linear_attn.states"][0]
            assert "optimized kernel (mamba_ssm)" in reason and "route_kernels" in reason and "fast_states" in reason
            for name in mixer.values():
                inside = name in ("state", "states")  # the token loop's binding, the chunk scan's boundaries
                assert (support[f"linear_attn.{name}"] is not None) == inside, name
            assert support["layer.layer_output"] is None and support["linear_attn.attention_output"] is None
            # The stand-in refuses CPU tensors: the trace fails at the kernel, with its error, naming the fix.
            with pytest.raises(KernelFailure, match=r"(?s)is_cuda.*route_kernels\(model.family, 'torch'\)") as raised:
                with model.trace(PROMPT):
                    model.layers[0].layer_output.save()
            assert isinstance(raised.value, RuntimeError) and isinstance(raised.value.__cause__, RuntimeError)
            with nnterp.route_kernels(model.family, "torch"):
                assert "optimized kernel" not in str(model.support()["linear_attn.states"])  # Mamba-2: chunk_per_token's
                with torch.no_grad(), model.trace(PROMPT):
                    routed = model.logits.save()
        with torch.no_grad(), model.trace(PROMPT):
            plain_logits = model.logits.save()
        torch.testing.assert_close(routed, plain_logits, rtol=0, atol=1e-6)

    def test_inside_a_kernel_a_read_raises_unavailable_with_the_reason(self, model, mixers):
        with compiled_kernels(model.family.MODELING, mixer_kernels(model.family.MIXER)):
            reason = model.support()["linear_attn.states"][0]
            with pytest.raises(Unavailable) as raised:  # said before anything runs, inside a trace or not
                model.layers[mixers[0]].linear_attn.states
            assert raised.value.reason == reason


class SelectiveScanSuite(StateContract, PaddedBatch, MambaCases):
    """A Mamba-1-like mixer (`SelectiveScan`): set ``MODEL_TYPE``."""

    LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
    PROB_TOL = TOL

    def test_labels_are_resolved_from_the_kernels_source(self, model):
        cls = type(model.layers[0].linear_attn)
        assert (cls.STATE_OP, cls.STEP_STATE_OP) == ("ssm_state_3", "ssm_state_0")
        assert cls.CHUNK_KERNEL == "mamba_selective_scan_0" and cls.RECURRENT_KERNEL == "mamba_selective_state_update_0"

    # -- the state after every token ---------------------------------------------

    def test_routed_states_are_the_same(self, model, ids):
        mix = model.layers[1].linear_attn
        with torch.no_grad(), model.trace(ids):
            unrouted = mix.states.save()
        with nnterp.route_kernels(model.family, "torch"):
            assert model.support()["linear_attn.states"] is None
            with torch.no_grad(), model.trace(ids):
                routed = mix.states.save()
        assert torch.equal(routed, unrouted)

    def test_state_iterates_over_tokens_with_tracer_iter(self, model, ids):
        mix = model.layers[0].linear_attn
        collected = []
        with torch.no_grad(), model.trace(ids) as tracer:
            for t in tracer.iter[: ids.shape[1]]:
                collected.append(mix.state.save())
        with torch.no_grad(), model.trace(ids):
            states = mix.states.save()
        assert torch.equal(torch.stack(collected, 1), states)

    def test_arguments_reproduce_states_and_output_through_the_paper_recurrence(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            x, dt = mix.attention_values.save(), mix.dt.save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            A, D, z, bias = (mix.argument(name).save() for name in ("A", "D", "z", "dt_bias"))
            betas, decays = mix.betas.save(), mix.decays.save()
            states = mix.states.save()
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        outputs, expected = selective_scan(x, dt, A, B, C, D, z, dt_bias=bias)
        torch.testing.assert_close(states, expected, **TOL, msg="states")
        torch.testing.assert_close(y.transpose(1, 2), outputs, **TOL, msg="kernel output")
        _, from_betas = selective_scan(x, betas, A, B, C, D, z, dt_softplus=False)
        torch.testing.assert_close(from_betas, expected, **TOL, msg="betas are the step sizes")
        assert torch.equal(decays, betas[..., None] * A) and (decays <= 0).all() and (betas > 0).all()

    def test_betas_written_reach_the_kernel(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            x, A = mix.attention_values.save(), mix.argument("A").save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            doubled = (2 * mix.betas).save()
            mix.betas = doubled
            states = mix.states.save()
        _, expected = selective_scan(x, doubled, A, B, C, dt_softplus=False)
        torch.testing.assert_close(states, expected, **TOL)

    def test_several_tokens_over_a_cache_run_the_prompt_kernel_from_zeros(self, model, ids):
        mix = model.layers[0].linear_attn
        cls = type(mix)
        with torch.no_grad(), model.trace(ids[:, :4]):
            out = model.output.save()
        cache = hf.output_cache(out)
        entering, chosen = [], []
        with torch.no_grad(), model.trace(ids[:, 4:], **{hf.cache_kwarg(model._module): cache}):
            chosen.append(cls.KERNEL(mix))
            entering.append(mix.state_input)
            states = mix.states.save()
        assert chosen == [cls.CHUNK_KERNEL] and entering == [None], "transformers' Mamba-1 restarts from zeros there"
        assert states.shape[1] == ids.shape[1] - 4

    def _continuation(self, model, ids, k: int) -> dict:
        """The trace inputs of ``ids[:, k:]`` over the cache a trace of ``ids[:, :k]`` left (the attention mask
        over every token on a hybrid, whose attention layers read the cached keys)."""
        with torch.no_grad(), model.trace(ids[:, :k]):
            out = model.output.save()
        inputs = {"input_ids": ids[:, k:]}
        if any(layer.linear_attn is None for layer in model.layers):
            inputs["attention_mask"] = torch.ones_like(ids)
        return {"inputs": inputs, hf.cache_kwarg(model._module): hf.output_cache(out)}

    def test_under_fast_states_a_prompt_starts_from_the_assigned_state_input(self, model, plain, ids, mixers):
        """Every mixer continues the prefix from the state it left, one from a random state instead. Oracle:
        transformers' own decode steps from a cache whose state after the prefix is replaced by hand."""
        layer, k = mixers[1], 3
        left = {}
        with torch.no_grad(), model.trace(ids[:, :k]):
            for i in mixers:
                left[i] = model.layers[i].linear_attn.state_output.save()
        left[layer] = self.random_like(left[layer])
        continuation = self._continuation(model, ids, k)
        with nnterp.fast_states(model), torch.no_grad(), model.trace(continuation.pop("inputs"), **continuation):
            for i in mixers:  # in the order the model runs
                model.layers[i].linear_attn.state_input = left[i]
                if i == layer:
                    entering = model.layers[i].linear_attn.state_input.save()
                    states = model.layers[i].linear_attn.states.save()
            logits = model.logits.save()
        expected_logits, expected_states = Cache().continue_from(plain, ids, k - 1, layer, left[layer])
        assert torch.equal(entering, left[layer])
        torch.testing.assert_close(states, expected_states, **TOL)
        torch.testing.assert_close(logits, expected_logits, **TOL)

    def test_a_prompts_state_input_is_written_under_fast_states_only_and_first(self, model, ids, mixers):
        mix = model.layers[mixers[0]].linear_attn
        with torch.no_grad(), model.trace(ids):
            value = torch.zeros_like(mix.state_output).save()
        with pytest.raises(Unavailable, match=r"takes no initial state.*fast_states\(model\)"):
            with torch.no_grad(), model.trace(ids):
                mix.state_input = value
        with nnterp.fast_states(model), pytest.raises(OrderError):
            with torch.no_grad(), model.trace(ids):
                mix.state_after(2).save()
                mix.state_input = value

    def test_generate_steps_each_read_their_own_call(self, model):
        assert_generate_steps_read_their_own_call(model, model.layers[0].linear_attn)

    def test_a_decode_step_serves_one_token_and_a_write_reaches_its_update(self, model):
        mix = model.layers[1].linear_attn
        read = {}
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                read["entering"] = mix.state_input.save()
                read["x"], read["B"], read["C"] = mix.attention_values.save(), mix.attention_keys.save(), mix.attention_queries.save()
                read["A"] = mix.argument("A").save()
                read["betas"] = (mix.betas * 2).save()
                mix.betas = read["betas"]
                read["out"] = mix.state_output.save()
        x, B, C, A, betas = (read[k] for k in ("x", "B", "C", "A", "betas"))
        assert x.shape[1] == B.shape[1] == betas.shape[1] == 1, "a sequence axis of one"
        _, expected = selective_scan(x, betas, A, B, C, dt_softplus=False, initial_state=read["entering"])
        torch.testing.assert_close(read["out"], expected[:, -1], **TOL)

    # -- bad input ---------------------------------------------------------------

    def test_bad_input_raises_nnterp_errors(self, model, plain, ids):
        mix = model.layers[0].linear_attn
        good = self.cached_state(plain, ids, 0)
        n = ids.shape[1]
        cases = {
            "dtype": (lambda: mix.set_state_after(1, good.double()), NnterpError, "dtype"),
            "shape": (lambda: mix.set_state_after(1, good[:, :3]), NnterpError, "shape"),
            "range": (lambda: mix.state_after(n), NnterpError, "outside"),
            "not an int": (lambda: mix.state_after(1.0), NnterpError, "int"),
            "later read first": (lambda: (mix.state_after(3), mix.set_state_after(1, good)), OrderError, "increasing order"),
            "argument after the kernel": (lambda: (mix.states, setattr(mix, "dt", mix.dt)), OrderError, "kernel had started"),
            "argument shape": (lambda: setattr(mix, "attention_values", mix.attention_values[:, :1]), NnterpError, "shape"),
            "prompt state_input": (lambda: setattr(mix, "state_input", good), NnterpError, "zeros"),
            "read-only": (lambda: setattr(mix, "states", None), ReadOnlyValue, "set_state_after"),
            "unknown argument": (lambda: mix.argument("nope"), NnterpError, "one of"),
        }
        for name, (action, error, words) in cases.items():
            with pytest.raises(error, match=words):
                with torch.no_grad(), model.trace(ids):
                    action()
        with pytest.raises(NotInTrace):
            mix.states


def test_the_two_kernels_hold_each_argument_in_their_own_place_and_layout():
    chunk, step = SelectiveScan.CHUNK_ARGUMENTS, SelectiveScan.RECURRENT_ARGUMENTS
    assert chunk["x"] == (0, CHANNELS_FIRST) and step["x"] == (1, ONE_TOKEN)
    assert chunk["dt_bias"][0] == "delta_bias" and step["dt_bias"][0] == "dt_bias"
    assert "state" not in chunk, "Mamba-1's prompt kernel takes no initial state"
    x = torch.arange(24.0).reshape(2, 3, 4)  # [batch, channels, seq]
    view = CHANNELS_FIRST.read(x)
    assert view.shape == (2, 4, 3) and torch.equal(CHANNELS_FIRST.write(view, x), x)


SPEC_BLOCK = '''
mamba = StandardizedTransformer("state-spaces/mamba-130m-hf", dispatch=True, device="cpu")
scan = mamba.layers[0].linear_attn
print(type(scan).__name__, type(scan).STATE_OP, type(scan).STEP_STATE_OP)   # SelectiveScan ssm_state_3 ssm_state_0
print(mamba.support()["linear_attn.states"][0])
# read inside transformers' pure-torch mamba_selective_scan, but this process dispatches it to an optimized kernel (mamba_ssm) whose interior nnsight cannot read; call nnterp.route_kernels(model.family, 'torch') to read these (slower, like eager attention); or nnterp.fast_states(model), which computes the per-token states from the kernel call's own arguments with the optimized kernel kept (not `state` under tracer.iter: read state_after(t))
route_kernels(mamba.family, "torch")
with mamba.trace(prompt):
    states = scan.states.save()
    out = mamba.layers[0].layer_output.save()
print(mamba.support()["linear_attn.states"], tuple(states.shape), tuple(out.shape))   # None (1, 3, 1536, 16) (1, 3, 768)
route_kernels(mamba.family, "default")
'''


def test_the_spec_block_runs_as_written(checkpoint, tmp_path):
    """The design page's Mamba-1 block, on the tiny checkpoint, with mamba_ssm stood in (the block assumes it)."""
    import transformers.models.mamba.modeling_mamba as modeling

    import nnterp
    from nnterp import StandardizedTransformer, route_kernels

    code = SPEC_BLOCK.replace("state-spaces/mamba-130m-hf", str(checkpoint("mamba")))
    scope = dict(torch=torch, nnterp=nnterp, StandardizedTransformer=StandardizedTransformer, route_kernels=route_kernels, prompt="Hello world there")
    with compiled_kernels(modeling, mixer_kernels(SelectiveScan)):
        try:
            records = run_block(code, tmp_path, "spec_mamba1", scope)
        finally:
            route_kernels(modeling, "default")
    assert check_printed(records) == 1
    texts = [text for _, text in records]
    assert texts[0] == "SelectiveScan ssm_state_3 ssm_state_0"
    config = scope["mamba"]._module.config
    assert texts[1] == f"None (1, 3, {config.intermediate_size}, {config.state_size}) (1, 3, {config.hidden_size})"
    with compiled_kernels(modeling, mixer_kernels(SelectiveScan)):
        assert scope["mamba"].support()["linear_attn.attention_queries"] is None
        assert scope["mamba"].support()["linear_attn.states"][0] == (
            "read inside transformers' pure-torch mamba_selective_scan, but this process dispatches it to an optimized "
            "kernel (mamba_ssm) whose interior nnsight cannot read; call nnterp.route_kernels(model.family, 'torch') to "
            "read these (slower, like eager attention); or nnterp.fast_states(model), which computes the per-token "
            "states from the kernel call's own arguments with the optimized kernel kept (not `state` under "
            "tracer.iter: read state_after(t))"
        )
