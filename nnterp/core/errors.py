"""The errors nnterp raises, each naming what went wrong and what to do.

Every one derives from `NnterpError` (``except nnterp.NnterpError`` catches
anything nnterp raised on purpose) and from the builtin Python code already
catches for that kind of mistake, so ``except ValueError`` / ``except
TypeError`` catch it as they catch torch's, numpy's and transformers' own.
`NnterpError` itself is only a base: nnterp raises one of the classes below.

None of them derives from `AttributeError`: a value is a property on an envoy,
and a property getter that raises `AttributeError` falls through to
``__getattr__``, which reports the attribute as missing and hides the reason
(the failure mode nnsight's `eproperty` docstring warns about).

A wrong argument or a wrong value written:

    WrongType          (NnterpError, TypeError)    not a tensor where one is written, a float for a position, a list for a vector
    SignatureError     (NnterpError, TypeError)    a keyword the function does not take (1.x's removed ones too), a required argument missing
    InvalidArgument    (NnterpError, ValueError)   an argument outside what the function accepts: a mode, a name, two arguments that exclude each other, a layer of the wrong kind
    ShapeError         (NnterpError, ValueError)   a tensor of the wrong shape
    DtypeError         (NnterpError, TypeError)    a tensor of the wrong dtype (cast it with ``.to(dtype)``)
    DeviceError        (NnterpError, ValueError)   a tensor on the wrong device (move it with ``.to(device)``)
    PositionError      (NnterpError, IndexError)   a token position outside the call (or the prompts)
    EmptyPrompt        (NnterpError, ValueError)   a prompt, or a batch row, with no tokens
    OutOfVocabulary    (NnterpError, ValueError)   a token id outside the model's vocabulary
    ReadOnlyValue      (NnterpError, TypeError)    a write to a value computed from others (as a tuple refuses item assignment)

A model nnterp cannot wrap:

    UnsupportedModel   (NnterpError, ValueError)   a checkpoint whose ``model_type`` no family wraps (transformers' own ValueError for an unknown type)
    UnsupportedRelease (NnterpError, RuntimeError) the installed transformers' modeling source is not what the family reads
    LoadError          (NnterpError, OSError)      a checkpoint that could not be read: no such folder, the hub unreachable (transformers' own OSError)

A request the run cannot serve at this moment or in this process:

    Unavailable        (NnterpError, RuntimeError) a declared value this layer cannot serve here (the reason `support()` gives)
    OrderError         (NnterpError, RuntimeError) a read or write after the run passed the moment it needs, with the order to use
    NotInTrace         (NnterpError, RuntimeError) a value read or written outside ``model.trace`` / ``model.generate``
    RoutingError       (NnterpError, RuntimeError) kernel routing asked for inside a running trace
    KernelFailure      (NnterpError, RuntimeError) an optimized kernel failed inside the forward (its own error is the
                                                   cause; `kernel_failure` subclasses the builtin it raised)

nnterp 1.x's own names:

    RenamingError      (NnterpError, ValueError)   a model whose modules are not where the names say
    TokenizationError  (NnterpError, ValueError)   a word whose first token cannot be found
"""

from __future__ import annotations


class NnterpError(Exception):
    """Base class of every error nnterp raises on purpose; nnterp raises its subclasses, never this class itself."""


class Unavailable(NnterpError, RuntimeError):
    """A declared value that this layer, in this process, cannot serve.

    The message is the same sentence `StandardizedTransformer.support` reports
    for the value on that layer: why, and what to do about it.
    """

    def __init__(self, value: str, reason: str) -> None:
        self.value = value
        self.reason = reason
        super(Unavailable, self).__init__(f"{value} is unavailable: {reason}")


class ReadOnlyValue(NnterpError, TypeError):
    """A write to a value that is computed from others (a `DerivedEProperty`)."""


class OrderError(NnterpError, RuntimeError):
    """A request for a position the run has already passed.

    nnsight drops such a write silently (and skips the rest of the block) when
    a loop pin is active, or raises its own ``OutOfOrderError`` naming an
    internal location; nnterp checks the order itself (`nnterp.recurrent.call.Call`)
    and raises this with the read that came first and the order to use.
    """


class NotInTrace(NnterpError, RuntimeError):
    """A value read or written outside ``model.trace`` / ``model.generate``."""


class UnsupportedModel(NnterpError, ValueError):
    """A checkpoint whose ``model_type`` no registered family wraps."""


class UnsupportedRelease(NnterpError, RuntimeError):
    """The installed transformers release's modeling source lacks what a family reads (a call, a binding): report it."""


class LoadError(NnterpError, OSError):
    """A model that could not be loaded from where it was asked for: no folder there, or the hub could not serve it."""


class RoutingError(NnterpError, RuntimeError):
    """Kernel routing asked for at a moment it cannot take effect (inside a trace)."""


class KernelFailure(NnterpError, RuntimeError):
    """An optimized kernel (fla, mamba_ssm, causal-conv1d) failed inside the forward: its error is the cause, the
    message adds the fix (``route_kernels(model.family, "torch")``)."""


_FAILURES: dict = {}


def kernel_failure(raised: BaseException) -> type:
    """The `KernelFailure` class to raise for a kernel's error ``raised``: also a subclass of the builtin it is.

    A user catching what the kernel raises (``RuntimeError``, ``ValueError``, ...) still catches it; a builtin
    whose layout cannot be mixed with `KernelFailure`'s gives `KernelFailure` itself.
    """
    builtin = next((c for c in type(raised).__mro__ if c.__module__ == "builtins"), Exception)
    if issubclass(KernelFailure, builtin):
        return KernelFailure
    if builtin not in _FAILURES:
        try:
            _FAILURES[builtin] = type(f"KernelFailure{builtin.__name__}", (KernelFailure, builtin), {"__module__": __name__})
        except TypeError:
            _FAILURES[builtin] = KernelFailure
    return _FAILURES[builtin]


class WrongType(NnterpError, TypeError):
    """A value of the wrong Python type: not a tensor where a tensor is written, a float for a position."""


class SignatureError(NnterpError, TypeError):
    """A call that does not match the function's signature: a keyword it does not take, a required argument missing."""


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


class RenamingError(NnterpError, ValueError):
    """nnterp 1.x's error (``nnterp.rename_utils.RenamingError``): a module or value is not where its standard name says."""


class TokenizationError(NnterpError, ValueError):
    """nnterp 1.x's error (``nnterp.prompt_utils.TokenizationError``): the first token of a word cannot be isolated."""
