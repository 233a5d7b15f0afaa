"""Whether a transformers function ran, counted without nnterp: a profile hook on Python calls.

Matched by the function's name, not its code object: when a trace reads
inside a function, nnsight runs an instrumented copy of it (a new code object
with the same name).
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

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(previous)
