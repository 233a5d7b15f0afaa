"""The errors nnterp raises, each naming what went wrong and what to do.

None of them derives from `AttributeError`: a value is a property on an envoy,
and a property getter that raises `AttributeError` falls through to
``__getattr__``, which reports the attribute as missing and hides the reason
(the failure mode nnsight's `eproperty` docstring warns about).

A value of the wrong kind raises an error that is also the builtin Python code
expects, so ``except ValueError`` / ``except TypeError`` catch it as they catch
torch's and numpy's own; each names what was expected and what came:

    WrongType      (NnterpError, TypeError)   not a tensor where one is written, a float for a position
    InvalidArgument(NnterpError, ValueError)  a value outside what the function accepts (a stepped tracer.iter)
    ShapeError     (NnterpError, ValueError)  a tensor of the wrong shape
    DtypeError     (NnterpError, TypeError)   a tensor of the wrong dtype (cast it with ``.to(dtype)``)
    DeviceError    (NnterpError, ValueError)  a tensor on the wrong device (move it with ``.to(device)``)
    PositionError  (NnterpError, IndexError)  a token position outside the call (or the prompts)
    EmptyPrompt    (NnterpError, ValueError)  a prompt, or a batch row, with no tokens
    OutOfVocabulary(NnterpError, ValueError)  a token id outside the model's vocabulary
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


class WrongType(NnterpError, TypeError):
    """A value of the wrong Python type: not a tensor where a tensor is written, a float for a position."""


class InvalidArgument(NnterpError, ValueError):
    """An argument of the right type outside what the function accepts: an unknown mode or name, two arguments
    that exclude each other, a layer without the part the function needs, a model without the mixers it sets."""


class ShapeError(NnterpError, ValueError):
    """A tensor written with a shape other than the one the value has."""


class DtypeError(NnterpError, TypeError):
    """A tensor written with a dtype other than the one the value has (cast it, nnterp does not)."""


class DeviceError(NnterpError, ValueError):
    """A tensor written on a device other than the one the value lives on (move it, nnterp does not)."""


class PositionError(NnterpError, IndexError):
    """A token position outside the tokens of the call (or of the prompts) it indexes."""


class EmptyPrompt(NnterpError, ValueError):
    """A prompt, or one row of a batch, with no tokens: a causal model has nothing to predict from."""


class OutOfVocabulary(NnterpError, ValueError):
    """A token id outside ``0 .. vocabulary size - 1``."""
