"""Whether a transformers function ran, counted without nnterp: a profile hook on Python calls.

Matched by the function's name, not its code object: when a trace reads
inside a function, nnsight runs an instrumented copy of it (a new code object
with the same name). `counting_builtin` counts a C function (``torch.matmul``)
called under a chosen frame, which nnsight reaches through a wrapper or two.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def counting(body: Callable) -> Iterator[list]:
    """Counts the calls of ``body`` (a Python function, by name) while the block runs: ``len(calls)``."""
    calls: list = []
    name = body.__code__.co_name

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name:
            calls.append(1)

    with _profiling(hook):
        yield calls


@contextmanager
def counting_builtin(builtin: Callable, under: Callable, depth: int = 8) -> Iterator[list]:
    """Counts the calls of C function ``builtin`` made with a frame ``under(frame)`` among the ``depth`` innermost."""
    calls: list = []

    def inside(frame) -> bool:
        for _ in range(depth):
            if frame is None:
                return False
            if under(frame):
                return True
            frame = frame.f_back
        return False

    def hook(frame, event, arg):
        if event == "c_call" and arg is builtin and inside(frame):
            calls.append(1)

    with _profiling(hook):
        yield calls


@contextmanager
def _profiling(hook: Callable) -> Iterator[None]:
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
