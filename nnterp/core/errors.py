"""The errors nnterp raises, each naming what went wrong and what to do.

None of them derives from `AttributeError`: a value is a property on an envoy,
and a property getter that raises `AttributeError` falls through to
``__getattr__``, which reports the attribute as missing and hides the reason
(the failure mode nnsight's `eproperty` docstring warns about).
"""

from __future__ import annotations


class NnterpError(Exception):
    """Base class of every error nnterp raises on purpose."""


class Unavailable(NnterpError):
    """A declared value that this layer, in this process, cannot serve.

    The message is the same sentence `StandardizedTransformer.support` reports
    for the value on that layer: why, and what to do about it.
    """

    def __init__(self, value: str, reason: str) -> None:
        self.value = value
        self.reason = reason
        super(Unavailable, self).__init__(f"{value} is unavailable: {reason}")


class ReadOnlyValue(NnterpError):
    """A write to a value that is computed from others (a `DerivedEProperty`)."""


class OrderError(NnterpError):
    """A request for a position the run has already passed.

    nnsight drops such a write silently (and skips the rest of the block) when
    a loop pin is active; nnterp checks the order itself and raises this with
    the read that came first and the order to use.
    """


class NotInTrace(NnterpError):
    """A value read or written outside ``model.trace`` / ``model.generate``."""


class UnsupportedModel(NnterpError):
    """A checkpoint whose ``model_type`` no registered family wraps."""


class RoutingError(NnterpError):
    """Kernel routing asked for at a moment it cannot take effect (inside a trace)."""
