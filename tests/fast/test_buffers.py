"""`nnterp.fast.buffers`: the pool of huge-page mappings per-token states are written into (reuse, bounds, small buffers)."""

from __future__ import annotations

import pytest
import torch

from nnterp.fast import buffers


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
