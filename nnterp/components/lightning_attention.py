"""LightningAttention: MiniMax's lightning attention (MiniMax-01, arXiv:2501.08313; Qin et al., arXiv:2401.04658).

Mental model: linear attention with a fixed decay per head. Per head ``h``, a
state matrix ``S`` of ``[key_dim, value_dim]`` (``key_dim == value_dim ==
head_dim`` here) is multiplied by ``exp(-λ_h)`` every token and adds the
token's ``kᵀv``; the output reads it with the query:

    q, k, v = silu(qkv_proj(x)) split per head
    S_t = exp(-λ_h) S_{t-1} + k_tᵀ v_t       (λ_h: HF's ``slope_rate``, fixed per head and layer)
    o_t = q_t S_t
    out = out_proj(sigmoid(output_gate(x)) * norm(o))

transformers computes it in the mixer's own forward, with no kernel function:
a prompt runs a loop over blocks of ``config.block_size`` tokens (the state
exists only at block ends), a call that continues a cache (a decode step)
loops over its tokens. So this `RecurrentMixer` has no kernel call: its
record (`nnterp.recurrent.forward_call.ForwardCall`) is built from the
forward's own operations (found in the installed release's source by name:
`find_labels`), and the state after every token is served by
`FromArguments` from its fast path ``FAST`` (`nnterp.fast.lightning_attention`),
computed from the call's own ``q``, ``k``, ``v`` and decay (on a call that
continues a cache with the same operations as the decode branch), whatever
the model's setting. Where a prompt's states are read before its block loop,
without autograd, in float32 and on one invoke, the loop's products are
skipped and the outputs computed with the states (its one pass, switched by
`from_arguments.one_pass`).

Values, in the order the forward makes them (``seq`` is this call's tokens):

* ``attention_queries`` / ``attention_keys`` ``[batch, seq, key_heads,
  key_dim]``, ``attention_values`` ``[batch, seq, mixer_heads, value_dim]``:
  q, k, v after the silu (and the padding mask); a write replaces them before
  the forward uses them (``key_heads == mixer_heads``).
* ``decays`` ``[batch, seq, mixer_heads]``: the log decay ``g = -λ_h`` of every
  token (the same for every token and row); a write makes the call's output
  and final state the recurrence's with the written decays, computed here
  from the call's q, k, v (the forward's own loop runs with its buffers, and
  its result is replaced).
* ``state_input`` ``[batch, mixer_heads, key_dim, value_dim]``: the state
  entering the call (the cache's, ``None`` on a fresh prompt), a copy; a write
  replaces what the forward reads from the cache (on a prompt with a cache the
  forward then takes its token loop, which continues from it).
* ``states`` ``[batch, seq, mixer_heads, key_dim, value_dim]``, ``state_after(t)``,
  ``set_state_after(t, value)``: computed from the call's q, k, v, decays and
  entering state (the last one is the forward's own final state, so
  ``states[:, -1]`` is ``state_output`` bit for bit). A write replaces the outputs of the tokens after ``t`` by the
  recurrence continued from ``value`` (token ``t``'s own output is left as the
  forward computed it) and makes ``value``'s continuation the call's final
  state (written into the forward's own final-state tensor, which the cache holds).
* ``effective_attention`` ``[batch, mixer_heads, seq, seq]`` and
  ``state_input_readout`` ``[batch, seq, mixer_heads, value_dim]``: ``o_t =
  Σ_s A[t, s] v_s + readout_t`` exactly, before the norm and the gate.
* ``state_output``: the state after the call's last token (the forward's
  return, which the cache holds); a write replaces both.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output;
  ``kernel_output()`` ``[batch, seq, mixer_heads, value_dim]``, its output
  before the norm and the gate (where the forward concatenates it).

Under autograd (a trace outside ``torch.no_grad()``), ``states`` is a tap and
``decays`` a graft, as on the other mixers (`nnterp.recurrent.gradients`): an
exact zero that depends on them is added to the output before the norm, so
``states.grad[:, t]`` is the loss's derivative by the state after ``t`` as the
tokens after ``t`` read it, and ``decays.grad`` the derivative by the decays;
q, k, v are the forward's own tensors. Values and logits are unchanged bit for
bit. Reading ``states`` or ``decays`` then moves the worker to that point of the
forward, so writes to the call come before them.

``state`` (under ``tracer.iter``), ``betas`` and the convolution windows are
`Unavailable`, each with its reason. A state is computed in the model's
dtype, as transformers keeps it; ``state_input`` / ``state_output`` are in it,
and the per-token states are stored float32, as every fast path's
(`FromArguments`; ``fast_states(model, dtype=...)`` stores another).

Failure mode worth knowing: a worker reads in the order the model runs. The
call's q, k, v are read where the forward splits them, so a write to them,
to ``decays``, ``state_input`` or ``set_state_after`` comes before
``state_output`` / ``attention_output`` of the same call; ``OrderError`` says
which read came first.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from nnsight.intervention.source import compiled, decorator_chain

from ..core import indices
from ..core.calls import mediator, per_call, pinned
from ..core.dims import ConvState, Gates, Hidden, Queries, State, States, Values
from ..core.errors import NnterpError, SignatureError, UnsupportedRelease
from ..core.values import DerivedEProperty, check_expected, module_output
from ..fast.lightning_attention import FAST as LIGHTNING
from ..fast.lightning_attention import lightning_attention, lightning_run, lightning_scan
from ..recurrent import per_token
from ..recurrent.forward_call import PRODUCTS, ForwardCall
from ..recurrent.gradients import recording
from ..recurrent.kernels import signature
from ..recurrent.labels import Label, bindings, call_label, missing
from .recurrent import EffectiveAttention, RecurrentMixer

NO_ITERATION = (
    "lightning attention's prompt computes its state once per block of config.block_size tokens (no location "
    "binds it once per token for tracer.iter): read states / state_after(t) and write set_state_after(t, value), "
    "computed from the call's q, k, v and decay; on a decode step, state_output is the state after its token"
)
NO_BETA = "lightning attention has no write strength β: each token adds k_tᵀ v_t to the state unscaled"
NO_CONV = "lightning attention has no short convolution, so no convolution window"


def cache_parameter(forward: Any) -> str:
    """The forward's parameter whose ``get_linear_cache`` it calls (``cache`` from 5.24, ``past_key_values`` before)."""
    names = compiled(forward).names
    for name in signature(forward).parameters:
        pattern = re.compile(rf"^{re.escape(name)}_get_linear_cache_\d+$")
        if any(pattern.match(label) for label in names):
            return name
    raise UnsupportedRelease(missing("a call of `get_linear_cache` on one of its parameters (the cache)", forward))


def find_products(forward: Any) -> dict | None:
    """``{variable: label}`` of the ``torch.matmul`` call each of the block loop's `PRODUCTS` binds, or ``None``."""
    info = compiled(forward)
    found = {}
    for variable in PRODUCTS:
        try:
            line = info.lines[bindings(forward, variable, in_loop=True)[0]]
        except NnterpError:
            return None
        products = [name for name in info.names if name.startswith("torch_matmul_") and info.lines[name] == line]
        if len(products) != 1:
            return None
        found[variable] = products[0]
    return found


class LightningAttention(RecurrentMixer):
    """A lightning attention block (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention"
    #: No kernel function to route (`RecurrentMixer`'s ``CHUNK_FUNCTION`` stays empty), no convolution.
    CONV_FUNCTIONS: tuple = ()
    #: The forward returns its final state with or without a cache, so `state_output` is served without one.
    FINAL_STATE_WITHOUT_CACHE = True
    #: Its fast path: `FromArguments` serves its states from the call's q, k, v and decays (`run_kernel` its split).
    FAST = LIGHTNING
    #: Its states are always computed from the call's own q, k, v and decays (`FromArguments`, its own strategy too:
    #: `per_token.default_strategy`), so a read after the forward has run (state_output first) is still served.
    STATES_FROM_ARGUMENTS = True
    SKIP = {"attention_values": 0.0, "decays": 0.0}  # S_s = exp(0) S_{s-1} + k_s 0ᵀ (v where the forward splits it, first)
    #: Values no gradient of the model's outputs reaches (`gradient_support`), beyond the shared ones.
    GRADIENTLESS = {
        "state_output": (
            "a prompt's final state goes only to the cache (the block loop computed the outputs before it), so no "
            "gradient of this call's outputs reaches it: states.grad[:, t] is the derivative by the state after t"
        ),
    }
    #: The forward's operations the record reads (`ForwardCall`), found by `find_labels`.
    FORWARD_OPS = Label()

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        """The forward's operations this component reads, found in the installed release's source.

        ``FORWARD_OPS``: the split into q, k, v, the cache read, the outputs'
        concatenation, the state's bindings in the block loop and in the token
        loop, and the block loop's products (``None`` when not found: the one
        pass then does not apply). No kernel call, so the kernel labels are ``None``.
        """
        forward = decorator_chain(hf_mixer.forward)[0]
        loops = bindings(forward, "attn_weights_inter", in_loop=True)
        if len(loops) < 2:
            raise UnsupportedRelease(missing("the state's bindings in the block loop and in the token loop", forward))
        ops = {
            "split": call_label(forward, "torch_split"),
            "get": call_label(forward, f"{cache_parameter(forward)}_get_linear_cache"),
            "cat": call_label(forward, "torch_cat"),
            "block_state": loops[0],
            "token_state": loops[-1],
            "products": find_products(forward),
        }
        kernels = dict.fromkeys(("CHUNK_KERNEL", "RECURRENT_KERNEL", "CACHE_TEST", "STATE_OP", "STEP_STATE_OP"))
        return {**kernels, "FORWARD_OPS": ops}

    def dims(self) -> dict[str, int]:
        module = self._module
        heads, dim = module.num_attention_heads, module.head_dim
        return {"key_heads": heads, "mixer_heads": heads, "key_dim": dim, "value_dim": dim}

    # -- the call's record: the forward's own operations ---------------------------------------

    def record(self) -> ForwardCall:
        """This call's `ForwardCall`: read once per call, at the mixer's input and where the forward splits q, k, v."""
        return per_call(self, "call", lambda: ForwardCall.at_entry(self, self.FORWARD_OPS))

    def continues_cache(self, cache: Any) -> bool:
        """Whether the cache holds a state for this layer (the forward then takes its token loop)."""
        return cache is not None and cache.get_linear_cache(self._module.layer_idx) is not None

    def decays_of(self, call: ForwardCall) -> torch.Tensor:
        """The call's log decays ``g = -λ_h``, ``[batch, seq, mixer_heads]``, in the dtype of its q."""
        slope = self._module.slope_rate.reshape(1, 1, -1).to(call.q.dtype)
        return (-slope).expand(call.q.shape[0], call.seq, -1)

    def _prompt_state_shape(self, call: ForwardCall) -> tuple:
        dims = self.dims()
        return (call.q.shape[0], dims["mixer_heads"], dims["key_dim"], dims["value_dim"])

    # -- the state entering and leaving the call (the record's) -----------------------------

    def _state_input(self) -> torch.Tensor | None:
        return self.record().state_input()

    def _assign_state_input(self, value: Any) -> None:
        self.record().assign_state_input(value)

    # -- the hooks `FromArguments` calls: the forward's recurrence on a part of the call, and its one pass ----------

    def run_kernel(self, call: ForwardCall, lo: int, hi: int, initial: Any) -> tuple:
        """The forward's own return on tokens ``[lo, hi)`` of the call from ``initial`` (`lightning_run`): ``(outputs
        [batch, heads, hi - lo, value_dim], final state)``."""
        return lightning_run(call.q[:, lo:hi], call.k[:, lo:hi], call.v[:, lo:hi], call.g[:, lo:hi], initial)

    def pure_torch_kernel(self) -> bool:
        """Whether the one pass can replace the block loop: its products found, and its decay buffers what
        ``slope_rate`` gives them to float32 rounding (a model loaded in bfloat16 then cast to float32 keeps them
        rounded apart: the one pass, which reads ``slope_rate``, would then differ from the loop by more than rounding)."""
        module = self._module
        if self.FORWARD_OPS["products"] is None:
            return False
        buffers = [getattr(module, name, None) for name in ("query_decay", "key_decay", "diagonal_decay")]
        if getattr(module, "decay_factors", None) is None or any(buffer is None for buffer in buffers):
            return False
        with torch.no_grad():
            expected = module.decay_factors(module.slope_rate.float())
            return all(b.shape == e.shape and torch.allclose(b.float(), e, rtol=1e-5, atol=0) for b, e in zip(buffers, expected))

    def _decays(self) -> torch.Tensor:
        """The call's log decays; under autograd a leaf the outputs before the norm read through an exact zero."""
        call = self.record()
        if call.g_leaf is not None:
            return call.g_leaf
        if not recording(call.q) or call.changed or call.passed("cat", call.first["cat"]):
            return call.g
        # Under autograd the forward never reads the decays (it reads its buffers): the call's output before the
        # norm gets an exact zero that depends on them (the recurrence with them, minus itself detached).
        leaf = call.g.detach().clone().requires_grad_(True)
        q, k, v = (x.detach() for x in (call.q, call.k, call.v))
        initial = call.initial.detach() if call.initial is not None else None
        rebuilt = lightning_scan(q, k, v, leaf, initial)[0].transpose(1, 2)
        call.graft(rebuilt - rebuilt.detach())
        call.g_leaf = leaf
        return leaf

    def _assign_decays(self, value: Any) -> None:
        """Make the call's outputs and final state the recurrence's with decays ``value`` (`FromArguments.assign_argument`)."""
        call = self.record()
        check_expected("`linear_attn.decays`", value, tuple(call.g.shape), call.g.dtype, call.g.device)
        if torch.equal(value, call.g):
            return  # the forward's own decays: its own loop already computes the call with them
        per_token.FROM_ARGUMENTS.assign_argument(self, "g", value)

    # -- effective attention -------------------------------------------------------

    def _effective(self, positions: Any = None, selection: Any = None, coefficients: bool = True) -> tuple:
        """``(A, readout)`` of the whole call, from its q, k, decays and entering state (`lightning_attention`)."""
        call = self.record()
        call.check_own("`linear_attn.effective_attention`")
        return lightning_attention(call.q, call.k, call.g, call.initial)

    def effective_inputs(self) -> dict:
        """What `_effective` reads: the call's q, k, decays and entering state."""
        call = self.record()
        return {"q": call.q, "k": call.k, "g": call.g, "initial": call.initial}

    def replay_arguments(self) -> dict:
        """What a factorized store keeps of this call (`nnterp.recurrent.replay`): its q, k, v, decays, entering state."""
        call = self.record()
        return {"q": call.q, "k": call.k, "v": call.v, "g": call.g, "state": call.initial}

    def kernel_output(self) -> torch.Tensor:
        """The call's output before the norm and the gate, ``[batch, seq, mixer_heads, value_dim]``, read where the
        forward concatenates it: what ``Σ_s effective_attention[t, s] attention_values[s]`` (+ the readout) reproduces."""
        mediator("`linear_attn.kernel_output`")
        call = self.record()
        with pinned(call.first["cat"]):
            return call.operation("cat").output.transpose(1, 2)

    def write_kernel_output(self, value: torch.Tensor) -> None:
        """Make ``value`` (as `kernel_output` serves it) the output the norm and the gate read."""
        self.record().replace_outputs(value.transpose(1, 2))

    def effective_attention_of(self, positions: Any = None, heads: Any = None, channels: Any = None) -> torch.Tensor:
        """Rows ``positions`` of `effective_attention`, for some ``heads`` only: ``[batch, len(heads), len(positions), seq]``.

        ``positions``, ``heads``: ``None`` (all), an int, a slice, a range, a
        list or a tensor of indices (negative ones count from the end),
        checked as ``states_of`` checks its positions (`nnterp.core.indices`).
        Computed whole, then selected (``4 · batch · heads · seq²`` bytes).
        """
        mediator("`linear_attn.effective_attention_of`")
        if channels is not None:
            raise SignatureError("`linear_attn.effective_attention_of`: lightning attention has one pattern per head: pass heads=, not channels=")
        what = "linear_attn.effective_attention_of"
        A = self._effective()[0]
        picked = indices.selection(heads, A.shape[1], what, "head", f"the mixer's {A.shape[1]} heads")
        rows = indices.selection(positions, A.shape[2], what, "position")
        return A[:, slice(None) if picked is None else picked][:, :, slice(None) if rows is None else rows]

    # -- values ----------------------------------------------------------------------

    attention_queries = DerivedEProperty(
        lambda envoy: envoy.record().q, assign=lambda envoy, value: envoy.record().write_qkv(0, value),
        description="the queries q after the silu, [batch, seq, key_heads, key_dim]", annotation=Queries,
    )
    attention_keys = DerivedEProperty(
        lambda envoy: envoy.record().k, assign=lambda envoy, value: envoy.record().write_qkv(1, value),
        description="the keys k after the silu, [batch, seq, key_heads, key_dim]", annotation=Queries,
    )
    attention_values = DerivedEProperty(
        lambda envoy: envoy.record().v, assign=lambda envoy, value: envoy.record().write_qkv(2, value),
        description="the values v after the silu, [batch, seq, mixer_heads, value_dim]", annotation=Values,
    )
    betas = DerivedEProperty(
        lambda envoy: None, description="a write strength β (none here)", unavailable=lambda envoy: NO_BETA, annotation=Gates,
    )
    decays = DerivedEProperty(
        _decays, assign=_assign_decays,
        description="the log decay g = -λ_h of every token (the state is multiplied by exp(g)), [batch, seq, mixer_heads]",
        annotation=Gates,
    )
    state_input = DerivedEProperty(
        _state_input, assign=_assign_state_input,
        description="the state entering this call (None on a fresh prompt), a copy; assign to continue from another",
        annotation=State, none_on_fresh_prompt=True,
    )
    state = DerivedEProperty(
        lambda envoy: None, assign=lambda envoy, value: None, description="the state after a token under tracer.iter",
        unavailable=lambda envoy: NO_ITERATION, annotation=State,
    )
    states = DerivedEProperty(
        per_token.every_state, description="the state after every token of this call, from its q, k, v and decays",
        unavailable=per_token.per_token_reason, annotation=States,
    )
    effective_attention = DerivedEProperty(
        lambda envoy: envoy._effective()[0],
        description=(
            "the exact effective attention A[t, s] = (q_t . k_s) exp(g (t - s)): the output at t before the norm is "
            "sum_s A[t, s] * attention_values[s] (+ state_input_readout), [batch, mixer_heads, seq, seq], float32"
        ),
        annotation=EffectiveAttention,
    )
    state_input_readout = DerivedEProperty(
        lambda envoy: envoy._effective()[1],
        description="the part of the output before the norm read from the entering state, [batch, seq, mixer_heads, value_dim]",
        annotation=Values, none_on_fresh_prompt=True,
    )
    state_output = DerivedEProperty(
        lambda envoy: envoy.record().state_output(), assign=lambda envoy, value: envoy.record().write_state_output(value),
        description="the state after this call's last token, [batch, mixer_heads, key_dim, value_dim]", annotation=State,
    )
    conv_state_input = DerivedEProperty(
        lambda envoy: None, description="a convolution window (none here)", unavailable=lambda envoy: NO_CONV, annotation=ConvState,
    )
    conv_state_output = DerivedEProperty(
        lambda envoy: None, description="a convolution window (none here)", unavailable=lambda envoy: NO_CONV, annotation=ConvState,
    )
    attention_output = module_output("the mixer's output, [batch, seq, hidden]", Hidden)
