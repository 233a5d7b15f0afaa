"""The fast path on a recurrent mixer: per-token states and mid-prompt writes from the kernel call itself.

Mental model. A prompt reaches a recurrent mixer's state through one kernel
call, ``kernel(q, k, v, g=…, beta=…, initial_state=…)``. The spec's way to
the state after every token routes that call through the token-by-token
kernel and reads a binding inside it once per token. The fast path reads
only the call's *arguments* (``mix.source.<CHUNK_KERNEL>.inputs``), which
are the call's own whatever function is bound (the chunk kernel, the loop,
flash-linear-attention), and:

* ``states`` computes every state from them with `nnterp.fast`, vectorized,
  into one buffer: the kernel itself runs as it would;
* ``state_after(t)`` runs the bound kernel on the tokens up to ``t`` (from
  the call's own entering state) and returns its final state;
* ``set_state_after(t, value)`` splits the call at ``t``: the bound kernel
  runs on ``[:t+1]`` and on ``[t+1:]`` from ``value``, and the call is
  skipped with ``(both outputs concatenated, the second's final state)``,
  so token ``t`` keeps its own readout and the rest continue from
  ``value``. Later writes in the same call re-split and replace the output.

On a one-token decode step, ``states`` is the step's new state (the spec's
``FastSpec.decode``) and ``set_state_after(0, v)`` replaces it.

Differences from the routed path, all deliberate: states equal it within
float32 rounding, not bit for bit; they carry no autograd graph (they are
written in place into one buffer; route for gradients through them); a read
after a write in the same call is allowed and sees the write.

Opt in per model: ``nnterp.fast.fast_states(model)`` sets a flag on each of
that model's mixers whose class has a ``FAST`` spec; the ``unavailable``
predicates read it, so ``model.support()`` reports ``linear_attn.states``
as served without routing. With the flag off nothing changes.

Wiring (what `FastStates.__init_subclass__` does on a class that sets
``FAST``): its ``states`` value, ``state_after`` and ``set_state_after``
are wrapped to dispatch here when the flag is on and to what the class had
otherwise, and ``states``' reason is ``None`` when the flag is on.

Order, as everywhere in nnterp: read and write a call's per-token values
before its ``state_output`` / ``attention_output``; a write after ``states``
of the same call raises `OrderError`, as does a write before a position
already read. A read after a write sees the write (unlike the routed path,
which forbids it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
from nnsight.intervention.interleaver import Mediator

from ..components import kernels
from ..core.calls import in_trace, mediator, per_call
from ..core.errors import NnterpError, OrderError, RoutingError
from ..core.values import DerivedEProperty, check_expected, replace_in
from .buffers import empty_states
from .specs import FastSpec, arguments, slice_call

#: Attribute of a mixer's HF module: whether its model opted in (`fast_states`).
FLAG = "_nnterp_fast_states"


def fast_enabled(envoy: Any) -> bool:
    """Whether ``envoy``'s class has a fast path and its model opted in."""
    return getattr(type(envoy), "FAST", None) is not None and bool(envoy._module.__dict__.get(FLAG, False))


def unless_fast(predicate: Any) -> Any:
    """An ``unavailable`` predicate that is ``None`` when the fast path serves the value, ``predicate`` otherwise."""

    def reason(envoy: Any) -> Optional[str]:
        return None if fast_enabled(envoy) else predicate(envoy)

    reason.__name__ = f"unless_fast_{getattr(predicate, '__name__', 'predicate')}"
    return reason


class FastCall:
    """One prompt call's record: the kernel op, its arguments, and what was read and written."""

    __slots__ = ("op", "args", "kwargs", "arguments", "seq", "output_at", "writes", "served", "states_read", "furthest")

    def __init__(self, op: Any, args: tuple, kwargs: dict, named: dict, seq: int, output_at: int) -> None:
        self.op, self.args, self.kwargs, self.arguments, self.seq, self.output_at = op, args, kwargs, named, seq, output_at
        self.writes: dict[int, torch.Tensor] = {}
        self.served = False
        self.states_read = False
        self.furthest: Optional[tuple[int, str]] = None


class FastStates:
    """Mixin for a `RecurrentMixer` subclass: set ``FAST`` to a `FastSpec` to serve the fast path.

    Inherit it first (``class LinearAttention(FastStates, RecurrentMixer)``).
    """

    FAST: Optional[FastSpec] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.FAST is None:
            return
        for name in ("states", "state_after", "set_state_after"):
            if not getattr(inspect.getattr_static(cls, name, None), "_nnterp_fast", False):
                (_wrap_states if name == "states" else _wrap_method)(cls, name)

    # -- the call ---------------------------------------------------------------

    def _fast_call(self, what: str) -> Any:
        """This call's record (`per_call`), or ``None`` on a one-token decode step."""
        mediator(f"`linear_attn.{what}`")
        cls = type(self)
        kernel = cls.KERNEL(self)
        if kernel == cls.RECURRENT_KERNEL:
            return None

        def read() -> FastCall:
            op = getattr(self.source, kernel)
            med = mediator()
            if hasattr(self, "_arguments"):
                args, kwargs = self._arguments()  # a `KernelArguments` mixer's one read of them (and its order check)
            else:
                if med.occurrence(f"{op.path}.input") > self._call()["kernels"][kernel]:
                    raise OrderError(self._order_hint(what, "this call's kernel had already started (state_output, attention_output or a later value was read first)"))
                args, kwargs = op.inputs
            names, defaults = _signature(cls, kernels.modeling_of(self._module))
            named = arguments(names, defaults, args, kwargs)
            entering = named.get(cls.FAST.initial)
            if isinstance(entering, torch.Tensor):
                # A continued cache's buffer, which the cache overwrites after the kernel returns.
                named[cls.FAST.initial] = entering.clone()
            seq = named[cls.FAST.tokens[0]].shape[1]
            return FastCall(op, args, kwargs, named, seq, med.occurrence(f"{op.path}.output"))

        return per_call(self, "fast", read)

    def _fast_open(self, call: FastCall, what: str) -> None:
        """Raise unless the kernel call has not returned yet."""
        if mediator().occurrence(f"{call.op.path}.output") > call.output_at:
            raise OrderError(self._order_hint(what, "the kernel had returned (state_output or a later value was read)"))

    def _segments(self, call: FastCall, stop: Optional[int] = None) -> list:
        """``(lo, hi, initial)`` runs of the call up to ``stop``, split after every write."""
        stop = call.seq if stop is None else stop
        runs, lo, initial = [], 0, call.arguments.get(type(self).FAST.initial)
        for t in sorted(call.writes):
            if t >= stop:
                break
            runs.append((lo, t + 1, initial))
            lo, initial = t + 1, call.writes[t]
        if lo < stop:
            runs.append((lo, stop, initial))
        return runs

    def _run_kernel(self, call: FastCall, lo: int, hi: int, initial: Any, final: bool) -> Any:
        """The bound kernel (whatever it is) on tokens ``[lo, hi)`` of the call, from ``initial``."""
        cls = type(self)
        modeling = kernels.modeling_of(self._module)
        args, kwargs = slice_call(_signature(cls, modeling)[0], call.args, call.kwargs, cls.FAST, lo, hi, initial, final)
        function = modeling.__dict__[cls.CHUNK_FUNCTION]
        return function(*args, **kwargs)

    # -- reads ------------------------------------------------------------------

    def _fast_states(self) -> torch.Tensor:
        call = self._fast_call("states")
        if call is None:
            return self._decode_state()[:, None]
        spec = type(self).FAST
        first = call.arguments[spec.tokens[0]]
        out = empty_states((*spec.state_shape(call.arguments)[:1], call.seq, *spec.state_shape(call.arguments)[1:]), first.device)
        # States are read, not trained through: no graph (the routed path's, built token by token, has one).
        with torch.no_grad():
            for lo, hi, initial in self._segments(call):
                piece = slice_call((), (), dict(call.arguments), spec, lo, hi, initial, True)[1]
                spec.compute(piece, out[:, lo:hi])
        for t, value in call.writes.items():
            out[:, t] = value
        call.states_read = True
        call.furthest = (call.seq - 1, "states")
        return out

    def _fast_state_after(self, t: int) -> torch.Tensor:
        what = f"state_after({t})"
        call = self._fast_call(what)
        if call is None:
            self._position(t, 1, what)
            return self._decode_state()
        position = self._position(t, call.seq, what)
        if position in call.writes:
            return call.writes[position]
        lo, hi, initial = self._segments(call, position + 1)[-1]
        final = self._run_kernel(call, lo, hi, initial, True)
        if call.furthest is None or position > call.furthest[0]:
            call.furthest = (position, what)
        return final[type(self).FINAL_STATE]

    # -- writes -----------------------------------------------------------------

    def _fast_set_state_after(self, t: int, value: torch.Tensor) -> None:
        what = f"set_state_after({t}, value)"
        call = self._fast_call(what)
        if call is None:
            self._position(t, 1, what)
            return self._write_decode_state(value, what)
        position = self._position(t, call.seq, what)
        spec = type(self).FAST
        device = call.arguments[spec.tokens[0]].device
        check_expected(what, value, spec.state_shape(call.arguments), torch.float32, device)
        self._fast_open(call, what)
        if call.states_read:
            raise OrderError(self._order_hint(what, "states"))
        if call.furthest is not None and call.furthest[0] >= position:
            raise OrderError(self._order_hint(what, call.furthest[1]))
        if call.writes and max(call.writes) >= position:
            raise OrderError(self._order_hint(what, f"set_state_after({max(call.writes)}, value)"))
        call.writes[position] = value
        result = self._split_result(call)
        if not call.served:
            call.op.skip(result)
            call.served = True
        else:
            Mediator.swap(f"{call.op.path}.output", result)

    def _split_result(self, call: FastCall) -> Any:
        """What the call returns with its writes: the segments' outputs, and the final state."""
        flag = bool(call.arguments.get(type(self).FAST.final_flag, False))
        results = [self._run_kernel(call, lo, hi, initial, flag) for lo, hi, initial in self._segments(call)]
        if not isinstance(results[-1], tuple):
            return torch.cat(results, dim=1)  # a kernel returning its output only (no final state asked)
        result = replace_in(tuple(results[-1]), 0, torch.cat([r[0] for r in results], dim=1))
        index = type(self).FINAL_STATE
        if call.seq - 1 in call.writes and result[index] is not None:
            result = replace_in(result, index, call.writes[call.seq - 1])
        return result

    # -- a one-token decode step --------------------------------------------------

    def _decode_inputs(self, op: Any) -> tuple:
        return self._arguments() if hasattr(self, "_arguments") else op.inputs

    def _decode_state(self) -> torch.Tensor:
        kind, index = type(self).FAST.decode
        op = getattr(self.source, type(self).KERNEL(self))
        if kind == "buffer":
            buffer = self._decode_inputs(op)[0][index]
            op.output  # the kernel has updated the buffer in place
            return buffer.clone()
        return op.output[index]

    def _write_decode_state(self, value: torch.Tensor, what: str) -> None:
        kind, index = type(self).FAST.decode
        op = getattr(self.source, type(self).KERNEL(self))
        if kind == "buffer":
            buffer = self._decode_inputs(op)[0][index]
            check_expected(what, value, tuple(buffer.shape), buffer.dtype, buffer.device)
            op.output
            buffer.copy_(value)
            return
        raw = op.output
        check_expected(what, value, tuple(raw[index].shape), raw[index].dtype, raw[index].device)
        op.output = replace_in(raw, index, value)


@functools.lru_cache(maxsize=None)
def _signature(cls: type, modeling: Any) -> tuple:
    """The prompt kernel's positional parameter names and defaults (from transformers' pure-torch body)."""
    stash = modeling.__dict__.get("_nnterp_kernels", {})
    body = kernels.torch_function(stash.get(cls.CHUNK_FUNCTION, modeling.__dict__[cls.CHUNK_FUNCTION]))
    parameters = inspect.signature(body).parameters.values()
    names = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return names, defaults


def _wrap_states(cls: type, name: str = "states") -> None:
    fallback = inspect.getattr_static(cls, "states")

    def states(envoy: Any) -> torch.Tensor:
        if fast_enabled(envoy):
            return envoy._fast_states()
        return fallback.__get__(envoy, type(envoy))

    # The value's key shows as <name> where values are listed: keep the one it had.
    states.__name__ = getattr(fallback.key, "name", "_states")
    wrapped = DerivedEProperty(
        states,
        description=fallback.description,
        unavailable=unless_fast(fallback.reason),
        annotation=getattr(fallback, "annotation", None),
    )
    wrapped._nnterp_fast = True
    wrapped.__set_name__(cls, "states")
    setattr(cls, "states", wrapped)


def _wrap_method(cls: type, name: str) -> None:
    fallback = inspect.getattr_static(cls, name)
    fast = getattr(FastStates, f"_fast_{name}")

    @functools.wraps(fallback)
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        if fast_enabled(self):
            return fast(self, *args, **kwargs)
        return fallback.__get__(self, type(self))(*args, **kwargs)

    dispatch._nnterp_fast = True
    setattr(cls, name, dispatch)


def fast_component(component: type, spec: Optional[FastSpec] = None) -> type:
    """``component`` with the fast path: itself when it already has one, else a subclass mixing `FastStates` in.

    For a mixer class not wired yet (a family's own subclass, a test). ``spec``
    is required in the second case.
    """
    if getattr(component, "FAST", None) is not None:
        return component
    if spec is None:
        raise NnterpError(f"{component.__name__} has no fast path: pass the FastSpec of its kernel")
    if issubclass(component, FastStates):
        return type(component.__name__, (component,), {"FAST": spec, "__module__": component.__module__})
    return type(component.__name__, (FastStates, component), {"FAST": spec, "__module__": component.__module__})


class FastSwitch:
    """What `fast_states` did; as a context manager, undoes it on exit."""

    def __init__(self, modules: list, enabled: bool, previous: list) -> None:
        self.modules, self.enabled, self.previous = modules, enabled, previous

    def __enter__(self) -> "FastSwitch":
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, before in zip(self.modules, self.previous):
            module.__dict__[FLAG] = before

    def __repr__(self) -> str:
        return f"FastStates({len(self.modules)} mixers, enabled={self.enabled})"


def fast_states(model: Any, enabled: bool = True) -> FastSwitch:
    """Serve ``states``, ``state_after`` and ``set_state_after`` of ``model``'s mixers by the fast path.

    Per model, on every mixer whose class has a fast path (``FAST``), until
    ``enabled=False``; ``with nnterp.fast.fast_states(model):`` restores on
    exit, to the flag each mixer had before. No routing is needed, and an optimized kernel (flash-linear-
    attention, mamba_ssm) may stay bound. Call it outside a trace.
    """
    if in_trace():
        raise RoutingError("fast_states was called inside a running trace; call it before `with model.trace(...)`")
    layers = getattr(model, "layers", None)
    if layers is None:
        raise NnterpError(f"fast_states takes a StandardizedTransformer, got {type(model).__name__}")
    mixers = [layer.linear_attn for layer in layers if getattr(layer, "linear_attn", None) is not None]
    modules = [mixer._module for mixer in mixers if getattr(type(mixer), "FAST", None) is not None]
    if not modules:
        kinds = sorted({type(mixer).__name__ for mixer in mixers}) or ["none"]
        raise NnterpError(f"{type(model).__name__} has no mixer with a fast path (mixers: {', '.join(kinds)}); it covers the gated DeltaNet, Kimi delta attention and Mamba-2")
    previous = [module.__dict__.get(FLAG, False) for module in modules]
    for module in modules:
        module.__dict__[FLAG] = bool(enabled)
    return FastSwitch(modules, enabled, previous)
