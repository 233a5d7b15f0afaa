"""StateSpace (Mamba-2, state space duality): its suite and its own cases.

`StateSpaceSuite` is the state contract (tests/suites/contract.py, against
transformers' cache; its per-token reads and writes under ``chunk_per_token``)
plus what Mamba-2 shares with Mamba-1 (`MambaCases`,
tests/components/test_selective_scan.py) and what every Mamba-2 family passes:
``chunk_per_token`` (per model, undone, the same logits), and the SSD
recurrence written token by token (tests/reference/recurrences.py) from the
values served. A family's test file subclasses it and names ``MODEL_TYPE``.
Last, the kernels' argument layouts and the spec's block as written on the
tiny ``mamba2`` checkpoint.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import NnterpError, OrderError, RoutingError, Unavailable
from nnterp.components.state_space import StateSpace
from nnterp.recurrent.arguments import ONE_TOKEN_PER_HEAD, PER_HEAD
from nnterp.testing import tiny_config, tiny_tokenizer
from tests.blocks import check_printed, run_block
from tests.components.test_selective_scan import TOL, MambaCases
from tests.reference.recurrences import ssd
from tests.suites.checkpoint import PROMPT
from tests.suites.contract import PaddedBatch, StateContract
from tests.suites.steps import assert_generate_steps_read_their_own_call


def built(model_type: str, **changes) -> nnterp.StandardizedTransformer:
    """The standardized model of the family's tiny config with ``changes`` set on it, seeded random weights."""
    config = tiny_config(model_type)
    for name, value in changes.items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    return nnterp.StandardizedTransformer(model, tokenizer=tiny_tokenizer())


class StateSpaceSuite(StateContract, PaddedBatch, MambaCases):
    """A Mamba-2-like mixer (`StateSpace`): set ``MODEL_TYPE``; per-token reads and writes under ``chunk_per_token``."""

    LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
    PROB_TOL = TOL

    def reading(self, model):
        return nnterp.chunk_per_token(model)

    @pytest.fixture
    def per_token(self, model):
        with nnterp.chunk_per_token(model):
            yield model

    def test_labels_are_resolved_from_the_kernels_source(self, model, mixers):
        cls = type(model.layers[mixers[0]].linear_attn)
        assert cls.STATE_OP is None and (cls.BOUNDARY_OP, cls.STEP_STATE_OP) == ("new_states_0", "ssm_states_0")

    # -- chunk_per_token ---------------------------------------------------------

    def test_states_are_unavailable_until_chunk_per_token_which_is_per_model_and_undone(self, model, checkpoint, mixers):
        size = model.layers[mixers[0]].linear_attn._module.chunk_size
        reason = model.support()["linear_attn.states"][0]
        assert f"every {size} tokens (chunk_size={size})" in reason and "chunk_per_token" in reason
        with pytest.raises(Unavailable, match="chunk_per_token"), model.trace(PROMPT):
            model.layers[mixers[0]].linear_attn.states
        other = nnterp.StandardizedTransformer(str(checkpoint(self.MODEL_TYPE)), dispatch=True)
        nnterp.chunk_per_token(model)
        try:
            assert model.support()["linear_attn.states"] is None
            assert other.support()["linear_attn.states"] is not None, "per model, not process-wide"
            mix = model.layers[mixers[0]].linear_attn
            with torch.no_grad(), model.trace(PROMPT):
                mix.states
                chunk = mix.argument("chunk_size").save()
            assert chunk == 1, "the call whose states were read scans one token per chunk"
        finally:
            nnterp.chunk_per_token(model, enabled=False)
        assert model.support()["linear_attn.states"] is not None
        # Held by nnterp: transformers' modules are never changed.
        assert all(
            layer.linear_attn._module.chunk_size == size for layer in [*model.layers, *other.layers] if layer.linear_attn is not None
        )

    def test_chunk_per_token_gives_the_default_logits(self, model, ids, mixers):
        with torch.no_grad(), model.trace(ids):
            chunked = model.logits.save()
        with nnterp.chunk_per_token(model), torch.no_grad(), model.trace(ids):
            for index in mixers:
                model.layers[index].linear_attn.states  # every call scans one token per chunk
            per_token = model.logits.save()
        assert ids.shape[1] > model.layers[mixers[0]].linear_attn._module.chunk_size, "the prompt spans several chunks"
        torch.testing.assert_close(per_token, chunked, rtol=0, atol=1e-5)

    def test_chunk_per_token_refuses_a_model_without_the_mixer_and_a_running_trace(self, model, load):
        with pytest.raises(NnterpError, match="no Mamba-2"):
            nnterp.chunk_per_token(load("mamba"))
        with pytest.raises(RoutingError, match="before"), model.trace(PROMPT):
            nnterp.chunk_per_token(model)

    # -- the state after every token ---------------------------------------------

    def test_state_iterates_over_tokens_with_tracer_iter(self, per_token, ids, mixers):
        mix = per_token.layers[mixers[0]].linear_attn
        collected, after_loop = [], []
        with torch.no_grad(), per_token.trace(ids) as tracer:
            for t in tracer.iter[: ids.shape[1]]:
                collected.append(mix.state.save())
            states = mix.states.save()
        assert torch.equal(torch.stack(collected, 1), states)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad(), per_token.trace(ids) as tracer:
            warnings.simplefilter("always")
            for t in tracer.iter[:]:
                after_loop.append(mix.state.save())
        assert len(after_loop) == ids.shape[1], "an open loop ends after the last token"
        assert any("never reached" in str(w.message) for w in caught)

    def test_arguments_reproduce_states_and_output_through_the_ssd_recurrence(self, per_token, mixers):
        mix = per_token.layers[mixers[0]].linear_attn
        with torch.no_grad(), per_token.trace(PROMPT):
            x, dt = mix.attention_values.save(), mix.dt.save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            A, D, bias, limit = (mix.argument(name).save() for name in ("A", "D", "dt_bias", "dt_limit"))
            betas, decays = mix.betas.save(), mix.decays.save()
            states = mix.states.save()
            y = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        outputs, expected = ssd(x, dt, A, B, C, D, dt_bias=bias, dt_limit=limit)
        torch.testing.assert_close(states, expected, **TOL, msg="states")
        torch.testing.assert_close(y, outputs, **TOL, msg="kernel output")
        _, from_betas = ssd(x, betas, A, B, C, dt_softplus=False)
        torch.testing.assert_close(from_betas, expected, **TOL, msg="betas are the step sizes")
        assert torch.equal(decays, betas * A) and (decays <= 0).all() and (betas > 0).all()

    @pytest.mark.parametrize("name", ["betas", "decays"])
    def test_betas_and_decays_written_reach_the_kernel(self, per_token, name, mixers):
        mix = per_token.layers[mixers[0]].linear_attn
        with torch.no_grad(), per_token.trace(PROMPT):
            x, A = mix.attention_values.save(), mix.argument("A").save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            doubled = (2 * getattr(mix, name)).save()
            setattr(mix, name, doubled)
            states = mix.states.save()
        step = doubled if name == "betas" else doubled / A
        _, expected = ssd(x, step, A, B, C, dt_softplus=False)
        torch.testing.assert_close(states, expected, **TOL)

    def test_state_input_assigned_on_a_prompt_is_where_it_starts(self, per_token, plain, ids, mixers):
        mix = per_token.layers[mixers[1]].linear_attn
        donor = self.random_like(self.cached_state(plain, ids, mixers[1]))
        with torch.no_grad(), per_token.trace(PROMPT):
            x, dt = mix.attention_values.save(), mix.dt.save()
            B, C = mix.attention_keys.save(), mix.attention_queries.save()
            A, bias, limit = (mix.argument(name).save() for name in ("A", "dt_bias", "dt_limit"))
            mix.state_input = donor
            states = mix.states.save()
        _, expected = ssd(x, dt, A, B, C, dt_bias=bias, dt_limit=limit, initial_state=donor)
        torch.testing.assert_close(states, expected, **TOL)

    def test_generate_steps_each_read_their_own_call(self, per_token, mixers):
        assert_generate_steps_read_their_own_call(per_token, per_token.layers[mixers[0]].linear_attn)

    def test_a_decode_step_serves_one_token_per_head_and_a_write_reaches_its_update(self, model, mixers):
        mix = model.layers[mixers[1]].linear_attn
        read = {}
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                read["entering"] = mix.state_input.save()
                read["x"], read["B"], read["C"] = mix.attention_values.save(), mix.attention_keys.save(), mix.attention_queries.save()
                read["A"], read["D"] = mix.argument("A").save(), mix.argument("D").save()
                read["decays"] = (mix.decays * 2).save()
                mix.decays = read["decays"]
                read["out"] = mix.state_output.save()
        x, B, C, A, decays = (read[k] for k in ("x", "B", "C", "A", "decays"))
        heads = x.shape[2]
        assert x.shape[1] == B.shape[1] == decays.shape[1] == 1 and A.shape == (heads,) and read["D"].shape == (heads,)
        _, expected = ssd(x, decays / A, A, B, C, dt_softplus=False, initial_state=read["entering"])
        torch.testing.assert_close(read["out"], expected[:, -1], **TOL)

    # -- writing the state inside a prompt ---------------------------------------

    def test_set_state_after_the_last_token_is_the_final_state(self, per_token, ids, mixers):
        mix = per_token.layers[mixers[0]].linear_attn
        with torch.no_grad(), per_token.trace(ids):
            donor = torch.ones_like(mix.state_after(-1))
            mix.set_state_after(-1, donor)
            final = mix.state_output.save()
        assert torch.equal(final, torch.ones_like(final))

    # -- bad input ---------------------------------------------------------------

    def test_bad_input_raises_nnterp_errors(self, per_token, plain, ids, mixers):
        mix = per_token.layers[mixers[0]].linear_attn
        good = self.cached_state(plain, ids, mixers[0])
        n = ids.shape[1]
        cases = {
            "dtype": (lambda: mix.set_state_after(1, good.double()), NnterpError, "dtype"),
            "shape": (lambda: mix.set_state_after(1, good[:, :1]), NnterpError, "shape"),
            "range": (lambda: mix.state_after(n), NnterpError, "outside"),
            "later read first": (lambda: (mix.state_after(3), mix.set_state_after(1, good)), OrderError, "later token"),
            "after the kernel": (lambda: (mix.state_output, mix.set_state_after(1, good)), OrderError, "per-token state was asked for after"),
            "argument after the kernel": (lambda: (mix.states, setattr(mix, "dt", mix.dt)), OrderError, "kernel had started"),
            "betas shape": (lambda: setattr(mix, "betas", mix.betas[:, :1]), NnterpError, "shape"),
            "state_input dtype": (lambda: setattr(mix, "state_input", good.double()), NnterpError, "dtype"),
        }
        for name, (action, error, words) in cases.items():
            with pytest.raises(error, match=words):
                with torch.no_grad(), per_token.trace(ids):
                    action()


def test_decode_values_are_served_per_head_and_laid_back_expanded():
    assert StateSpace.RECURRENT_ARGUMENTS["dt"] == (2, ONE_TOKEN_PER_HEAD)
    assert StateSpace.CHUNK_ARGUMENTS["state"][0] == "initial_states"
    dt = torch.arange(3.0)[None, :, None].expand(2, 3, 4)  # [batch, heads, head_dim], expanded per head
    view = ONE_TOKEN_PER_HEAD.read(dt)
    assert view.shape == (2, 1, 3) and torch.equal(ONE_TOKEN_PER_HEAD.write(view, dt), dt)
    A = torch.arange(3.0)[:, None, None].expand(3, 4, 5)  # [heads, head_dim, state_size]
    assert torch.equal(PER_HEAD.read(A), torch.arange(3.0)) and torch.equal(PER_HEAD.write(PER_HEAD.read(A), A), A)


SPEC_BLOCK = '''
mamba2 = StandardizedTransformer("AntonV/mamba2-130m-hf", dispatch=True, device="cpu")
ssd = mamba2.layers[0].linear_attn
route_kernels(mamba2.family, "torch")
print(mamba2.support()["linear_attn.states"][0])
# the chunk scan materializes the state only at chunk boundaries, every 256 tokens (chunk_size=256); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, so every token is a boundary (slower on long prompts)
nnterp.chunk_per_token(mamba2)
with mamba2.trace(prompt):
    states = ssd.states.save()
    out = ssd.state_output.save()
print(mamba2.support()["linear_attn.states"], tuple(states.shape), torch.equal(states[:, -1], out))   # None (1, 3, 24, 128, 64) True
nnterp.chunk_per_token(mamba2, enabled=False)
route_kernels(mamba2.family, "default")
'''


def test_the_spec_block_runs_as_written(checkpoint, tmp_path):
    import transformers.models.mamba2.modeling_mamba2 as modeling

    import nnterp
    from nnterp import StandardizedTransformer, route_kernels

    code = SPEC_BLOCK.replace("AntonV/mamba2-130m-hf", str(checkpoint("mamba2")))
    scope = dict(torch=torch, nnterp=nnterp, StandardizedTransformer=StandardizedTransformer, route_kernels=route_kernels, prompt="Hello world there")
    try:
        records = run_block(code, tmp_path, "spec_mamba2", scope)
    finally:
        route_kernels(modeling, "default")
    assert check_printed(records) == 1
    config = scope["mamba2"]._module.config
    assert records[0][1] == f"None (1, 3, {config.num_heads}, {config.head_dim}, {config.state_size}) True"
    module = scope["ssd"]._module
    assert module.chunk_size == config.chunk_size, "enabled=False restored the chunk size"
    assert scope["mamba2"].support()["linear_attn.states"][0] == (
        f"the chunk scan materializes the state only at chunk boundaries, every {config.chunk_size} tokens "
        f"(chunk_size={config.chunk_size}); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, "
        "so every token is a boundary (slower on long prompts)"
    )
