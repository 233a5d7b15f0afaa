"""Declared values: what a component serves, where, and whether it can.

A value is a descriptor on a component class (an nnsight ``Envoy`` subclass),
built on nnsight's `eproperty`: reading it inside a trace parks the worker
until the model reaches the value's location and returns what is there;
assigning it swaps a replacement in. nnterp adds four things:

* a **location computed per access** (``key`` may be a function of the envoy):
  a recurrent mixer's values live at whichever kernel call fires on this call
  of the mixer, which only the call itself decides;
* ``select``, one element of the served value (an ``(args, kwargs)`` pair, a
  tuple output), with the container rebuilt around a written element;
* ``unavailable=``, a predicate returning why the value cannot be served on
  this layer in this process (or ``None``): a read or write then raises
  `Unavailable` with that sentence, and ``model.support()`` reports it;
* `DerivedEProperty`, a read-only value computed from others.

A failure mode worth knowing: a value is a ``property``, and a property getter
that raises ``AttributeError`` is swallowed by ``Envoy.__getattr__`` and comes
back as "no attribute". nnterp's own errors never derive from it, but a bug in
a preprocess that raises one resurfaces that way: blame the preprocess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.util import first_input, replace_first_input

from .calls import mediator
from .errors import DeviceError, DtypeError, ReadOnlyValue, ShapeError, Unavailable, WrongType


class Unwrap:
    """Select a module's output out of the tuple some modules return, and rewrap a write.

    ``get`` is element 0 of a tuple (the value itself otherwise); ``put``
    rebuilds the tuple around a written element.
    """

    def get(self, value: Any) -> Any:
        return value[0] if isinstance(value, tuple) else value

    def put(self, value: Any, element: Any) -> Any:
        return (element, *value[1:]) if isinstance(value, tuple) else element


class FirstInput(Unwrap):
    """Select a module's first input out of its ``(args, kwargs)``, and put a write back there."""

    def get(self, value: Any) -> Any:
        return first_input(*value)

    def put(self, value: Any, element: Any) -> Any:
        return replace_first_input(*value, element)


#: Served value -> element; an int indexes a tuple (or the args of an
#: ``(args, kwargs)`` pair), a str names a keyword, an `Unwrap`-like object
#: gets and puts, a plain callable picks (read-only).
Select = int | str | Unwrap | Callable[[Any], Any] | None


class Key:
    """A location suffix computed per access: ``key(envoy) -> "source.op_0.output"``.

    Shown as ``<name>`` (``<kernel.inputs>``), since what it resolves to
    depends on the call.
    """

    def __init__(self, fn: Callable[[Any], str], name: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__

    def __call__(self, envoy: Any) -> str:
        return self.fn(envoy)

    def __repr__(self) -> str:
        return f"<{self.name}>"

    __str__ = __repr__


def _is_call(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)


def select_from(value: Any, select: Select) -> Any:
    """The element ``select`` names in a served ``value``."""
    if select is None:
        return value
    if isinstance(select, Unwrap):
        return select.get(value)
    if callable(select):
        return select(value)
    if _is_call(value):
        args, kwargs = value
        return args[select] if isinstance(select, int) else kwargs.get(select)
    return value[select]


def select_all(value: Any, selects: list) -> list:
    """The elements ``selects`` name in a served ``value``, in order (`select_from` for each)."""
    return [select_from(value, select) for select in selects]


def replace_in(value: Any, select: Select, element: Any) -> Any:
    """``value`` with the element ``select`` names replaced by ``element``."""
    if select is None:
        return element
    if isinstance(select, Unwrap):
        return select.put(value, element)
    if callable(select):
        raise ReadOnlyValue("a value selected by a function cannot be written back")
    if _is_call(value):
        args, kwargs = value
        if isinstance(select, int):
            args = (*args[:select], element, *args[select + 1:])
        else:
            kwargs = {**kwargs, select: element}
        return args, kwargs
    items = list(value)
    items[select] = element
    return type(value)(items) if isinstance(value, tuple) else items


def _rebuild(cls: type, state: dict) -> Any:
    """A value descriptor from its attributes (see `EProperty.__reduce__`)."""
    value = cls.__new__(cls)
    property.__init__(value)
    value.__dict__.update(state)
    return value


class _Served(torch.utils.weak.WeakIdKeyDictionary):
    """Tensors served while autograd records -> ``(envoy, value name)``; pickled empty (a request carries none)."""

    def __reduce__(self) -> tuple:
        return type(self), ()


#: What each tensor served under autograd is, so a ``.grad`` nnsight could not serve is named (`served_as`).
SERVED = _Served()


def noted(envoy: Any, name: str, value: Any) -> Any:
    """``value``, remembered as ``envoy``'s ``name`` when it is a tensor served while autograd records."""
    if isinstance(value, torch.Tensor) and torch.is_grad_enabled():
        SERVED[value] = (envoy, name)
    return value


def served_as(tensor_id: int) -> tuple | None:
    """``(envoy, value name)`` of the live served tensor whose ``id`` is ``tensor_id``, or ``None``."""
    return next((where for tensor, where in list(SERVED.items()) if id(tensor) == tensor_id), None)


class EProperty(eproperty):
    """A value served at a location, readable and (unless ``writable=False``) writable.

    Args:
        key: the location relative to the envoy's path: a string (``"output"``)
            or a function of the envoy returning one, computed per access.
        select: which element of the served value this is (see `select_from`).
        preprocess: ``f(envoy, element) -> view`` applied on read.
        postprocess: ``f(envoy, view) -> element`` applied on write, the inverse
            of ``preprocess``.
        description: the one line ``print(model)`` and ``support()`` show.
        unavailable: ``f(envoy) -> str | None``, why this layer cannot serve it.
        validate: ``f(envoy, new, current)`` raising on a write that does not
            fit what is there (shape, dtype, device).
        annotation: the documented shape (a `nnterp.core.dims` jaxtyping alias).
        none_on_fresh_prompt: the value is ``None`` on a prompt that starts
            from nothing (a state entering the first call).
    """

    def __init__(
        self,
        key: str | Callable[[Any], str],
        *,
        select: Select = None,
        preprocess: Callable[[Any, Any], Any] | None = None,
        postprocess: Callable[[Any, Any], Any] | None = None,
        description: str | None = None,
        unavailable: Callable[[Any], str | None] | None = None,
        validate: Callable[[Any, Any, Any], None] | None = None,
        writable: bool = True,
        annotation: Any = None,
        none_on_fresh_prompt: bool = False,
    ) -> None:
        super(EProperty, self).__init__(key=None, description=description)
        self.none_on_fresh_prompt = none_on_fresh_prompt
        self.key = key if isinstance(key, (str, Key)) else Key(key)
        self.select = select
        self.read_view = preprocess
        self.write_view = postprocess
        self.unavailable = unavailable
        self.validate = validate
        self.writable = writable
        self.annotation = annotation

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.owner = owner

    def __reduce__(self) -> tuple:
        # A `property` subclass does not pickle by itself, and a remote request pickles every component class
        # (docs/remote.md). The annotation (a jaxtyping type, documentation only) stays here: a server need
        # not have jaxtyping.
        return _rebuild, (type(self), {**self.__dict__, "annotation": None})

    def __str__(self) -> str:
        """The line ``print(model)`` shows: ``(name): description``."""
        return f"({self.name}): {self.description}"

    def variant(self, description: str | None = None, annotation: Any = None) -> EProperty:
        """This value with another description and shape, for a subclass: the same code serves it."""
        other = _rebuild(type(self), dict(self.__dict__))
        other.description = description if description is not None else self.description
        other.annotation = annotation if annotation is not None else self.annotation
        return other

    def label(self, envoy: Any) -> str:
        """``"<component>.<value>"`` as `support()` keys it."""
        return f"{getattr(envoy, 'KIND', type(envoy).__name__)}.{self.name}"

    def reason(self, envoy: Any) -> str | None:
        """Why ``envoy`` cannot serve this value now, or ``None``."""
        return self.unavailable(envoy) if self.unavailable is not None else None

    def check(self, envoy: Any) -> None:
        """Raise `Unavailable` or `NotInTrace` before touching the model."""
        reason = self.reason(envoy)
        if reason is not None:
            raise Unavailable(self.label(envoy), reason)
        mediator(f"`{self.label(envoy)}`")

    def _location(self, obj: Any) -> str:
        key = self.key(obj) if isinstance(self.key, Key) else self.key
        return f"{obj.path}.{key}"

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        self.check(obj)
        value = select_from(Mediator.value(self._location(obj)), self.select)
        return noted(obj, self.name, self.read_view(obj, value) if self.read_view is not None else value)

    def __set__(self, obj: Any, value: Any) -> None:
        if not self.writable:
            raise ReadOnlyValue(f"`{self.label(obj)}` is read-only")
        self.check(obj)
        location = self._location(obj)
        element = self.write_view(obj, value) if self.write_view is not None else value
        if self.select is not None or self.validate is not None:
            raw = Mediator.value(location)
            if self.validate is not None:
                self.validate(obj, element, select_from(raw, self.select))
            element = replace_in(raw, self.select, element)
        Mediator.swap(location, element)


class DerivedEProperty(EProperty):
    """A value computed from others: ``compute(envoy) -> value``; read-only unless given ``assign``.

    Its key is the compute function (``<_states>``), or the ``key`` given
    (``<kernel.inputs>`` for a kernel argument served from the call's record):
    reading it runs the function in the worker, which reads whatever locations
    it needs. ``assign(envoy, value)``, where given, does the write the same way.
    """

    def __init__(
        self,
        compute: Callable[[Any], Any],
        *,
        assign: Callable[[Any, Any], None] | None = None,
        description: str | None = None,
        unavailable: Callable[[Any], str | None] | None = None,
        annotation: Any = None,
        key: Key | None = None,
        none_on_fresh_prompt: bool = False,
    ) -> None:
        shown = key if key is not None else Key(compute)
        super(DerivedEProperty, self).__init__(
            shown, description=description, unavailable=unavailable, writable=assign is not None,
            annotation=annotation, none_on_fresh_prompt=none_on_fresh_prompt,
        )
        self.compute = compute
        self.assign = assign

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        self.check(obj)
        return noted(obj, self.name, self.compute(obj))

    def __set__(self, obj: Any, value: Any) -> None:
        if self.assign is None:
            raise ReadOnlyValue(
                f"`{self.label(obj)}` is computed from other values and cannot be assigned"
                + ("; use set_state_after(t, value) to write one position" if self.name == "states" else "")
            )
        self.check(obj)
        self.assign(obj, value)


def check_tensor(what: str, new: Any, current: Any) -> None:
    """Raise unless ``new`` has ``current``'s shape, dtype and device (anything goes where there is no current tensor)."""
    import torch

    if isinstance(current, torch.Tensor):
        check_expected(what, new, tuple(current.shape), current.dtype, current.device)
    elif not isinstance(new, torch.Tensor):
        raise WrongType(f"{what} takes a tensor, got {type(new).__name__}")


def check_expected(what: str, new: Any, shape: tuple, dtype: Any, device: Any) -> None:
    """Raise unless ``new`` is a tensor of ``shape``, ``dtype`` on ``device``, naming what was expected."""
    import torch

    if not isinstance(new, torch.Tensor):
        raise WrongType(f"{what} takes a tensor of shape {tuple(shape)} ({dtype}), got {type(new).__name__}")
    if tuple(new.shape) != tuple(shape):
        raise ShapeError(f"{what} expects shape {tuple(shape)}, got {tuple(new.shape)}")
    if new.dtype != dtype:
        raise DtypeError(f"{what} expects dtype {dtype}, got {new.dtype}: cast it with `.to({dtype})`")
    if new.device != device:
        raise DeviceError(f"{what} expects a tensor on {device}, got one on {new.device}: move it with `.to('{device}')`")


def module_output(description: str, annotation: Any = None) -> EProperty:
    """The module's own output, unwrapped from the tuple some modules return and rewrapped on write."""
    return EProperty(
        "output",
        select=Unwrap(),
        description=description,
        validate=lambda envoy, new, current: check_tensor(f"`{envoy.KIND}.attention_output`", new, current),
        annotation=annotation,
    )
