"""`nnterp.fast.selective_scan` (Mamba-1's fast path) against the reference token loop and transformers' kernel.

The oracles: ``tests/reference/recurrences.selective_scan`` (one plain loop
per token, from the equations, with an initial state) and transformers'
``mamba_selective_scan`` (its pure-torch loop: its final state and output).
Lengths that do not fill a chunk, an initial state, decays that underflow,
and `selective_scan_readout`: a run from zeros plus what a start state adds
equals a run from that state (how a write splits a kernel that takes none);
the effective attention reproduces both oracles' outputs, and the specs
compute the same from a served call's arguments.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.mamba.modeling_mamba as mamba_modeling

from nnterp.fast import (
    SCAN,
    selective_scan_attention,
    selective_scan_output,
    selective_scan_readout,
    selective_scan_states,
)
from nnterp.fast.scan import BF16_RTOL
from nnterp.fast.selective_scan import EFFECTIVE, FAST
from nnterp.recurrent.kernels import torch_function
from tests.fast.inputs import channels_sum, close, scan_inputs
from tests.reference import recurrences as ref
from tests.reference.recurrences import selective_scan

LENGTHS = [1, 2, 3, 13, 64, 65, 200]


def inputs(seq, *, batch=2, channels=6, size=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed + seq)
    x, dt, z = (torch.randn(batch, seq, channels, generator=gen) for _ in range(3))
    A = -3.0 * torch.rand(channels, size, generator=gen)
    B, C = (torch.randn(batch, seq, size, generator=gen) for _ in range(2))
    bias, D = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    initial = torch.randn(batch, channels, size, generator=gen)
    x, dt, z, B, C = (t.to(dtype) for t in (x, dt, z, B, C))
    return x, dt, A, B, C, D, z, bias, initial


def kernel(x, dt, A, B, C, D, z, bias):
    """transformers' prompt kernel, tokens-first in and out: ``(y [b, seq, d], final [b, d, n])``."""
    scan = torch_function(mamba_modeling.mamba_selective_scan)
    y, final = scan(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D=D,
                    z=z.transpose(1, 2), delta_bias=bias, delta_softplus=True, return_last_state=True)
    return y.transpose(1, 2), final


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_states_equal_the_token_loop(seq, with_initial, fill):
    x, dt, A, B, C, D, z, bias, initial = inputs(seq)
    initial = initial if with_initial else None
    _, expected = selective_scan(x, dt, A, B, C, D, z, bias, True, initial)
    states = selective_scan_states(x, dt, A, B, bias, True, initial)
    assert states.shape == (2, seq, 6, 4) and states.dtype == torch.float32
    close(states, expected, "states")


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64, 300])
def test_chunk_sizes_under_autograd_agree_with_the_token_steps(chunk_size):
    # Chunks are the autograd path; without autograd the states are written token by token.
    x, dt, A, B, C, D, z, bias, initial = inputs(70)
    reference = selective_scan_states(x, dt, A, B, bias, True, initial)
    with torch.enable_grad():
        chunked = selective_scan_states(x.requires_grad_(True), dt, A, B, bias, True, initial, chunk_size=chunk_size)
    assert chunked.requires_grad
    close(chunked.detach(), reference, f"chunk_size={chunk_size}")


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_gate", [False, True])
def test_one_pass_output_equals_transformers_kernel(seq, with_gate, fill):
    x, dt, A, B, C, D, z, bias, _ = inputs(seq)
    z = z if with_gate else None
    y, states = selective_scan_output(x, dt, A, B, C, D, z, bias, True)
    scan = torch_function(mamba_modeling.mamba_selective_scan)
    expected, final = scan(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D=D,
                           z=None if z is None else z.transpose(1, 2), delta_bias=bias, delta_softplus=True, return_last_state=True)
    close(y, expected.transpose(1, 2), "output")
    close(states[:, -1], final, "final state")
    ring = torch.full((2, 2, 6, 4), float("nan"))
    y_ring, _ = selective_scan_output(x, dt, A, B, C, D, z, bias, True, out=ring, ring=True)
    close(y_ring, expected.transpose(1, 2), "output, two slots")
    close(ring[:, (seq - 1) % 2], final, "final state, two slots")
    _, loop = selective_scan(x, dt, A, B, C, D, z if z is not None else torch.full_like(x, 30.0), bias, True, None)
    close(states, loop, "states")


def test_one_pass_output_refuses_autograd():
    x, dt, A, B, C, D, z, bias, _ = inputs(5)
    with pytest.raises(ValueError, match="without autograd"):
        selective_scan_output(x.requires_grad_(True), dt, A, B, C, D, z, bias, True)


@pytest.mark.parametrize("seq", [3, 65, 200])
def test_final_state_equals_transformers_kernel_after_each_prefix(seq, fill):
    x, dt, A, B, C, D, z, bias, _ = inputs(seq)
    states = selective_scan_states(x, dt, A, B, bias, True)
    for t in sorted({0, seq // 2, seq - 1}):
        _, prefix = kernel(x[:, : t + 1], dt[:, : t + 1], A, B[:, : t + 1], C[:, : t + 1], D, z[:, : t + 1], bias)
        close(states[:, t], prefix, f"state after token {t}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_a_half_precision_model_the_step_is_rounded_as_the_kernel_rounds_it(dtype):
    x, dt, A, B, C, D, z, bias, _ = inputs(40, dtype=dtype)
    bias = bias.float()  # the mixer passes dt_proj.bias.float(); dt stays in the model's dtype
    _, final = kernel(x, dt, A, B, C, D, z, bias)
    close(selective_scan_states(x, dt, A, B, bias, True)[:, -1], final, "final state")


def test_strong_decays_underflow_to_zero_without_nans(fill):
    x, dt, A, B, C, D, z, bias, initial = inputs(130)
    A = A * 1e4
    _, expected = selective_scan(x, dt, A, B, C, D, z, bias, True, initial)
    states = selective_scan_states(x, dt, A, B, bias, True, initial)
    assert torch.isfinite(states).all()
    close(states, expected, "states")


@pytest.mark.parametrize("seq", [1, 5, 65, 150])
def test_a_run_from_zeros_plus_the_readout_is_a_run_from_the_start_state(seq):
    x, dt, A, B, C, D, z, bias, initial = inputs(seq)
    y, final = kernel(x, dt, A, B, C, D, z, bias)
    readout, decayed = selective_scan_readout(dt, A, C, initial, z, bias, True)
    expected_y, expected_states = selective_scan(x, dt, A, B, C, D, z, bias, True, initial)
    close(y + readout, expected_y, "output")
    close(final + decayed, expected_states[:, -1], "final state")
    # The spec's resume does the same on the kernel's own (channel-first) return.
    served = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": bias, "dt_softplus": True}
    scan = torch_function(mamba_modeling.mamba_selective_scan)
    raw = scan(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D=D, z=z.transpose(1, 2),
               delta_bias=bias, delta_softplus=True, return_last_state=True)
    resumed = SCAN.resume(served, initial, raw)
    close(resumed[0].transpose(1, 2), expected_y, "resumed output")
    close(resumed[1], expected_states[:, -1], "resumed final state")
    alone = SCAN.resume(served, initial, raw[0])
    assert torch.equal(alone, resumed[0]), "a kernel returning its output only is resumed alike"


def test_under_autograd_the_same_states_and_a_gradient_to_the_arguments():
    x, dt, A, B, C, D, z, bias, initial = inputs(50)
    plain = selective_scan_states(x, dt, A, B, bias, True, initial)
    x = x.clone().requires_grad_(True)
    states = selective_scan_states(x, dt, A, B, bias, True, initial, out=torch.empty(plain.shape))
    close(states.detach(), plain, "states under autograd")
    (grad,) = torch.autograd.grad(states[:, -1].sum(), x)
    x_loop = x.detach().clone().requires_grad_(True)
    _, loop = selective_scan(x_loop, dt, A, B, C, D, z, bias, True, initial)
    (expected,) = torch.autograd.grad(loop[:, -1].sum(), x_loop)
    close(grad, expected, "gradient of the final state by x")


def test_out_buffer_is_written_in_place_and_checked():
    x, dt, A, B, C, D, z, bias, initial = inputs(20)
    out = torch.full((2, 20, 6, 4), float("nan"))
    assert selective_scan_states(x, dt, A, B, bias, True, initial, out=out) is out
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="out must be a floating-point"):
        selective_scan_states(x, dt, A, B, bias, True, initial, out=torch.empty(2, 20, 6, 5))


# -- effective attention ---------------------------------------------------------------------

EFFECTIVE_LENGTHS = [1, 3, 13, 64, 65, 150]


@pytest.mark.parametrize("seq", EFFECTIVE_LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_selective_scan_attention_reproduces_the_token_loop(seq, with_initial):
    a = scan_inputs(seq)["mamba"]
    initial = a["state"] if with_initial else None
    expected, _ = ref.selective_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, initial)
    A, readout = selective_scan_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, initial)
    assert A.shape == (2, 7, seq, seq)
    got = torch.einsum("bcts,bsc->btc", A, a["x"])
    close(got + readout if readout is not None else got, expected, "output")


def test_selective_scan_attention_reproduces_transformers_scan():
    a = scan_inputs(90)["mamba"]
    scan = torch_function(mamba_modeling.mamba_selective_scan)
    first = lambda x: x.transpose(1, 2)  # noqa: E731  the kernel is channel-first
    out = scan(first(a["x"]), first(a["dt"]), a["A"], first(a["B"]), first(a["C"]), D=a["D"], z=first(a["z"]),
               delta_bias=a["dt_bias"], delta_softplus=True)
    A, _ = selective_scan_attention(a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True)
    close(torch.einsum("bcts,bsc->btc", A, a["x"]), first(out), "output")


def test_the_specs_compute_the_token_loops_states_and_output(fill):
    x, dt, A, B, C, D, z, bias, initial = inputs(40)
    a = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": bias, "dt_softplus": True, "state": initial, "final": True}
    outputs, expected = selective_scan(x, dt, A, B, C, D, z, bias, True, initial)
    close(FAST.compute(a, None), expected, "states")
    assert FAST.state_shape(a) == (2, 6, 4)
    (y, final), states = FAST.one_pass(a, torch.empty(expected.shape))
    close(y.transpose(1, 2), outputs, "one pass output, channel-first as the kernel's")
    close(final, expected[:, -1], "one pass final state")
    A_, readout = EFFECTIVE.compute(a, None, None, True)
    close(channels_sum(A_, readout, x), outputs, "effective attention")


@pytest.mark.parametrize("seq", [1, 63, 64, 65, 200])
def test_states_stored_in_bfloat16_are_within_one_rounding(seq, fill):
    x, dt, A, B, C, D, z, bias, initial = inputs(seq)
    expected = selective_scan(x, dt, A, B, C, D, z, bias, True, initial)[1]
    out = torch.empty(expected.shape, dtype=torch.bfloat16)
    assert selective_scan_states(x, dt, A, B, bias, True, initial, out=out) is out
    error, bound = (out.float() - expected).abs(), BF16_RTOL * expected.abs() + 1e-5 * expected.abs().max()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
