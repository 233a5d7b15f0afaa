"""MLSTM: xLSTM's matrix-memory LSTM cell (Beck et al., 2024, arXiv:2405.04517).

Mental model: per head, a matrix memory ``C`` ``[key_dim, value_dim]`` (key
first, as a DeltaNet's state), a normalizer ``n`` ``[key_dim]`` and a
stabilizer ``m`` (one number). Each token writes its key-value product with an
exponential input gate and forgets with a sigmoid forget gate; the readout is
normalized:

    m_t = max(log σ(f̃_t) + m_{t-1}, ĩ_t)                       (the stabilizer)
    C_t = exp(log σ(f̃_t) + m_{t-1} - m_t) C_{t-1} + exp(ĩ_t - m_t) k_t v_tᵀ
    n_t = exp(log σ(f̃_t) + m_{t-1} - m_t) n_{t-1} + exp(ĩ_t - m_t) k_t
    h_t = C_tᵀ q̂_t / (max(|n_tᵀ q̂_t|, exp(-m_t)) + eps),  q̂_t = q_t / √key_dim

``C`` and ``n`` are stored scaled by ``exp(-m)`` (the paper's stabilized
form, as transformers stores them), so they mean nothing without their ``m``.

**The state is one packed tensor** ``[batch, mixer_heads, key_dim,
state_columns]`` with ``state_columns = value_dim + 2``: ``[..., :value_dim]``
is ``C``, ``[..., value_dim]`` is ``n``, ``[..., value_dim + 1]`` is ``m``
(repeated along the key axis; a write's ``m`` is read from key row 0). One
value, so a state read on one prompt and written on another carries all three
consistently; `MLSTM.unpack` / `MLSTM.pack` split and join it
(`nnterp.fast.mlstm`).

Values, all tokens first (``seq`` is this call's tokens, one on a decode step):

* ``attention_queries`` / ``attention_keys`` ``[batch, seq, mixer_heads,
  key_dim]``, ``attention_values`` ``[batch, seq, mixer_heads, value_dim]``:
  the kernel's q, k, v (q unscaled: the kernel divides it by √key_dim).
* ``input_gates`` / ``forget_gates`` ``[batch, seq, mixer_heads]``: the gates'
  pre-activations ĩ, f̃ (after the soft cap), as the kernel takes them.
* ``decays`` ``[batch, seq, mixer_heads]``: log σ(f̃) ≤ 0, read-only.
* ``state_input``: the packed state entering the call, a copy; ``None`` when
  it is zero (a fresh prompt: transformers passes its zeroed cache, which
  the kernel treats as no state). Assign it to continue from another.
* ``state_output``: the packed state after the call's last token; writable.
* ``states`` ``[batch, seq, mixer_heads, key_dim, state_columns]``,
  ``state_after(t)``, ``set_state_after(t, value)``: served by `FromArguments`,
  whatever the setting (the kernel keeps only chunk boundaries): the states
  computed from the call's arguments (``FAST``, `nnterp.fast.mlstm`),
  ``state_after(t)`` the backend's final state on the tokens up to ``t``; a
  write splits the backend call at ``t``. ``state`` under ``tracer.iter`` is
  unavailable.
* ``effective_attention`` ``[batch, mixer_heads, seq, seq]``: exact, given the
  gates and each token's normalizer denominator, ``h_t = Σ_s A[t, s] v_s`` plus
  ``state_input_readout`` ``[batch, seq, mixer_heads, value_dim]`` (the entering
  state's part; ``None`` when it is zero); `nnterp.fast.mlstm.mlstm_attention`.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output.

Gradients (transformers' xLSTM needs ``use_cache=False`` for any backward: it
copies each state into its cache in place): ``.grad`` reaches the kernel's
arguments, ``decays``, a state written with ``set_state_after``, and ``states``
read before the kernel runs (the layer's output is then read through them).

The kernel is the mixer's backend module (``self.mlstm_backend(...)``), the
same call for a prompt and for a decode step (it picks its chunkwise,
sequence or one-step kernel by length), so every value is served the same way
on both. Failure mode worth knowing: its q, k, v and gates are heads first
(``[batch, heads, seq, ...]``); every value is served tokens first and laid
back on write, so never transpose what you read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..core.dims import BATCH, KEY_DIM, MIXER_HEADS, SEQ, STATE_COLUMNS, Gates, Values
from ..core.errors import Unavailable
from ..core.values import DerivedEProperty, Unwrap, check_expected, replace_in
from ..fast.mlstm import EFFECTIVE as MLSTM_ATTENTION
from ..fast.mlstm import FAST as MLSTM_FAST
from ..fast.mlstm import pack, unpack
from ..recurrent.arguments import HEADS_FIRST, SAME, kernel_waiting
from ..recurrent.call import Call
from ..recurrent.gradients import graft, recording
from ..recurrent.kernels import modeling_of, needs_torch_kernels
from ..recurrent.labels import call_label
from ..recurrent.per_token import every_state
from .recurrent import RecurrentMixer, kernel, kernel_argument

Keys = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {KEY_DIM}"]
PackedState = Float[Tensor, f"{BATCH} {MIXER_HEADS} {KEY_DIM} {STATE_COLUMNS}"]
PackedStates = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {KEY_DIM} {STATE_COLUMNS}"]

_NO_CACHE = (
    "this call runs without a cache, so its final state carries on nowhere (the backend returns one all the same): "
    "run it with use_cache=True (the default of a trace and of generate)"
)
_NO_ITERATION = (
    "the mLSTM's prompt kernel (chunkwise, then a token loop only for the tokens past the last whole chunk) has no "
    "location that holds the state once per token for tracer.iter; read state_after(t) or states (computed from the "
    "kernel call's arguments) and write set_state_after(t, value)"
)


def backend_state(state: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """A packed state as the backend's ``(c_initial, n_initial, m_initial)``, in the model's dtype.

    transformers keeps the state between calls in a cache of the model's dtype and the chunkwise kernel multiplies it
    with q, k, v in theirs, so a written state is cast the same way (a no-op on a float32 model).
    """
    if state is None:
        return (None, None, None)
    return tuple(x.to(dtype) for x in unpack(state))


class _Triple(Unwrap):
    """The backend's ``c_initial``, ``n_initial``, ``m_initial`` keywords as one packed state (``None`` when absent)."""

    def get(self, value: Any) -> Any:
        kwargs = value[1]
        c = kwargs.get("c_initial")
        return None if c is None else pack(c, kwargs["n_initial"], kwargs["m_initial"])

    def put(self, value: Any, element: Any) -> Any:
        args, kwargs = value
        return args, {**kwargs, **dict(zip(("c_initial", "n_initial", "m_initial"), backend_state(element, kwargs["query"].dtype)))}


class MLSTM(RecurrentMixer):
    """An xLSTM mLSTM layer (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.xlstm.modeling_xlstm.xLSTMLayer"
    #: No module-level kernel name (nothing to route): the kernel is the backend module's call in the layer's
    #: forward, ``BACKEND_CALL``, prompt and decode step alike.
    CHUNK_FUNCTION = ""
    BACKEND_CALL = "self_mlstm_backend"
    #: Its own strategy is `FromArguments` (its ``FAST`` spec): the backend keeps the state at chunk boundaries only.
    STATES_FROM_ARGUMENTS = True
    FAST = MLSTM_FAST
    #: The backend's ``eps``, which its call does not carry: the spec's one pass and tapped readout divide by it.
    FAST_CONSTANTS = {"eps": "mlstm_backend.config.eps"}
    CONV_FUNCTIONS = ()
    SEQ_ARGUMENT = "k"
    #: ``self.mlstm_backend(query=, key=, value=, igate=, fgate=, c_initial=, n_initial=, m_initial=)``.
    CHUNK_ARGUMENTS = {
        "q": ("query", HEADS_FIRST),
        "k": ("key", HEADS_FIRST),
        "v": ("value", HEADS_FIRST),
        "igate": ("igate", HEADS_FIRST),
        "fgate": ("fgate", HEADS_FIRST),
        "state": (_Triple(), SAME),
    }
    RECURRENT_ARGUMENTS = CHUNK_ARGUMENTS
    EFFECTIVE = MLSTM_ATTENTION
    #: No decay (log sigmoid(1e4) is 0 in float32), no write (k_s = 0, exp(-1e4 - m) = 0) and the stabilizer m kept.
    SKIP = {"input_gates": -1e4, "forget_gates": 1e4, "attention_keys": 0.0}

    #: Gradient-less values beyond the shared ones (`nnterp.recurrent.gradient_support`).
    GRADIENTLESS = {
        "state_output": (
            "the backend returns its final state beside its outputs, which do not read it (the model only copies it "
            "into its cache), so no gradient of this call's outputs reaches it: states.grad[:, -1] is the derivative "
            "by the state after the last token"
        ),
    }
    @staticmethod
    def pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``(C [..., k, v], n [..., k], m [..., 1])`` -> the packed state ``[..., k, v + 2]`` (`nnterp.fast.mlstm.pack`)."""
        return pack(c, n, m)

    @staticmethod
    def unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed state ``[..., k, v + 2]`` -> ``(C, n, m)``, float32 (`nnterp.fast.mlstm.unpack`)."""
        return unpack(state)

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        # One call for every length: no decode kernel, no cache test, no per-token binding.
        return {
            "CHUNK_KERNEL": call_label(hf_mixer.forward, cls.BACKEND_CALL),
            "RECURRENT_KERNEL": None, "CACHE_TEST": None, "STATE_OP": None, "STEP_STATE_OP": None,
        }

    def continues_cache(self, cache: Any) -> bool:
        return False  # the backend call is the same on a decode step

    def pure_torch_kernel(self) -> bool:
        """Whether the call runs transformers' own backend in inference mode (not the external ``xlstm`` kernels,
        not a training mode), keeping its state in float32: the state dtype its sequence and step kernels were
        bound with (``config.inference_state_dtype`` when the backend was built), read off the backend itself."""
        backend = self._module.mlstm_backend
        modeling = modeling_of(self._module)
        native = getattr(modeling, "xLSTMBackend", None)
        if native is None or type(backend) is not native or "inference" not in backend.config.mode:
            return False
        kernels = getattr(getattr(backend, "_inference_fn", None), "keywords", {})
        dtypes = {getattr(kernels.get(name), "keywords", {}).get("dtype_state") for name in ("mlstm_sequence_kernel", "mlstm_step_kernel")}
        return backend.chunkwise_kernel_fn is getattr(modeling, "mlstm_chunkwise_native_autograd", None) and dtypes == {torch.float32}

    def dims(self) -> dict[str, int]:
        config = self._module.config
        heads = config.num_heads
        value_dim = self._module.v_dim // heads
        return {"mixer_heads": heads, "key_dim": self._module.qk_dim // heads, "value_dim": value_dim, "state_columns": value_dim + 2}

    def _prompt_state_shape(self, call: Call) -> tuple:
        k, v = call.serve("k"), call.serve("v")
        return (k.shape[0], k.shape[2], k.shape[3], v.shape[3] + 2)

    # -- the kernel's arguments --------------------------------------------------------

    attention_queries = kernel_argument("q", "the kernel's queries q (unscaled), [batch, seq, mixer_heads, key_dim]", Keys)
    attention_keys = kernel_argument("k", "the kernel's keys k, [batch, seq, mixer_heads, key_dim]", Keys)
    attention_values = kernel_argument("v", "the kernel's values v, [batch, seq, mixer_heads, value_dim]", Values)
    input_gates = kernel_argument("igate", "the input gate's pre-activation ĩ (exponential gate exp(ĩ)), [batch, seq, mixer_heads]", Gates)
    forget_gates = kernel_argument("fgate", "the forget gate's pre-activation f̃ (gate sigmoid(f̃)), [batch, seq, mixer_heads]", Gates)

    def _decays(self) -> torch.Tensor:
        forget = self.record().serve("fgate")
        decays = F.logsigmoid(forget.float())
        if recording(decays) and kernel_waiting(self):
            # Under autograd the kernel's forget gates are read through the served log decays (logit(exp(d)) = f̃),
            # with their own values, so decays.grad is the loss's derivative by them.
            self.record().assign("fgate", graft(decays, decays - torch.log(-torch.expm1(decays)), forget))
        return decays

    decays = DerivedEProperty(
        _decays,
        description="the log forget gate log sigmoid(f̃) <= 0, [batch, seq, mixer_heads], float32 (write forget_gates)",
        unavailable=needs_torch_kernels,
        annotation=Gates,
    )

    # -- the state entering and leaving the call, packed -----------------------------------

    def _read_state_input(self) -> torch.Tensor | None:
        state = self.record().serve("state")  # packed once per call, before the cache's buffers are overwritten
        return None if state is None or not bool(state.any()) else state.clone()  # a copy, the record's stays as served

    def _write_state_input(self, value: Any) -> None:
        call = self.record()
        call.check_not_started("a write to `linear_attn.state_input`")
        check_expected("`linear_attn.state_input`", value, *call.expected)
        self.record().assign("state", value)

    def _cached(self, what: str) -> None:
        """Raise unless the call runs with a cache: only then does its final state carry on (as on every mixer)."""
        if self.record().serve("state") is None:  # xLSTM passes no state exactly when it has no cache
            raise Unavailable(f"linear_attn.{what}", _NO_CACHE)

    def _read_output_state(self) -> torch.Tensor:
        self._cached("state_output")
        return pack(*self.record().op.output[1])

    def _write_output_state(self, value: Any) -> None:
        self._cached("state_output")
        call = self.record()
        output = call.op.output
        check_expected("`linear_attn.state_output`", value, *call.expected)
        call.op.output = replace_in(output, 1, unpack(value))

    state_input = DerivedEProperty(
        _read_state_input,
        assign=_write_state_input,
        key=kernel("inputs"),
        description="the packed state (C, n, m) entering this call, [batch, mixer_heads, key_dim, value_dim + 2], a copy "
        "(None when zero: a fresh prompt); assign it to continue from another",
        unavailable=needs_torch_kernels,
        annotation=PackedState,
        none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        _read_output_state,
        assign=_write_output_state,
        key=kernel("output"),
        description="the packed state (C, n, m) after this call's last token, [batch, mixer_heads, key_dim, value_dim + 2]",
        unavailable=needs_torch_kernels,
        annotation=PackedState,
    )

    # -- the state after every token: `FromArguments`, its own strategy (`STATES_FROM_ARGUMENTS`) -----------

    states = DerivedEProperty(
        every_state,
        description="the packed state (C, n, m) after every token of this call, [batch, seq, mixer_heads, key_dim, "
        "value_dim + 2], computed from the kernel call's arguments",
        unavailable=needs_torch_kernels,
        annotation=PackedStates,
    )
    state = DerivedEProperty(
        lambda envoy: None,
        description="the state after a token under tracer.iter: unavailable on the mLSTM (use state_after(t))",
        unavailable=lambda envoy: _NO_ITERATION,
        annotation=PackedState,
    )

    def kernel_function(self) -> Any:
        """The call source, a method call: the backend module's own forward (`FromArguments` runs it on each part of
        a split call, and on the tokens up to ``t`` for ``state_after(t)``), in inference mode only."""
        backend = self._module.mlstm_backend
        if "inference" not in backend.config.mode:
            raise Unavailable(
                "linear_attn.state_after / set_state_after",
                f"they run the backend on part of the call, which config.mode={backend.config.mode!r} runs through the "
                "chunkwise kernel alone (whole chunks only, no final state); use mode='inference' (the default)"
            )
        # The class's forward, not the module's __call__: the model is mid-run, hooked by nnsight.
        return type(backend).forward.__get__(backend)
