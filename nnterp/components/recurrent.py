"""RecurrentMixer: how a recurrent mixer's values are reached, whatever the values are.

A recurrent mixer (a gated DeltaNet, a state-space layer) runs its sequence
through a kernel function the modeling module calls: one kernel for a prompt,
another for a one-token step over a cached state (a decode step of
``generate``), picked by the forward's own test. Its values are the arguments
and results of that call. What differs between mixers is which arguments mean
what (a signature table per kernel, `nnterp.recurrent.arguments`) and how a
state is written inside a call; what they share is here: which kernel fires
(`KERNEL`, once per call), the per-call record (`nnterp.recurrent.call`), the
state entering and leaving the call, and the state after every token,
declared once and served by the strategy `nnterp.recurrent.per_token`
chooses for this mixer of this model.

A subclass (`LinearAttention`, `KimiDeltaAttention`, `SelectiveScan`,
`StateSpace`) names its kernels and its reference HF class in class constants,
its signature tables, and declares its values. The labels
(``CHUNK_KERNEL``, ``STATE_OP``, ...) are found in the installed release's
source (`nnterp.recurrent.labels`), per HF mixer class; no class is mutated.

Conventions, stated once: ``seq`` is the tokens of *this call* (the prompt, or
the one token of a decode step), and every per-token position ``t`` counts
from the call's own first token. A state is float32 whatever the model's dtype.

Failure mode worth knowing: a worker reads in the order the model runs. The
state after token ``t`` exists only while the kernel runs, so per-token reads
and writes come after the kernel's arguments and before ``state_output`` /
``attention_output`` of the same call, and positions in increasing order.
nnsight silently drops a request for a position already passed; nnterp raises
`OrderError` naming the read that came first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..core.calls import mediator, per_call, pinned  # noqa: F401  (per_call, pinned: documented here)
from ..core.dims import Hidden, State, States
from ..core.errors import InvalidArgument, Unavailable
from ..core.standard import Standard
from ..core.values import DerivedEProperty, Key, check_tensor, module_output, replace_in, select_from
from ..fast.spec import EffectiveSpec, FastSpec
from ..recurrent import arguments
from ..recurrent.call import KERNEL_RAN, Call
from ..recurrent.kernels import drill, modeling_of, needs_torch_kernels, original_body, signature_binding
from ..recurrent.labels import Label, cache_test, call_label, state_label
from ..recurrent.per_token.loop import needs_recurrent_routing
from ..recurrent.routing import route_delta_rule, route_kernels, track  # noqa: F401  (documented here)
from ..recurrent.settings import REMOTE
from . import call_state, selected_states
from . import effective_attention as effective
from . import per_token_values as per_token
from .gradient_support import gradient_reasons

__all__ = [
    "RecurrentMixer", "kernel", "needs_torch_kernels", "needs_recurrent_routing", "route_kernels",
    "route_delta_rule", "per_call", "pinned",
]



class RecurrentMixer(Standard):
    """A sequence mixer with a recurrent state, read at the kernel call its forward makes.

    A subclass declares:

    * ``REFERENCE``: the HF mixer class (``"module.Class"``) its class-level
      labels are read from; an envoy reads those of the module it wraps.
    * ``CHUNK_FUNCTION`` / ``RECURRENT_FUNCTION``: the module-level names of
      the prompt's and the decode step's kernels; ``CHUNK_KERNEL`` /
      ``RECURRENT_KERNEL`` are their calls' labels in the forward.
    * ``STATE_VARIABLE``: the variable holding the state inside the kernels;
      ``STATE_OP`` is then the binding of the state after each token's update
      inside the token-by-token kernel (``None`` when the kernels never
      materialize it), and ``STEP_STATE_OP``, when the decode kernel is a
      one-step update (``ONE_STEP_DECODE``, Mamba), the new state in it.
    * ``CHUNK_ARGUMENTS`` / ``RECURRENT_ARGUMENTS``: each kernel's signature
      table (`nnterp.recurrent.arguments`); ``"state"`` is the state entering
      the call, ``SEQ_ARGUMENT`` the argument whose axis 1 counts the tokens.
    * ``FAST``: its fast path (`nnterp.fast.FastSpec`), or ``None``;
      ``EFFECTIVE``: its effective attention (`nnterp.fast.EffectiveSpec`), or ``None``;
      ``CHUNKED_SCAN``: the prompt kernel is Mamba-2's chunk scan.

    ``KERNEL`` names the call that fires on this call of the mixer, decided
    once per call by the forward's own test, so the same values work in a
    trace and at every step of ``tracer.iter``. The state after every token
    (`state`, `states`, `state_after`, `states_of`, `set_state_after`) is served by the
    strategy `nnterp.recurrent.per_token.strategy_for` picks: the token loop
    once ``nnterp.route_kernels(model.family, "torch")`` routes the family's
    prompts through it (like eager attention, the user's choice), Mamba-2's
    chunk boundaries with ``chunk_per_token(model)``, or the kernel call's own
    arguments with ``fast_states(model)``.
    """

    KIND = "linear_attn"
    REFERENCE: str = ""
    CHUNK_FUNCTION: str = ""
    RECURRENT_FUNCTION: str = ""
    CONV_FUNCTIONS: tuple = ("causal_conv1d_fn", "causal_conv1d_update")
    STATE_VARIABLE: str = ""
    ONE_STEP_DECODE: bool = False
    CHUNKED_SCAN: bool = False
    FAST: FastSpec | None = None
    #: Its effective attention (`nnterp.fast.spec`), from the kernel call's arguments, or ``None``.
    EFFECTIVE: EffectiveSpec | None = None
    CHUNK_ARGUMENTS: arguments.Signature = {}
    RECURRENT_ARGUMENTS: arguments.Signature = {}
    SEQ_ARGUMENT: str = "q"
    #: Which element of the kernel's return is the final state.
    FINAL_STATE = 1
    #: Whether the forward also uses, outside the kernel, tensors it passes the kernel in another layout than served
    #: (Mamba-1's ``x`` feeds ``x_proj``): under autograd the kernel then gets its own node of each
    #: (`nnterp.recurrent.arguments.own_nodes`), so a served view's ``.grad`` is the kernel's path alone.
    SHARED_ARGUMENTS = False
    #: Whether the forward must ask the cache by name (a release that stops doing so fails at the label lookup).
    CACHE_TEST_REQUIRED = False

    CHUNK_KERNEL = Label()
    RECURRENT_KERNEL = Label()
    STATE_OP = Label()
    STEP_STATE_OP = Label()
    #: How the forward asks the cache whether it continues a state (`nnterp.recurrent.labels.cache_test`).
    CACHE_TEST = Label()

    attention_output = module_output("the mixer's output, [batch, seq, hidden]", Hidden)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(RecurrentMixer, self).__init__(*args, **kwargs)
        track(self)

    def __getstate__(self) -> dict:
        # Pickled only to travel with a remote request: the copy a server rebuilds runs where routing cannot reach.
        state = super(RecurrentMixer, self).__getstate__()
        state[REMOTE] = True
        return state

    # -- labels, found once per HF mixer class ---------------------------------------

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        """This release's labels in ``hf_mixer``'s forward and kernels (`nnterp.recurrent.labels.labels_for` caches them)."""
        modeling = modeling_of(hf_mixer)
        labels = {
            "CHUNK_KERNEL": call_label(hf_mixer.forward, cls.CHUNK_FUNCTION),
            "RECURRENT_KERNEL": call_label(hf_mixer.forward, cls.RECURRENT_FUNCTION),
            "CACHE_TEST": cache_test(hf_mixer.forward, required=cls.CACHE_TEST_REQUIRED),
            "STATE_OP": None,
            "STEP_STATE_OP": None,
        }
        if cls.STATE_VARIABLE:
            labels["STATE_OP"] = state_label(cls.loop_body(modeling), cls.STATE_VARIABLE, in_loop=True)
            if cls.ONE_STEP_DECODE:
                step = original_body(modeling, cls.RECURRENT_FUNCTION)
                labels["STEP_STATE_OP"] = state_label(step, cls.STATE_VARIABLE, in_loop=False)
        return labels

    @classmethod
    def loop_body(cls, modeling: Any) -> Callable:
        """The pure-torch kernel that loops over tokens: the decode kernel, or the prompt's when the decode is one step."""
        return original_body(modeling, cls.CHUNK_FUNCTION if cls.ONE_STEP_DECODE else cls.RECURRENT_FUNCTION)

    def loop_function(self) -> Callable:
        """`loop_body` of this mixer's modeling module."""
        return type(self).loop_body(modeling_of(self._module))

    # -- which call, which kernel ----------------------------------------------------

    def continues_cache(self, cache: Any) -> bool:
        """The forward's test that the call continues a cached state (before the forward touches the cache)."""
        if cache is None:
            return False
        if self.CACHE_TEST == "has_previous_state()":
            return bool(cache.has_previous_state())
        if hasattr(cache, "get_recurrent_state"):
            return cache.get_recurrent_state(self._module.layer_idx) is not None
        return bool(cache.has_previous_state(self._module.layer_idx))

    def _call(self) -> dict:
        """This call's inputs, read once per call at the mixer's input: the first request of every value."""

        def read() -> dict:
            # Instrument the forward before it runs, whatever value is read first (a convolution window reads
            # no kernel op): otherwise a first trace runs it uninstrumented and a later kernel read is lost.
            self.source
            Call.check_entry(self)
            args, kwargs = self.inputs
            bound = signature_binding(type(self._module).forward, self._module, args, kwargs)
            hidden = bound.get("hidden_states", args[0] if args else None)
            # The cache under this release's keyword: ``cache`` (5.24), ``cache_params`` or ``past_key_values`` before.
            cache = next((bound[name] for name in ("cache", "cache_params", "past_key_values") if bound.get(name) is not None), None)
            med = mediator()
            # How often each kernel has started before this call: a later request
            # for its arguments past that count would land in the next call.
            started = {label: med.occurrence(f"{self.path}.source.{label}.input") for label in (self.CHUNK_KERNEL, self.RECURRENT_KERNEL)}
            return {
                "seq": hidden.shape[1], "cache": cache, "continues": self.continues_cache(cache), "kernels": started,
                "arguments": bound,  # the forward's own arguments (RWKV's state list, which it carries instead of a cache)
            }

        return per_call(self, "inputs", read)

    @staticmethod
    def KERNEL(envoy: RecurrentMixer) -> str:
        """The kernel call that fires on this call of the mixer, decided once per call (`per_call`).

        The forward's own test: the token-by-token update for one token over a
        cached state, the prompt's kernel for everything else (several tokens
        over a cached state included). It is applied to the call's inputs,
        which fire on every call, so a step of ``tracer.iter`` is pinned by its
        first read whatever the user reads first.
        """

        def choose() -> str:
            call = envoy._call()
            return envoy.RECURRENT_KERNEL if call["continues"] and call["seq"] == 1 else envoy.CHUNK_KERNEL

        envoy.source  # instrument the forward before it runs; see routing for why the moment matters
        return per_call(envoy, "kernel", choose)

    @staticmethod
    def kernel(attribute: str) -> Key:
        """A key at whichever kernel fires on this call: ``source.<KERNEL>.<attribute>``."""
        suffix = {"inputs": "input", "input": "input", "output": "output"}[attribute]

        def at_kernel(envoy: RecurrentMixer) -> str:
            return f"source.{envoy.KERNEL(envoy)}.{suffix}"

        return Key(at_kernel, f"kernel.{attribute}")

    def _record(self) -> Call:
        """This call's `Call`: its kernel call's arguments, read once per call when the kernel starts."""

        def make() -> Call:
            kernel = self.KERNEL(self)
            op = getattr(self.source, kernel)
            call = Call(self, kernel, op, kernel == self.RECURRENT_KERNEL, self._call()["kernels"][kernel])
            call.check_not_started("a kernel argument", KERNEL_RAN)
            call.args, call.kwargs = op.inputs
            if self.SHARED_ARGUMENTS and arguments.own_nodes(call, self._table(call)):
                Mediator.swap(f"{op.path}.input", call.arguments)
            call.output_at = mediator().occurrence(f"{op.path}.output")
            tokens = self._serve(self.SEQ_ARGUMENT, call)  # positional or keyword (the mLSTM's backend takes keywords only)
            call.seq = tokens.shape[1]
            call.expected = (self._state_shape(call), torch.float32, tokens.device)
            return call

        return per_call(self, "call", make)

    def _decodes(self) -> bool:
        """Whether this call runs the one-token decode kernel (decided once per call)."""
        return self.KERNEL(self) == self.RECURRENT_KERNEL

    def _table(self, call: Call | None = None) -> dict:
        decodes = call.decodes if call is not None else self._decodes()
        return type(self).RECURRENT_ARGUMENTS if decodes else type(self).CHUNK_ARGUMENTS

    # -- the kernel's arguments by name -------------------------------------------------

    def _serve(self, name: str, call: Call | None = None) -> Any:
        """Argument ``name`` of this call's kernel, tokens first; ``None`` where the kernel has no such argument."""
        call = call if call is not None else self._record()
        return arguments.serve(self._table(call), name, call.arguments)

    def _assign_argument(self, name: str, view: Any) -> None:
        """Replace argument ``name`` of this call's kernel by ``view`` (laid back in the kernel's layout), before it runs."""
        call = self._record()
        what = f"`linear_attn.{name}`"
        slot = self._table(call).get(name)
        if slot is None:
            raise Unavailable(f"a write to {what}", f"it is not an argument of this call's kernel ({call.kernel})")
        call.check_not_started(f"a write to {what}")
        where, layout = slot
        current = select_from(call.arguments, where)
        if isinstance(current, torch.Tensor):
            check_tensor(what, view, layout.read(current))
            element = layout.write(view, current)
        else:
            element = view
        call.args, call.kwargs = replace_in(call.arguments, where, element)
        # Later values of this call (betas from dt, ...) read the record, which now holds the write.
        Mediator.swap(f"{call.op.path}.input", call.arguments)

    def argument(self, name: str) -> Any:
        """Any argument of this call's kernel by its signature-table name, tokens first; ``None`` where it takes none."""
        names = set(type(self).CHUNK_ARGUMENTS) | set(type(self).RECURRENT_ARGUMENTS)
        if name not in names:
            raise InvalidArgument(f"`linear_attn.argument` takes one of {sorted(names)}, got {name!r}")
        reason = needs_torch_kernels(self)
        if reason is not None:
            raise Unavailable(f"linear_attn.argument({name!r})", reason)
        mediator(f"`linear_attn.argument({name!r})`")
        return self._serve(name)

    def _state_shape(self, call: Call) -> tuple:
        """One state's shape in this call, ``(batch, ...)``: the decode buffer's, or the component's formula."""
        if call.decodes and type(self).ONE_STEP_DECODE:
            return tuple(self._serve("state", call).shape)
        return self._prompt_state_shape(call)

    def _prompt_state_shape(self, call: Call) -> tuple:
        raise NotImplementedError

    # -- the state entering and leaving the call ---------------------------------------

    _state_buffer = call_state.state_buffer
    _state_input = call_state.read_state_input
    _assign_state_input = call_state.assign_state_input
    _read_state_output = call_state.read_state_output
    _write_state_output = call_state.write_state_output

    state_input = DerivedEProperty(
        _state_input,
        assign=_assign_state_input,
        key=kernel.__func__("inputs"),
        description="the state entering this call (None on a fresh prompt), a copy; assign to continue from another",
        unavailable=needs_torch_kernels,
        annotation=State,
        none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        _read_state_output,
        assign=_write_state_output,
        key=kernel.__func__("output"),
        description="the state after this call's last token",
        unavailable=needs_torch_kernels,
        annotation=State,
    )

    # -- effective attention: the kernel output's coefficients on the values (effective_attention.py) ------

    EFFECTIVE: EffectiveSpec | None = None
    effective_attention = effective.EFFECTIVE_ATTENTION
    state_input_readout = effective.STATE_INPUT_READOUT
    effective_attention_of = effective.effective_attention_of
    _effective = effective.effective_values

    # -- which values carry a gradient (gradient_support.py) ------------------------------

    #: Values of this component no gradient reaches, beyond the shared ones (`gradient_support.NEVER`): name -> why.
    GRADIENTLESS: dict[str, str] = {}

    def gradients(self) -> dict[str, str | None]:
        """Per value, ``None`` where its ``.grad`` is served now, else why not (``support()``'s ``.grad`` rows)."""
        return gradient_reasons(self)

    # -- the state after every token: one declaration, served by the chosen strategy -------

    _token_state_op = per_token.token_state_op
    _token_op = per_token.token_op
    _iterated_state = per_token.iterated_state
    _assign_iterated_state = per_token.assign_iterated_state
    _states = per_token.every_state

    state = DerivedEProperty(
        per_token.iterated_state,
        assign=per_token.assign_iterated_state,
        key=Key(per_token.token_state_op, "_token_state_op"),
        description="the state after a token of the prompt, one occurrence per token (tracer.iter; under generate, the state each step leaves), [batch, ...state]; needs route_kernels(family, 'torch')",
        unavailable=per_token.iteration_reason,
        annotation=State,
    )
    states = DerivedEProperty(
        per_token.every_state,
        key=Key(per_token.every_state, "_states"),
        description="The recurrent state after every token of this call; needs route_kernels(family, 'torch')",
        unavailable=per_token.per_token_reason,
        annotation=States,
    )
    state_after = per_token.state_after
    states_of = selected_states.states_of
    set_state_after = per_token.set_state_after

    # -- a component's own update rule, for a write inside a call (the token loop) ---------

    def _loop_source(self, op: Any) -> Any:
        """The source of the token loop inside kernel call ``op`` (RWKV's kernel calls its loop: one level further)."""
        return drill(op)

    def _token_state(self, call: Call, occurrence: int | None) -> torch.Tensor:
        """The state bound at ``occurrence`` of the state op (``None``: the next one), as `states` serves it."""
        with pinned(occurrence):
            return call.strategy["op"].output

    def _token_ops(self, call: Call, position: int) -> list:
        """The ops `_token_state` reads the state after ``position`` from: the order check asks that none has passed it."""
        return [call.strategy["op"]]

    def kernel_reason(self) -> str | None:
        """Why this mixer's kernel has no Python loop to read, beyond the bindings `needs_torch_kernels` checks."""
        return None

    def _continue_op(self, call: Call) -> Any:
        """The per-token op whose occurrence ``t + 1`` `_continue_from` writes at (the state op by default)."""
        return call.strategy["op"]

    def _continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        """Make token ``position + 1`` of this call start from ``value`` (the mixer's own update rule)."""
        raise NotImplementedError(f"{type(self).__name__} does not write the state inside a call")


#: ``kernel(attribute)``, the key function values are declared on (`RecurrentMixer.kernel`).
kernel = RecurrentMixer.kernel


def kernel_argument(name: str, description: str, annotation: Any) -> DerivedEProperty:
    """A declared value: argument ``name`` of whichever kernel fires, tokens first, laid back on write.

    Served from the call's record (read once, when the kernel starts), so it
    can be read at any point of the call; a write replaces the argument and
    must come before the kernel starts.
    """
    return DerivedEProperty(
        lambda envoy: envoy._serve(name),
        assign=lambda envoy, view: envoy._assign_argument(name, view),
        key=kernel("inputs"),
        description=description,
        unavailable=needs_torch_kernels,
        annotation=annotation,
    )
