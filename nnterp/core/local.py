"""Containers of this process's caches and registries, which a remote request must not carry.

A remote request ships nnterp by value: a function travels with the module
globals it reads, so a module-level cache would travel with its contents
(another model's envoys, labels found in this process's transformers, mapped
buffers). Each of these pickles as an empty container of its kind: a server
fills its own.
"""

from __future__ import annotations

import weakref
from typing import Any


class LocalDict(dict):
    """A ``dict`` that pickles empty."""

    def __reduce__(self) -> tuple:
        return type(self), ()


class LocalWeakSet(weakref.WeakSet):
    """A ``WeakSet`` that pickles empty."""

    def __reduce__(self) -> tuple:
        return type(self), ()


def empty_when_pickled(value: Any) -> bool:
    """Whether ``value`` is one of these containers."""
    return isinstance(value, (LocalDict, LocalWeakSet))
