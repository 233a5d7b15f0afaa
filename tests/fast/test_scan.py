"""`nnterp.fast.scan`: the two fills of a decayed sum of rank-one writes, and `scan_attention`.

The fills: against ``tests/reference/recurrences.decayed_outer_products``, the
recurrence ``S_t = exp(g_t) ⊙ S_{t-1} + a_t ⊗ b_t`` as one plain loop per token
in the inputs' dtype. In float64 the closed-form blocks equal it to float64
rounding over shapes, lengths around the block size (1, C − 1, C, C + 1,
several blocks), block sizes that divide the length or not, decays per head
or per row, near 1 and near 0, an entering state; in float32 within float32
rounding, and equal to the token loop; stored in bfloat16 within one rounding
(`BF16_RTOL`) at any length and block size. Autograd's gradient by finite
differences. The fills see no padding as such (a padded row's inputs are
whatever the model feeds its kernel): padded batches are checked on the models.

`scan_attention`, shared by the two scans: a selection is the same numbers (within float32
rounding: rows asked sparsely are computed one at a time, summed in another order), in bounded blocks too, and a
row asked alone is Mamba-1's equation in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nnterp.fast.scan as scan
from nnterp.fast import selective_scan_attention, ssd_attention
from nnterp.fast.scan import BF16_RTOL, block_size, block_states
from tests.fast.inputs import close, scan_inputs
from tests.reference.recurrences import decayed_outer_products


def test_a_scan_selection_is_the_same_numbers_in_bounded_blocks(monkeypatch):
    a = scan_inputs(150)["mamba"]
    args = (a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, a["state"])
    A, readout = selective_scan_attention(*args)
    monkeypatch.setattr(scan, "BLOCK_ELEMENTS", 1)  # one channel at a time
    part, part_readout = selective_scan_attention(*args, positions=[149, 0, 64], channels=[6, 2])
    torch.testing.assert_close(part, A[:, [6, 2]][:, :, [149, 0, 64]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_readout, readout[:, [149, 0, 64]][:, :, [6, 2]], rtol=0, atol=1e-6)
    s = scan_inputs(70)["ssd"]
    full, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"])
    some, _ = ssd_attention(s["dt"], s["A"], s["B"], s["C"], s["D"], s["dt_bias"], positions=range(60, 70), heads=[3])
    torch.testing.assert_close(some, full[:, [3], 60:70], rtol=1e-5, atol=1e-6)


def test_a_row_asked_alone_is_the_selective_scan_equation_in_float64():
    # A[d, t, s] = silu(z_t[d]) (Σ_n C_t[n] B_s[n] exp(Σ_{s<j≤t} Δ_j[d] A[d, n]) Δ_s[d] + D[d] δ_ts), Δ = softplus(dt + bias)
    seq, t = 300, 299
    a = {k: v.double() for k, v in scan_inputs(seq)["mamba"].items()}
    delta = torch.nn.functional.softplus(a["dt"] + a["dt_bias"])  # [b, seq, d]
    log_decay = delta[..., None] * a["A"]  # [b, seq, d, n]
    after = torch.stack([log_decay[:, s + 1 : t + 1].sum(1) for s in range(t + 1)], dim=1)  # [b, t + 1, d, n]
    expected = torch.einsum("bn,bsn,bsdn->bds", a["C"][:, t], a["B"][:, : t + 1], after.exp()) * delta[:, : t + 1].permute(0, 2, 1)
    expected[:, :, t] += a["D"]
    expected = expected * torch.nn.functional.silu(a["z"][:, t])[..., None]
    f = scan_inputs(seq)["mamba"]
    got, _ = selective_scan_attention(f["dt"], f["A"], f["B"], f["C"], f["D"], f["z"], f["dt_bias"], True, None, positions=[t])
    torch.testing.assert_close(got[:, :, 0].double(), expected, rtol=1e-5, atol=1e-6)


# -- the fills ------------------------------------------------------------------------------

#: Log decays per token: near 1 (nothing decays), mixed, near 0 (every state forgets the last).
DECAYS = {"near one": (-1e-4, 0.0), "mixed": (-4.0, 0.0), "near zero": (-40.0, -20.0)}


def writes(batch, heads, n, rows, cols, per_row, decays, dtype=torch.float64, seed=0):
    """``(g, a, b, start, read_cols, read_rows)`` of the given shapes, seeded."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = DECAYS[decays]
    g = lo + (hi - lo) * torch.rand(batch, heads, n, rows if per_row else 1, generator=gen, dtype=torch.float64)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    values = (g, r(batch, heads, n, rows), r(batch, heads, n, cols), r(batch, heads, rows, cols), r(batch, heads, n, cols), r(batch, heads, n, rows))
    return tuple(x.to(dtype) for x in values)


def shapes():
    return st.fixed_dictionaries({
        "batch": st.integers(1, 2), "heads": st.integers(1, 3), "rows": st.integers(1, 5), "cols": st.integers(1, 4),
        "per_row": st.booleans(), "decays": st.sampled_from(sorted(DECAYS)), "size": st.integers(1, 9),
        "seed": st.integers(0, 2**16),
    })


def length(data, size):
    """A length around the block size: 1, C − 1, C, C + 1, several blocks (dividing or not), or any."""
    choices = [1, max(1, size - 1), size, size + 1, 3 * size, 3 * size + 2]
    return data.draw(st.one_of(st.sampled_from(choices), st.integers(0, 40)), label="n")


@settings(max_examples=60, deadline=None)
@given(shape=shapes(), data=st.data())
def test_blocks_equal_the_recurrence_in_float64(shape, data):
    s = dict(shape)
    size, seed, per_row, decays = s.pop("size"), s.pop("seed"), s.pop("per_row"), s.pop("decays")
    n = length(data, size)
    first = data.draw(st.integers(0, 2), label="first")
    g, a, b, start, read, _ = writes(s["batch"], s["heads"], n, s["rows"], s["cols"], per_row, decays, seed=seed)
    expected = decayed_outer_products(g, a, b, start)
    out = torch.full((s["batch"], first + n + 1, s["heads"], s["rows"], s["cols"]), float("nan"), dtype=torch.float64)
    last, readout = block_states(out, first, start, g, a, b, size, read=read)
    scale = max(1.0, expected.abs().max().item()) if n else 1.0
    torch.testing.assert_close(out[:, first : first + n], expected, rtol=0, atol=1e-12 * scale)
    assert torch.isnan(out[:, :first]).all() and torch.isnan(out[:, first + n :]).all(), "only tokens first .. first + n - 1"
    torch.testing.assert_close(last, expected[:, -1] if n else start, rtol=0, atol=1e-12 * scale)
    assert last.data_ptr() != out.data_ptr() and last.dtype == torch.float64
    reads = torch.einsum("bthrc,bhtc->bhtr", expected, read)  # S_t read_t
    torch.testing.assert_close(readout, reads, rtol=0, atol=1e-11 * scale)


@pytest.mark.parametrize("per_row", [False, True])
def test_the_readout_by_rows_and_a_ring_of_two_slots(per_row):
    g, a, b, start, read_cols, read_rows = writes(2, 3, 23, 4, 5, per_row, "mixed", seed=1)
    expected = decayed_outer_products(g, a, b, start)
    full = torch.empty(2, 23, 3, 4, 5, dtype=torch.float64)
    _, readout = block_states(full, 0, start, g, a, b, 5, read=read_rows, read_rows=True)
    torch.testing.assert_close(readout, torch.einsum("bthrc,bhtr->bhtc", expected, read_rows), rtol=0, atol=1e-11)
    ring = torch.full((2, 2, 3, 4, 5), float("nan"), dtype=torch.float64)
    last, ring_readout = block_states(ring, 0, start, g, a, b, 5, read=read_rows, read_rows=True)
    torch.testing.assert_close(ring_readout, readout, rtol=0, atol=0)
    torch.testing.assert_close(ring[:, 22 % 2], expected[:, -1], rtol=0, atol=1e-12)
    torch.testing.assert_close(last, expected[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 100])
@pytest.mark.parametrize("size", [4, 16, 64])
@pytest.mark.parametrize("decays", sorted(DECAYS))
def test_blocks_equal_the_token_loop_and_the_recurrence_in_float32(n, size, decays):
    g, a, b, start, read, _ = writes(2, 3, n, 6, 5, decays == "mixed", decays, dtype=torch.float32, seed=n)
    expected = decayed_outer_products(*(x.double() for x in (g, a, b, start)))
    blocks, loop = torch.empty(2, n, 3, 6, 5), torch.empty(2, n, 3, 6, 5)
    last, readout = block_states(blocks, 0, start, g, a, b, size, read=read)
    loop_readout = scan.step_states(loop, 0, start, g, a, b, read=read)
    close(blocks, expected.float(), "blocks against the recurrence")
    close(blocks, loop, "blocks against the token loop")
    close(last, loop[:, -1], "the last state")
    close(readout, loop_readout, "the readout")


@settings(max_examples=25, deadline=None)
@given(shape=shapes(), data=st.data())
def test_states_stored_in_bfloat16_are_within_one_rounding_at_any_length(shape, data):
    s = dict(shape)
    size, seed, per_row, decays = s.pop("size"), s.pop("seed"), s.pop("per_row"), s.pop("decays")
    n = data.draw(st.integers(1, 300), label="n")
    g, a, b, start, _, _ = writes(s["batch"], s["heads"], n, s["rows"], s["cols"], per_row, decays, seed=seed)
    expected = decayed_outer_products(g, a, b, start)  # float64
    out = torch.empty(s["batch"], n, s["heads"], s["rows"], s["cols"], dtype=torch.bfloat16)
    last, _ = block_states(out, 0, start.float(), g.float(), a.float(), b.float(), size)
    assert last.dtype == torch.float32, "the carried state stays float32"
    scale = expected.abs().max().item()
    # One rounding to bfloat16 (BF16_RTOL of each entry) plus float32's error (1e-5 of the largest entry).
    error = (out.double() - expected).abs()
    bound = BF16_RTOL * expected.abs() + 1e-5 * scale
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g} at n={n}, size={size}"


def test_the_block_size_bounds_the_factors():
    assert block_size(1, 32, 128) == 64  # a gated DeltaNet layer: 64-token blocks
    assert block_size(1, 1536, 16) == 26  # Mamba-1's channels: 1536 · 16 · 26² ≤ 2²⁴
    assert block_size(1, 1, 1, 8) == 8


def test_the_gradient_by_finite_differences():
    g, a, b, start, _, _ = writes(1, 2, 7, 3, 2, True, "mixed", seed=3)
    def states(g, a, b, start):
        out = torch.zeros(1, 7, 2, 3, 2, dtype=torch.float64)
        block_states(out, 0, start, g, a, b, 3)
        return out
    inputs = tuple(x.clone().requires_grad_() for x in (g, a, b, start))
    assert torch.autograd.gradcheck(states, inputs)


def test_the_fill_takes_the_blocks_on_a_loop_free_device_under_autograd_and_for_another_dtype(monkeypatch):
    taken = []
    monkeypatch.setattr(scan, "block_states", lambda *args, **kw: taken.append("blocks") or (args[2], None))
    monkeypatch.setattr(scan, "step_states", lambda *args, **kw: taken.append("loop"))
    g, a, b, start, _, _ = writes(1, 2, 5, 3, 2, False, "mixed", dtype=torch.float32)
    scan.fill_states(torch.empty(1, 5, 2, 3, 2), 0, start, g, a, b)
    scan.fill_states(torch.empty(1, 5, 2, 3, 2, dtype=torch.bfloat16), 0, start, g, a, b)
    scan.fill_states(torch.empty(1, 5, 2, 3, 2), 0, start, g, a.requires_grad_(), b)
    monkeypatch.setattr(scan, "LOOP_FREE", frozenset({"cpu"}))
    scan.fill_states(torch.empty(1, 5, 2, 3, 2), 0, start, g, a.detach(), b)
    assert taken == ["loop", "blocks", "blocks", "blocks"]
