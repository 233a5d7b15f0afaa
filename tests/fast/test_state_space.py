"""`nnterp.fast.state_space` (Mamba-2's SSD): the states, output and effective attention, and its specs.

The oracles: ``tests/reference/recurrences.ssd`` (one plain loop per token,
from the equations) and transformers' ``mamba2_chunk_scan`` (its final states
and output), in float32 and in a half-precision model, where Δ is rounded as
the kernel rounds it.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.mamba2.modeling_mamba2 as mamba2_modeling

from nnterp.fast import ssd_attention, ssd_states
from nnterp.fast.scan import BF16_RTOL
from nnterp.fast.state_space import EFFECTIVE, FAST
from nnterp.recurrent.kernels import torch_function
from tests.fast.inputs import close, heads_sum, scan_inputs
from tests.reference import recurrences as ref
from tests.reference.recurrences import ssd

LENGTHS = [1, 3, 13, 64, 65, 200]


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_states_equal_the_token_loop(seq, groups, fill):
    gen = torch.Generator().manual_seed(seq)
    heads, head_dim, size = 4, 6, 5
    x = torch.randn(2, seq, heads, head_dim, generator=gen)
    dt = torch.randn(2, seq, heads, generator=gen)
    A = -3.0 * torch.rand(heads, generator=gen)
    B, C = (torch.randn(2, seq, groups, size, generator=gen) for _ in range(2))
    dt_bias, D = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    initial = torch.randn(2, heads, head_dim, size, generator=gen)
    limit = (0.01, 2.0)
    y_ref, expected = ssd(x, dt, A, B, C, D, dt_bias, True, limit, initial)
    y, states = ssd_states(x, dt, A, B, C, dt_bias, True, limit, initial, D=D, output=True)
    assert states.shape == (2, seq, heads, head_dim, size)
    close(states, expected, "states")
    close(y, y_ref, "outputs")
    # Two slots for states: the same output, the last state in slot (seq - 1) % 2.
    ring = torch.full((2, 2, heads, head_dim, size), float("nan"))
    y_ring, _ = ssd_states(x, dt, A, B, C, dt_bias, True, limit, initial, D=D, output=True, out=ring, ring=True)
    close(y_ring, y_ref, "outputs, two slots")
    close(ring[:, (seq - 1) % 2], expected[:, -1], "last state, two slots")
    with pytest.raises(ValueError, match="out must be a floating-point"):
        ssd_states(x, dt, A, B, C, dt_bias, True, limit, initial, D=D, output=True, out=ring)


def test_ssd_final_state_equals_transformers_chunk_scan(fill):
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 45, 4, 8, generator=gen), torch.randn(1, 45, 4, generator=gen)
    A, B, dt_bias = -torch.rand(4, generator=gen), torch.randn(1, 45, 2, 5, generator=gen), torch.randn(4, generator=gen)
    scan = torch_function(mamba2_modeling.mamba2_chunk_scan)
    _, final = scan(x, dt, A, B, B, chunk_size=16, dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
    close(ssd_states(x, dt, A, B, dt_bias=dt_bias)[:, -1], final, "final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ssd_states_in_a_half_precision_model_equal_transformers_chunk_scan(dtype):
    # A half-precision model hands the scan half-precision x, dt, B, dt_bias (A is float32: -exp(A_log.float())).
    gen = torch.Generator().manual_seed(1)
    x, dt = torch.randn(1, 45, 4, 8, generator=gen).to(dtype), torch.randn(1, 45, 4, generator=gen).to(dtype)
    A, B = -torch.rand(4, generator=gen), torch.randn(1, 45, 2, 5, generator=gen).to(dtype)
    dt_bias = torch.randn(4, generator=gen).to(dtype)
    scan = torch_function(mamba2_modeling.mamba2_chunk_scan)
    finals = []
    for t in (10, 29, 44):  # the scan's final state after token t
        _, final = scan(x[:, : t + 1], dt[:, : t + 1], A, B[:, : t + 1], B[:, : t + 1], chunk_size=16, dt_bias=dt_bias,
                        dt_softplus=True, return_final_states=True)
        finals.append(final)
    states = ssd_states(x, dt, A, B, dt_bias=dt_bias)
    assert states.dtype == torch.float32
    for t, final in zip((10, 29, 44), finals):
        close(states[:, t], final, f"state after token {t}")  # float32 rounding, in every dtype
    if dtype != torch.float32:  # Δ in float32 (mamba_ssm's choice) is another computation, further off than rounding
        other = ssd_states(x, dt, A, B, dt_bias=dt_bias, dt_dtype=torch.float32)
        assert (other[:, 44] - finals[-1]).abs().max() > 1e-4 * finals[-1].abs().max()


# -- effective attention ---------------------------------------------------------------------

EFFECTIVE_LENGTHS = [1, 3, 13, 64, 65, 150]


@pytest.mark.parametrize("seq", EFFECTIVE_LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_ssd_attention_reproduces_the_token_loop(seq, with_initial):
    a = scan_inputs(seq)["ssd"]
    initial = a["state"] if with_initial else None
    limit = (0.01, 2.0)
    expected, _ = ref.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, limit, initial)
    A, readout = ssd_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, limit, initial)
    assert A.shape == (2, 4, seq, seq)
    close(heads_sum(A, readout, a["x"]), expected, "output")


@pytest.mark.parametrize("seq", [3, 45, 150])
def test_ssd_attention_reproduces_transformers_chunk_scan(seq):
    a = scan_inputs(seq)["ssd"]
    scan = torch_function(mamba2_modeling.mamba2_chunk_scan)
    out, _ = scan(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk_size=16, D=a["D"], dt_bias=a["dt_bias"],
                  initial_states=a["state"], dt_softplus=True, return_final_states=True)
    A, readout = ssd_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, (0.0, float("inf")), a["state"])
    close(heads_sum(A, readout, a["x"]), out, "output")


def test_the_specs_compute_the_token_loops_states_and_output(fill):
    a = {**scan_inputs(45)["ssd"], "dt_softplus": True, "dt_limit": (0.01, 2.0), "final": True}
    outputs, expected = ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, (0.01, 2.0), a["state"])
    close(FAST.compute(a, None), expected, "states")
    assert FAST.state_shape(a) == (2, 4, 3, 5)
    (y, final), states = FAST.one_pass(a, torch.empty(expected.shape))
    close(y, outputs, "one pass output")
    close(final, expected[:, -1], "one pass final state")
    ring = torch.empty(2, 2, 4, 3, 5)  # two slots: the output without the states
    (y, final), _ = FAST.one_pass(a, ring)
    close(y, outputs, "one pass output, two slots")
    close(final, expected[:, -1], "one pass final state, two slots")
    A, readout = EFFECTIVE.compute(a, None, None, True)
    close(heads_sum(A, readout, a["x"]), outputs, "effective attention")


@pytest.mark.parametrize("seq", [1, 63, 64, 65, 200])
def test_states_stored_in_bfloat16_are_within_one_rounding(seq, fill):
    a = scan_inputs(seq)["ssd"]
    expected = ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, (0.0, float("inf")), a["state"])[1]
    out = torch.empty(expected.shape, dtype=torch.bfloat16)
    assert ssd_states(a["x"], a["dt"], a["A"], a["B"], None, a["dt_bias"], True, initial_states=a["state"], out=out) is out
    error, bound = (out.float() - expected).abs(), BF16_RTOL * expected.abs() + 1e-5 * expected.abs().max()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
