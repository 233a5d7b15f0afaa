"""`nnterp.fast.gated_deltanet`: the delta rule's states, output and effective attention, and its specs.

The oracles: ``tests/reference/recurrences.py`` (one plain loop per token,
written from the equations) and transformers' own pure-torch kernels (their
final states and outputs). Lengths that do not fill a chunk (1, 3, 13, 65,
200), grouped heads, an initial state, and decays strong enough to underflow.
The effective attention: ``Σ_s A[t, s] v_s + readout_t`` equals those outputs
within 1e-5 of their scale, and a selection (``positions``, ``heads``) is the
same numbers. The specs compute the same from a served call's arguments.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers.models.kimi_linear.modeling_kimi_linear as kimi_modeling
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen_modeling

from nnterp.fast import gated_delta_attention, gated_delta_states, kimi_delta_attention, kimi_delta_states
from nnterp.fast.gated_deltanet import GATED_EFFECTIVE, GATED_FAST, KIMI_EFFECTIVE, KIMI_FAST
from nnterp.fast.scan import BF16_RTOL
from nnterp.recurrent.kernels import torch_function
from tests.fast.inputs import close, delta_inputs, heads_sum
from tests.reference import recurrences as ref
from tests.reference.recurrences import gated_delta_rule

LENGTHS = [1, 3, 13, 64, 65, 200]


# -- states ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_gated_delta_states_equal_the_token_loop(seq, with_initial, fill):
    q, k, v, g, beta, initial = delta_inputs(seq)
    initial = initial if with_initial else None
    outputs, expected = gated_delta_rule(q, k, v, g, beta, initial)
    got_outputs, states = gated_delta_states(q, k, v, g, beta, initial, output=True)
    assert states.shape == (2, seq, 4, 8, 6) and states.dtype == torch.float32
    close(states, expected, "states")
    close(got_outputs, outputs, "outputs")
    assert torch.equal(gated_delta_states(q, k, v, g, beta, initial), states), "output=False gives the same states"


@pytest.mark.parametrize("seq", LENGTHS)
def test_kimi_delta_states_equal_the_token_loop(seq, fill):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4, per_channel=True)
    outputs, expected = ref.kimi_delta_attention(q, k, v, g, beta, initial)
    got_outputs, states = kimi_delta_states(q, k, v, g, beta, initial, output=True)
    close(states, expected, "states")
    close(got_outputs, outputs, "outputs")


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 256])
def test_chunk_sizes_agree(chunk_size, fill):
    q, k, v, g, beta, initial = delta_inputs(70)
    reference = gated_delta_states(q, k, v, g, beta, initial)
    close(gated_delta_states(q, k, v, g, beta, initial, chunk_size=chunk_size), reference, f"chunk_size={chunk_size}")


def test_strong_decays_underflow_to_zero_without_nans(fill):
    # Cumulated log decays of -1e4 within a chunk: exp of their differences underflows, never overflows.
    q, k, v, g, beta, initial = delta_inputs(130)
    g = torch.full_like(g, -200.0)
    outputs, expected = gated_delta_rule(q, k, v, g, beta, initial)
    states = gated_delta_states(q, k, v, g, beta, initial)
    assert torch.isfinite(states).all()
    close(states, expected, "states")
    q, k, v, gk, beta, initial = delta_inputs(130, key_heads=4, per_channel=True)
    gk[..., ::2] = -300.0
    states = kimi_delta_states(q, k, v, gk, beta, initial)
    assert torch.isfinite(states).all()
    close(states, ref.kimi_delta_attention(q, k, v, gk, beta, initial)[1], "kimi states")


@pytest.mark.parametrize("seq", [3, 65, 200])
def test_gated_delta_final_state_and_output_equal_transformers_chunk_kernel(seq, fill):
    q, k, v, g, beta, initial = delta_inputs(seq)
    kernel = torch_function(qwen_modeling.torch_chunk_gated_delta_rule)
    outputs, states = gated_delta_states(q, k, v, g, beta, initial, output=True)
    if "repeat_interleave" not in inspect.getsource(kernel):  # up to 5.22 the mixer repeats q/k heads, not the kernel
        q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], 2) for x in (q, k))
    out, final = kernel(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(states[:, -1], final, "final state")
    close(outputs, out, "output")


def test_kimi_final_state_equals_transformers_chunk_kernel():
    q, k, v, g, beta, initial = delta_inputs(77, key_heads=4, per_channel=True)
    kernel = torch_function(kimi_modeling.chunk_kimi_delta_attention)
    out, final = kernel(q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    outputs, states = kimi_delta_states(q, k, v, g, beta, initial, output=True)
    close(states[:, -1], final, "final state")
    close(outputs, out, "output")


def test_out_buffer_is_written_in_place_and_checked():
    q, k, v, g, beta, initial = delta_inputs(20)
    buffer = torch.full((2, 20, 4, 8, 6), float("nan"))
    result = gated_delta_states(q, k, v, g, beta, initial, out=buffer)
    assert result.data_ptr() == buffer.data_ptr() and torch.isfinite(buffer).all()
    with pytest.raises(ValueError, match="out must be a floating-point"):
        gated_delta_states(q, k, v, g, beta, out=buffer[:, :5])


def test_grouped_heads_must_divide():
    q, k, v, g, beta, _ = delta_inputs(4, key_heads=3, value_heads=4)
    with pytest.raises(ValueError, match="not a multiple"):
        gated_delta_states(q, k, v, g, beta)


# -- effective attention ---------------------------------------------------------------------

EFFECTIVE_LENGTHS = [1, 3, 13, 64, 65, 150]


@pytest.mark.parametrize("seq", EFFECTIVE_LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_gated_delta_attention_reproduces_the_token_loop(seq, with_initial):
    q, k, v, g, beta, initial = delta_inputs(seq)
    initial = initial if with_initial else None
    expected, _ = ref.gated_delta_rule(q, k, v, g, beta, initial)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    assert A.shape == (2, 4, seq, seq) and A.dtype == torch.float32
    assert (readout is None) == (initial is None)
    assert torch.equal(A, A.tril()), "causal"
    close(heads_sum(A, readout, v), expected, "output")


@pytest.mark.parametrize("seq", EFFECTIVE_LENGTHS)
def test_kimi_delta_attention_reproduces_the_token_loop(seq):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4, per_channel=True)
    expected, _ = ref.kimi_delta_attention(q, k, v, g, beta, initial)
    A, readout = kimi_delta_attention(q, k, g, beta, initial)
    close(heads_sum(A, readout, v), expected, "output")


@pytest.mark.parametrize("seq", [3, 65, 150])
def test_gated_delta_attention_reproduces_transformers_chunk_kernel(seq):
    q, k, v, g, beta, initial = delta_inputs(seq)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    kernel = torch_function(qwen_modeling.torch_chunk_gated_delta_rule)
    if "repeat_interleave" not in inspect.getsource(kernel):  # up to 5.22 the mixer repeats q/k heads, not the kernel
        q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], 2) for x in (q, k))
    out, _ = kernel(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(heads_sum(A, readout, v), out, "output")


def test_kimi_delta_attention_reproduces_transformers_chunk_kernel():
    q, k, v, g, beta, initial = delta_inputs(77, key_heads=4, per_channel=True)
    A, readout = kimi_delta_attention(q, k, g, beta, initial)
    kernel = torch_function(kimi_modeling.chunk_kimi_delta_attention)
    out, _ = kernel(q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(heads_sum(A, readout, v), out, "output")


def test_without_the_kernels_l2_norm_queries_are_still_scaled():
    q, k, v, g, beta, initial = delta_inputs(20)
    q, k = 0.3 * q / q.norm(dim=-1, keepdim=True), 0.3 * k / k.norm(dim=-1, keepdim=True)  # a stable delta rule unnormalized
    expected, _ = ref.gated_delta_rule(q, k, v, g, beta, initial, use_qk_l2norm=False)
    A, readout = gated_delta_attention(q, k, g, beta, initial, use_qk_l2norm=False)
    close(heads_sum(A, readout, v), expected, "output")


def test_strong_decays_in_the_attention_underflow_to_zero_without_nans():
    q, k, v, g, beta, initial = delta_inputs(130)
    g = torch.full_like(g, -200.0)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    assert torch.isfinite(A).all() and torch.isfinite(readout).all()
    close(heads_sum(A, readout, v), ref.gated_delta_rule(q, k, v, g, beta, initial)[0], "output")
    q, k, v, gk, beta, initial = delta_inputs(130, key_heads=4, per_channel=True)
    gk[..., ::2] = -300.0
    A, readout = kimi_delta_attention(q, k, gk, beta, initial)
    assert torch.isfinite(A).all()
    close(heads_sum(A, readout, v), ref.kimi_delta_attention(q, k, v, gk, beta, initial)[0], "kimi output")


def test_a_delta_selection_is_the_same_numbers():
    q, k, v, g, beta, initial = delta_inputs(150)
    A, readout = gated_delta_attention(q, k, g, beta, initial)
    part, part_readout = gated_delta_attention(q, k, g, beta, initial, positions=[140, 3, -1, 70], heads=[2, 0])
    rows = [140, 3, 149, 70]
    torch.testing.assert_close(part, A[:, [2, 0]][:, :, rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, rows][:, :, [2, 0]], rtol=0, atol=1e-6)
    none, only = gated_delta_attention(q, k, g, beta, initial, coefficients=False)
    assert none is None
    torch.testing.assert_close(only, readout, rtol=0, atol=1e-6)
    sliced, _ = gated_delta_attention(q, k, g, beta, initial, positions=slice(10, 20))
    torch.testing.assert_close(sliced, A[:, :, 10:20], rtol=0, atol=1e-6)
    with pytest.raises(IndexError, match="positions out of range"):
        gated_delta_attention(q, k, g, beta, positions=[150])


# -- the specs, by the signature table's names -------------------------------------------------


def served(seq, per_channel=False):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4 if per_channel else 2, per_channel=per_channel)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": initial, "l2norm": True, "final": True}


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_specs_compute_the_token_loops_states_and_output(per_channel, fill):
    a = served(65, per_channel)
    loop = ref.kimi_delta_attention if per_channel else gated_delta_rule
    fast, effective = (KIMI_FAST, KIMI_EFFECTIVE) if per_channel else (GATED_FAST, GATED_EFFECTIVE)
    outputs, expected = loop(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"])
    close(fast.compute(a, None), expected, "states")
    assert fast.state_shape(a) == (2, 4, 8, 6)
    out = torch.full(expected.shape, float("nan"))
    (y, final), states = fast.one_pass(a, out)
    assert states is out
    close(y, outputs, "one pass output")
    close(final, expected[:, -1], "one pass final state")
    A, readout = effective.compute(a, None, None, True)
    close(heads_sum(A, readout, a["v"]), outputs, "effective attention")


@pytest.mark.parametrize("per_channel", [False, True])
def test_in_a_bfloat16_model_the_one_pass_is_the_kernels_body_rounded_alike(per_channel, fill):
    # transformers' torch kernels cast to float32, compute, and round their output only: so does the one pass.
    a = {name: x.bfloat16() if name in ("q", "k", "v", "g", "beta") else x for name, x in served(130, per_channel).items()}
    fast = KIMI_FAST if per_channel else GATED_FAST
    module, name = (kimi_modeling, "chunk_kimi_delta_attention") if per_channel else (qwen_modeling, "torch_chunk_gated_delta_rule")
    q, k = a["q"], a["k"]
    if not per_channel and "repeat_interleave" not in inspect.getsource(torch_function(getattr(module, name))):
        q, k = (x.repeat_interleave(4 // x.shape[2], 2) for x in (q, k))
    y_kernel, final_kernel = torch_function(getattr(module, name))(
        q, k, a["v"], g=a["g"], beta=a["beta"], initial_state=a["state"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    (y, final), states = fast.one_pass(a, torch.empty(2, 130, 4, 8, 6))
    assert y.dtype == y_kernel.dtype == torch.bfloat16 and final.dtype == torch.float32
    close(final, final_kernel, "final state: float32 rounding")
    # The same float32 output, rounded to bfloat16: at most one rounding apart where the two land either side of a tie.
    torch.testing.assert_close(y.float(), y_kernel.float(), rtol=2.0**-7, atol=1e-5 * y_kernel.abs().max().item())


@pytest.mark.parametrize("seq", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("per_channel", [False, True])
def test_states_stored_in_bfloat16_are_within_one_rounding(seq, per_channel, fill):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4 if per_channel else 2, per_channel=per_channel)
    expected = (ref.kimi_delta_attention if per_channel else gated_delta_rule)(q, k, v, g, beta, initial)[1]
    out = torch.empty(expected.shape, dtype=torch.bfloat16)
    assert (kimi_delta_states if per_channel else gated_delta_states)(q, k, v, g, beta, initial, out=out) is out
    error, bound = (out.float() - expected).abs(), BF16_RTOL * expected.abs() + 1e-5 * expected.abs().max()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
