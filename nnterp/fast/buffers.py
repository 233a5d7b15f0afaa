"""Where per-token states are written: one buffer per call, from a small cache of huge-page mappings.

Mental model: per-token states are big (a gated DeltaNet layer of 16 heads
of 128x128 keeps 1 MiB per token) and the arithmetic that fills them is
cheap, so on a CPU the first touch of a fresh buffer (one page fault per
4 KiB, and on a VM the host backing the page) costs as much as the
arithmetic (``docs/performance.md``). So:

* the result is written in place into one buffer allocated up front, never
  built from pieces and concatenated;
* on Linux a large CPU buffer is an anonymous mapping advised
  ``MADV_HUGEPAGE`` (one fault per 2 MiB instead of per 4 KiB);
* a mapping whose tensors have all been freed is kept idle and handed to the
  next call that needs as much: a sweep over prompts writes its states into
  memory that is already mapped, as PyTorch's CUDA caching allocator does for
  device memory. A mapping in use is never handed out: the tensor's storage
  holds a reference to it, which is how idleness is told.
* By default the pool is bounded by what the last read needed: a *read* runs
  from a request made while no mapping is in use until its last buffer is
  freed, and its need is the most bytes it held in use at once. While a read
  runs, each request unmaps idle mappings (least recently used first) until
  the pool, in use and idle, holds at most the larger of this read's and the
  previous read's need (the next request of a sweep may want them); when its
  last buffer is freed, the idle mappings are cut to this read's need. So
  after a read whose results are all deleted, the idle mappings are at most
  that read's need, and a sweep reading the same shapes reuses every mapping.
  ``NNTERP_STATES_CACHE_MB`` sets an explicit bound on the
  idle bytes instead (``0``: keep nothing idle), read at import;
  `empty_cache` drops every idle mapping now, `cached_bytes` says what is
  kept.

``empty_states(shape, device)`` returns an uninitialized float32 tensor;
every element is written by the caller. ``NNTERP_HUGE_PAGES=0`` turns both
off (``torch.empty`` everywhere).
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Sequence
from math import prod

import torch

#: Buffers at least this large (bytes) come from mappings; smaller ones from torch.empty.
THRESHOLD = 32 * 2**20
_ALIGN = 2 * 2**20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
class _Pool(list):
    """The pool: pickled (a remote request carries this module) it arrives empty, as mappings do not travel."""

    def __reduce__(self) -> tuple:
        return type(self), ()


#: The mappings this process keeps: in use (a storage refers to them) or idle.
_POOL: list = _Pool()


def _huge_pages_available() -> bool:
    if os.environ.get("NNTERP_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as handle:
            return "[never]" not in handle.read()
    except OSError:
        return False


def _configured_cache_bytes() -> int | None:
    configured = os.environ.get("NNTERP_STATES_CACHE_MB")
    return None if configured is None else int(float(configured) * 2**20)


HUGE_PAGES = _huge_pages_available()
#: The explicit bound on idle bytes (``NNTERP_STATES_CACHE_MB``), or ``None``: the last read's need.
CACHE_BYTES = _configured_cache_bytes()
#: The most bytes in use at once during the current read, and during the previous one; whether a read runs.
_NEED = {"current": 0, "previous": 0, "open": False}


def empty_states(shape: Sequence[int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` for per-token states (see the module docstring)."""
    device = torch.device(device)
    numel = prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not HUGE_PAGES or nbytes < THRESHOLD:
        return torch.empty(tuple(shape), device=device, dtype=dtype)
    # frombuffer holds the view, and the view the mapping, for as long as the storage lives; the view's
    # finalizer runs when the storage is freed, after the view let go of the mapping.
    view = memoryview(_take(nbytes))
    weakref.finalize(view, _freed)
    return torch.frombuffer(view, dtype=dtype, count=numel).view(tuple(shape))


def _freed() -> None:
    """A buffer's storage was freed: if it was the read's last, cut the idle mappings to what the read needed."""
    if not _NEED["open"] or cached_bytes()[0]:
        return
    _NEED["previous"], _NEED["current"], _NEED["open"] = _NEED["current"], 0, False
    if CACHE_BYTES is None:
        _trim(_NEED["previous"])


def _idle(index: int) -> bool:
    # References: the pool's slot and getrefcount's argument; a storage using it adds one.
    return sys.getrefcount(_POOL[index]) <= 2


def _take(nbytes: int):
    """An idle mapping of at least ``nbytes`` (at most twice that), or a new one."""
    best = None
    for index in range(len(_POOL)):
        size = len(_POOL[index])
        if nbytes <= size <= 2 * nbytes and _idle(index) and (best is None or size < len(_POOL[best])):
            best = index
    in_use, _ = cached_bytes()
    if in_use == 0 and _NEED["open"]:  # a new read begins before `_freed` closed the last one
        _NEED["previous"], _NEED["current"] = _NEED["current"], 0
    _NEED["open"] = True
    if best is not None:
        mapping = _POOL.pop(best)
    else:
        size = -(-nbytes // _ALIGN) * _ALIGN
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    _POOL.append(mapping)  # most recently used last
    # The caller's storage does not refer to the mapping yet: count it in use by hand.
    in_use += len(mapping)
    _NEED["current"] = max(_NEED["current"], in_use)
    if CACHE_BYTES is not None:
        _trim(CACHE_BYTES, keep=mapping)
    else:
        _trim(max(0, max(_NEED["current"], _NEED["previous"]) - in_use), keep=mapping)
    return mapping


def _trim(limit: int, keep: object = None) -> None:
    """Unmap the least recently used idle mappings (never ``keep``) until the idle ones hold at most ``limit`` bytes."""
    idle = [index for index in range(len(_POOL)) if _POOL[index] is not keep and _idle(index)]
    total = sum(len(_POOL[index]) for index in idle)
    dropped = set()
    for index in idle:
        if total <= limit:
            break
        total -= len(_POOL[index])
        dropped.add(index)
    if dropped:
        _POOL[:] = [mapping for index, mapping in enumerate(_POOL) if index not in dropped]


def empty_cache() -> int:
    """Unmap every idle state buffer (as ``torch.cuda.empty_cache`` does); returns the bytes released."""
    before = sum(len(_POOL[index]) for index in range(len(_POOL)) if _idle(index))
    _trim(0)
    return before


def cached_bytes() -> tuple[int, int]:
    """``(in_use, idle)`` bytes of the state buffers this process keeps."""
    idle = sum(len(_POOL[index]) for index in range(len(_POOL)) if _idle(index))
    return sum(len(mapping) for mapping in _POOL) - idle, idle
