"""Per-call machinery: which call of a module a worker's request is in.

A worker (the greenlet running a block of intervention code) reads values in
the order the model reaches them. Several values of one module call depend on
something the model serves once per call (the kernel a recurrent mixer's
forward branches to, the call's length, the cached state entering it), so it
is computed once per call and remembered: `per_call`.

Which call that is comes from two facts nnsight keeps. A read pinned by
``tracer.iter`` to step ``k`` is served at the ``k``-th occurrence of its
location, so it is in call ``k``. Relaxed (after a pinned read), on step 0 or
outside ``tracer.iter`` there is no pin, and the call is how many times the
module's ``.output`` has been passed, which nnsight counts for every location
whether or not anything read it: inside call ``c`` that many have returned,
and between calls it names the one about to start.

The records live on the worker greenlet. Every run of every invoke has its
own worker, so two invokes reading one mixer never share a record, a record
never outlives its run, and its tensors are freed with the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from greenlet import getcurrent

from .errors import NotInTrace

#: Attribute of the worker greenlet holding its per-call records.
RECORDS = "_nnterp_calls"


def mediator(what: str = "a value") -> Any:
    """The running worker's mediator, or `NotInTrace` naming ``what``."""
    ref = getattr(getcurrent(), "mediator", None)
    found = ref() if ref is not None else None
    if found is None:
        raise NotInTrace(
            f"{what} is served while the model runs: read or write it inside "
            "`with model.trace(...)` or `with model.generate(...)`, and `.save()` "
            "what you need after the block"
        )
    return found


def in_trace() -> bool:
    """Whether this code runs inside a worker (a trace or generate block)."""
    ref = getattr(getcurrent(), "mediator", None)
    return ref is not None and ref() is not None


def current_call(envoy: Any) -> int:
    """The call of ``envoy``'s module the next read of this worker lands in."""
    med = mediator(envoy.path)
    return med.iteration or med.occurrence(f"{envoy.path}.output")


def per_call(envoy: Any, key: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per call of ``envoy``'s module, remembered under ``key``.

    The record is kept until the worker is in another call of the module; the
    call is decided before ``compute`` runs, since computing it reads the model
    and relaxes a ``tracer.iter`` pin.
    """
    call = current_call(envoy)
    records = getcurrent().__dict__.setdefault(RECORDS, {})
    record = records.get((envoy.path, key))
    if record is not None and record[0] == call:
        return record[1]
    value = compute()
    records[(envoy.path, key)] = (call, value)
    return value


def once_per_call(envoy: Any, key: str, compute: Callable[[Any], Any]) -> Any:
    """``compute(envoy)``, remembered per call (`per_call`) inside a trace; outside one (``support()``), computed.

    For what cannot change during a call but is asked several times per access
    (why a value is unavailable: its check, then its strategy's).
    """
    ref = getattr(getcurrent(), "mediator", None)
    if ref is None or ref() is None:
        return compute(envoy)
    return per_call(envoy, key, lambda: compute(envoy))


def forget(envoy: Any, key: str) -> None:
    """Drop the record ``per_call`` keeps for ``(envoy, key)`` on this worker."""
    getcurrent().__dict__.get(RECORDS, {}).pop((envoy.path, key), None)


def outputs_at(node: Any, occurrences: Any) -> list:
    """``node.output`` at each of ``occurrences`` in turn, as ``with pinned(n): node.output`` reads each one.

    One pass for a run of pinned reads of one location (the state after every
    token); the worker's pin is restored on the way out.
    """
    med = mediator("a pinned read")
    previous = med.iteration
    found = []
    try:
        for n in occurrences:
            med.iteration = n
            found.append(node.output)
    finally:
        med.iteration = previous
    return found


class pinned:  # noqa: N801  (used as a function: ``with pinned(n):``)
    """Pin this worker's reads to occurrence ``n`` of their location, as ``tracer.iter[n]`` does.

    ``None`` relaxes the pin. A pinned read relaxes it (for ``n > 0``), so a
    ``with`` holds one read; the pin the worker had is restored on the way out.
    A class, not a ``@contextmanager`` function: it runs on a server too, where
    a function arrives rebuilt from its source without its decorators.
    """

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.mediator = mediator("a pinned read")
        self.previous = self.mediator.iteration
        self.mediator.iteration = self.n

    def __exit__(self, *exc: Any) -> None:
        self.mediator.iteration = self.previous
