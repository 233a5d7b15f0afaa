"""`nnterp.fast`'s vectorized per-token states against the papers' token loops and transformers' kernels.

The oracles: ``tests/reference/recurrences.py`` (one plain loop per token,
written from the equations) and transformers' own pure-torch kernels (their
final states and outputs). Lengths that do not fill a chunk (1, 3, 13, 65,
200), grouped heads, an initial state, and decays strong enough to underflow.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers.models.kimi_linear.modeling_kimi_linear as kimi_modeling
import transformers.models.mamba2.modeling_mamba2 as mamba2_modeling
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen_modeling

from nnterp.fast import buffers, gated_delta_states, kimi_delta_states, ssd_states
from nnterp.recurrent.kernels import torch_function
from tests.reference.recurrences import gated_delta_rule, kimi_delta_attention, ssd

LENGTHS = [1, 3, 13, 64, 65, 200]


def close(actual, expected, what):
    # float32: ~1e-5 relative to the largest state entry.
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=1e-5, msg=what)


def delta_inputs(seq, *, batch=2, key_heads=2, value_heads=4, key_dim=8, value_dim=6, per_channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed + seq)
    q = torch.randn(batch, seq, key_heads, key_dim, generator=gen)
    k = torch.randn(batch, seq, key_heads, key_dim, generator=gen)
    v = torch.randn(batch, seq, value_heads, value_dim, generator=gen)
    g_shape = (batch, seq, value_heads, key_dim) if per_channel else (batch, seq, value_heads)
    g = -2.0 * torch.rand(g_shape, generator=gen)
    beta = torch.rand(batch, seq, value_heads, generator=gen)
    initial = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, initial


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_gated_delta_states_equal_the_token_loop(seq, with_initial):
    q, k, v, g, beta, initial = delta_inputs(seq)
    initial = initial if with_initial else None
    outputs, expected = gated_delta_rule(q, k, v, g, beta, initial)
    got_outputs, states = gated_delta_states(q, k, v, g, beta, initial, output=True)
    assert states.shape == (2, seq, 4, 8, 6) and states.dtype == torch.float32
    close(states, expected, "states")
    close(got_outputs, outputs, "outputs")
    assert torch.equal(gated_delta_states(q, k, v, g, beta, initial), states), "output=False gives the same states"


@pytest.mark.parametrize("seq", LENGTHS)
def test_kimi_delta_states_equal_the_token_loop(seq):
    q, k, v, g, beta, initial = delta_inputs(seq, key_heads=4, per_channel=True)
    outputs, expected = kimi_delta_attention(q, k, v, g, beta, initial)
    got_outputs, states = kimi_delta_states(q, k, v, g, beta, initial, output=True)
    close(states, expected, "states")
    close(got_outputs, outputs, "outputs")


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_states_equal_the_token_loop(seq, groups):
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
    with pytest.raises(ValueError, match="out must be float32"):
        ssd_states(x, dt, A, B, C, dt_bias, True, limit, initial, D=D, output=True, out=ring)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 256])
def test_chunk_sizes_agree(chunk_size):
    q, k, v, g, beta, initial = delta_inputs(70)
    reference = gated_delta_states(q, k, v, g, beta, initial)
    close(gated_delta_states(q, k, v, g, beta, initial, chunk_size=chunk_size), reference, f"chunk_size={chunk_size}")


def test_strong_decays_underflow_to_zero_without_nans():
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
    close(states, kimi_delta_attention(q, k, v, gk, beta, initial)[1], "kimi states")


@pytest.mark.parametrize("seq", [3, 65, 200])
def test_gated_delta_final_state_and_output_equal_transformers_chunk_kernel(seq):
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


def test_ssd_final_state_equals_transformers_chunk_scan():
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


def test_out_buffer_is_written_in_place_and_checked():
    q, k, v, g, beta, initial = delta_inputs(20)
    buffer = torch.full((2, 20, 4, 8, 6), float("nan"))
    result = gated_delta_states(q, k, v, g, beta, initial, out=buffer)
    assert result.data_ptr() == buffer.data_ptr() and torch.isfinite(buffer).all()
    with pytest.raises(ValueError, match="out must be float32"):
        gated_delta_states(q, k, v, g, beta, out=buffer[:, :5])


def test_grouped_heads_must_divide():
    q, k, v, g, beta, _ = delta_inputs(4, key_heads=3, value_heads=4)
    with pytest.raises(ValueError, match="not a multiple"):
        gated_delta_states(q, k, v, g, beta)


# -- buffers -------------------------------------------------------------------------


@pytest.mark.skipif(not buffers.HUGE_PAGES, reason="no transparent huge pages here")
def test_a_freed_buffer_is_reused_and_one_in_use_never_is():
    shape = (1, 40, 1024, 1024)  # 160 MiB: above the mapping threshold
    first = buffers.empty_states(shape)
    address = first.data_ptr()
    view = first[:, 3]
    del first
    second = buffers.empty_states(shape)
    assert second.data_ptr() != address, "a view keeps its mapping in use"
    del view
    third = buffers.empty_states((1, 30, 1024, 1024))
    assert third.data_ptr() == address, "an idle mapping of enough size is handed out again"
    third.fill_(1.0)
    assert buffers.cached_bytes()[0] >= 2 * 160 * 2**20
    del second, third
    assert buffers.empty_cache() >= 2 * 160 * 2**20
    assert buffers.cached_bytes() == (0, 0)


MIB = 2**20


def _read(*mib: int) -> list:
    """One read: a buffer of each size (MiB), written (as a read writes every element)."""
    return [buffers.empty_states((m, 1024, 256)).fill_(1.0) for m in mib]


@pytest.mark.skipif(not buffers.HUGE_PAGES, reason="no transparent huge pages here")
def test_idle_mappings_are_bounded_by_the_last_reads_need(monkeypatch):
    monkeypatch.setattr(buffers, "CACHE_BYTES", None)  # the default, whatever the environment says
    buffers.empty_cache()
    assert buffers.cached_bytes()[0] == 0, "another test holds a state buffer"
    for sizes in [(40,), (100,), (40, 40, 40), (250,), (40,), (40,)]:
        states = _read(*sizes)
        assert buffers.cached_bytes() == (sum(sizes) * MIB, 0)
        del states
        # every result deleted: what stays mapped is this read's need, not every size seen so far
        assert buffers.cached_bytes() == (0, sum(sizes) * MIB), sizes


def _still_mapped(addresses: set, nbytes: int) -> set:
    """The addresses whose ``nbytes`` are mapped in this process now, from ``/proc/self/maps`` (not the pool's accounting)."""
    with open("/proc/self/maps") as handle:
        regions = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in handle]
    return {a for a in addresses if any(start <= a and a + nbytes <= end for start, end in regions)}


@pytest.mark.skipif(not buffers.HUGE_PAGES, reason="no transparent huge pages here")
def test_a_smaller_read_after_a_larger_one_keeps_only_what_it_needs(monkeypatch):
    """The finding: three 48 MiB reads held together, deleted, then one 48 MiB read: 144 MiB stayed mapped."""
    monkeypatch.setattr(buffers, "CACHE_BYTES", None)
    buffers.empty_cache()
    assert buffers.cached_bytes()[0] == 0, "another test holds a state buffer"
    held = [_read(48) for _ in range(3)]  # held together: one read that needs 144 MiB
    addresses = {t.data_ptr() for read in held for t in read}
    assert len(addresses) == 3 and _still_mapped(addresses, 48 * MIB) == addresses
    del held
    assert buffers.cached_bytes() == (0, 144 * MIB)  # that read's need, kept for a sweep
    last = _read(48)
    addresses |= {t.data_ptr() for t in last}
    assert buffers.cached_bytes()[0] == 48 * MIB
    del last
    assert buffers.cached_bytes() == (0, 48 * MIB), "the last read needed 48 MiB"
    assert len(_still_mapped(addresses, 48 * MIB)) == 1, "the other two mappings are unmapped"
    assert buffers.empty_cache() == 48 * MIB and not _still_mapped(addresses, 48 * MIB)


@pytest.mark.skipif(not buffers.HUGE_PAGES, reason="no transparent huge pages here")
def test_a_sweep_of_the_same_shapes_reuses_every_mapping(monkeypatch):
    monkeypatch.setattr(buffers, "CACHE_BYTES", None)
    buffers.empty_cache()
    first = _read(40, 40, 60)
    addresses = {t.data_ptr() for t in first}
    del first
    for _ in range(3):
        again = _read(40, 40, 60)
        assert {t.data_ptr() for t in again} == addresses, "a read of the same shapes maps nothing new"
        del again
    assert buffers.cached_bytes() == (0, 140 * MIB)
    assert buffers.empty_cache() == 140 * MIB and buffers.cached_bytes() == (0, 0)


@pytest.mark.skipif(not buffers.HUGE_PAGES, reason="no transparent huge pages here")
def test_an_explicit_bound_keeps_what_it_says(monkeypatch):
    monkeypatch.setattr(buffers, "CACHE_BYTES", 0)  # NNTERP_STATES_CACHE_MB=0: nothing idle past a request
    buffers.empty_cache()
    _read(40)
    assert buffers.cached_bytes() == (0, 40 * MIB)  # idle until the next request
    _read(100)
    assert buffers.cached_bytes() == (0, 100 * MIB)
    monkeypatch.setattr(buffers, "CACHE_BYTES", 1000 * MIB)  # a larger bound keeps every size seen
    for m in (40, 250):
        _read(m)
    assert buffers.cached_bytes() == (0, 390 * MIB)
    buffers.empty_cache()


def test_small_buffers_are_plain_tensors_outside_the_cache():
    before = buffers.cached_bytes()
    small = buffers.empty_states((2, 3))
    assert small.shape == (2, 3) and small.dtype == torch.float32
    assert buffers.cached_bytes() == before
