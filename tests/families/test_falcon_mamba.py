"""Falcon-Mamba: the Mamba-1 oracle suite (tests/components/test_selective_scan.py), and the norms on Δ, B and C the family adds."""

import torch
import transformers.models.falcon_mamba.modeling_falcon_mamba as modeling

from nnterp.components.selective_scan import SelectiveScan
from tests.components.test_selective_scan import PROMPT, TOL, SelectiveScanSuite
from tests.reference.recurrences import selective_scan


class TestFalconMamba(SelectiveScanSuite):
    MODEL_TYPE = "falcon_mamba"

    def test_the_falcon_mixer_is_served_by_selective_scan(self, model):
        for layer in model.layers:
            assert isinstance(layer.linear_attn, SelectiveScan) and type(layer.linear_attn) is SelectiveScan
            assert isinstance(layer.linear_attn._module, modeling.FalconMambaMixer)
            assert layer.self_attn is None and layer.mlp is None

    def test_keys_queries_and_dt_are_the_kernels_after_the_norms(self, model):
        """B, C are the norms' outputs (unit RMS per token), dt is dt_proj.weight on the normalized time step."""
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):  # the HF submodules, in execution order
            raw = mix.x_proj.output.save()
            normed_dt = mix.dt_layernorm.output.save()
            normed_B = mix.b_layernorm.output.save()
            normed_C = mix.c_layernorm.output.save()
        with torch.no_grad(), model.trace(PROMPT):  # the kernel's arguments, as nnterp serves them
            B, C, dt = mix.attention_keys.save(), mix.attention_queries.save(), mix.dt.save()
        assert torch.equal(B, normed_B) and torch.equal(C, normed_C)
        weight = mix._module.dt_proj.weight
        torch.testing.assert_close(dt, normed_dt @ weight.T, **TOL)
        for vector in (B, C):
            rms = vector.pow(2).mean(-1)
            torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-3)  # ms / (ms + eps)
        rank, n = mix._module.time_step_rank, mix._module.ssm_state_size
        raw_B = raw[..., rank : rank + n]
        assert not torch.allclose(raw_B.pow(2).mean(-1), torch.ones_like(raw_B[..., 0]), atol=1e-2), "x_proj's B is not normalized"

    def test_a_written_key_reaches_the_kernel_without_renormalization(self, model):
        mix = model.layers[0].linear_attn
        with torch.no_grad(), model.trace(PROMPT):
            x, betas, A = mix.attention_values.save(), mix.betas.save(), mix.argument("A").save()
            C = mix.attention_queries.save()
            doubled = (2 * mix.attention_keys).save()
            mix.attention_keys = doubled
            states = mix.states.save()
        _, expected = selective_scan(x, betas, A, doubled, C, dt_softplus=False)
        torch.testing.assert_close(states, expected, **TOL)
