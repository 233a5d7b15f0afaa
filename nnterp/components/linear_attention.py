"""LinearAttention: the gated DeltaNet (Yang et al., 2024, arXiv:2412.06464).

Mental model: per value head, a state matrix ``S`` of ``[key_dim, value_dim]``
replaces the attention pattern. Each token decays it and writes a correction:

    S_t = α_t S_{t-1}                      (α_t = exp(g_t), the decay)
    S_t = S_t + k_t ⊗ β_t (v_t − S_tᵀ k_t)   (the delta rule, write strength β_t)
    o_t = S_tᵀ q_t                          (q, k l2-normalized; q scaled by key_dim^-½)

Values, in the order the forward makes them (all ``[batch, seq, ...]``;
``seq`` is this call's tokens, one on a decode step):

* ``attention_queries`` ``[batch, seq, key_heads, key_dim]``, ``attention_keys``
  (same), ``attention_values`` ``[batch, seq, mixer_heads, value_dim]``: the
  kernel's q, k, v, after the short convolution, before l2-norm. Up to
  transformers 5.22 q and k arrive already repeated to ``mixer_heads``.
* ``betas`` ``[batch, seq, mixer_heads]``: β, the write strength in (0, 1).
* ``decays`` ``[batch, seq, mixer_heads]``: g, the *log* decay (≤ 0) exactly
  as the kernel takes it; the state is multiplied by ``decays.exp()``.
* ``state_input`` ``[batch, mixer_heads, key_dim, value_dim]``: the state
  entering the call (``None`` on a fresh prompt), a copy; assign it and the
  call continues from the assigned state.
* ``state_output``: the state after the call's last token (what the next
  decode step starts from); writable.
* ``state`` / ``states`` / ``state_after`` / ``set_state_after``: the state
  after every token (`RecurrentMixer`), ``[batch, seq, mixer_heads, key_dim,
  value_dim]`` for ``states``.
* ``conv_state_input`` / ``conv_state_output`` ``[batch, conv_channels,
  conv_width]``: the short convolution's window of pre-convolution q, k, v
  channels entering / leaving the call, which the block also carries forward.
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output.

Every value but ``attention_output`` and the conv windows is read inside the
kernel call, so needs transformers' pure-torch kernels
(`needs_torch_kernels`): with flash-linear-attention installed, they say so.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as _reference
from nnsight.intervention.source import compiled

from ..core.dims import ConvState, Gates, Queries, State, Values
from ..core.errors import NnterpError
from ..core.values import DerivedEProperty, EProperty, check_expected, check_tensor
from .conv import conv_state_input, conv_state_output
from . import kernels
from ..core.calls import pinned
from .recurrent import RecurrentMixer, needs_torch_kernels
from ..fast.mixin import FastStates
from ..fast.specs import GATED_DELTA


def _clone(envoy: Any, state: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # The cache overwrites the entering state's buffer in place during the call.
    return state.clone() if state is not None else None


def _argument(select: Any, description: str, annotation: Any) -> EProperty:
    return EProperty(
        RecurrentMixer.kernel("inputs"),
        select=select,
        description=description,
        unavailable=needs_torch_kernels,
        validate=lambda envoy, new, current: check_tensor(f"`linear_attn.{select}`", new, current),
        annotation=annotation,
    )


def _repeats_first_argument(forward: Any, function: str) -> bool:
    """Whether ``forward`` rebinds the variable it passes ``function`` first to a ``.repeat_interleave(...)`` of it."""
    import ast

    from nnsight.intervention.source import decorator_chain

    tree = ast.parse(compiled(decorator_chain(forward)[0]).source)
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function and node.args
    ]
    names = {call.args[0].id for call in calls if isinstance(call.args[0], ast.Name)}
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id in names for target in node.targets)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "repeat_interleave"
        for node in ast.walk(tree)
    )


def _validate_state_input(envoy: "LinearAttention", new: Any, current: Any) -> None:
    args, kwargs = envoy._kernel_arguments()
    shape = envoy._state_shape(args, kwargs)
    check_expected("`linear_attn.state_input`", new, shape, torch.float32, args[0].device)


class LinearAttention(FastStates, RecurrentMixer):
    """A gated DeltaNet block (``layer.linear_attn``): see the module docstring for its values."""

    #: The fast path (`nnterp.fast.fast_states`): states and writes from the kernel call's own arguments.
    FAST = GATED_DELTA
    CHUNK_FUNCTION = "torch_chunk_gated_delta_rule"
    RECURRENT_FUNCTION = "torch_recurrent_gated_delta_rule"
    STATE_VARIABLE = "last_recurrent_state"
    #: Inside the token loop: the variable holding a token's decay factor, and
    #: the binding of the state after the decay, before the token's write.
    DECAY_VARIABLE = "decay_t"
    DECAY_OP: str = ""
    PRE_STATE_OP: str = ""
    #: The kernel keyword carrying the entering state.
    INITIAL_STATE = "initial_state"
    #: Whether this release's forward repeats q and k to the value heads before the kernel (up to 5.22; found by `resolve`).
    EXPANDS_KEYS = False
    #: Whether query/key heads may be fewer than value heads (grouped), so one of the forward and the kernel repeats them.
    GROUPED_HEADS = True

    attention_queries = _argument(0, "the kernel's queries q, [batch, seq, key_heads, key_dim]", Queries)
    attention_keys = _argument(1, "the kernel's keys k, [batch, seq, key_heads, key_dim]", Queries)
    attention_values = _argument(2, "the kernel's values v, [batch, seq, mixer_heads, value_dim]", Values)
    betas = _argument("beta", "the write strength β in (0, 1), [batch, seq, mixer_heads]", Gates)
    decays = _argument("g", "the log decay g ≤ 0 (the state is multiplied by exp(g)), [batch, seq, mixer_heads]", Gates)
    state_input = EProperty(
        RecurrentMixer.kernel("inputs"),
        select=INITIAL_STATE,
        preprocess=_clone,
        description="the state entering this call (None on a fresh prompt), a copy; assign to continue from another",
        unavailable=needs_torch_kernels,
        validate=_validate_state_input,
        annotation=State,
    )
    state_output = EProperty(
        RecurrentMixer.kernel("output"),
        select=1,
        description="the state after this call's last token, [batch, mixer_heads, key_dim, value_dim]",
        unavailable=needs_torch_kernels,
        validate=lambda envoy, new, current: check_tensor("`linear_attn.state_output`", new, current),
        annotation=State,
    )
    conv_state_input = conv_state_input()
    conv_state_output = conv_state_output()

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "key_heads": module.num_v_heads if type(self).EXPANDS_KEYS else module.num_k_heads,
            "mixer_heads": module.num_v_heads,
            "key_dim": module.head_k_dim,
            "value_dim": module.head_v_dim,
            "conv_channels": module.conv_dim,
            "conv_width": module.conv_kernel_size,
        }

    def _kernel_arguments(self) -> tuple:
        """This call's kernel ``(args, kwargs)``."""
        return getattr(self.source, type(self).KERNEL(self)).inputs

    @classmethod
    def resolve(cls, hf_mixer: type) -> None:
        super().resolve(hf_mixer)
        loop = cls.loop_function(kernels.modeling_of(hf_mixer))
        cls.DECAY_OP = kernels.state_label(loop, cls.DECAY_VARIABLE, in_loop=True)
        cls.PRE_STATE_OP = kernels.bindings(loop, cls.STATE_VARIABLE, in_loop=True)[-2]
        cls.EXPANDS_KEYS = _repeats_first_argument(hf_mixer.forward, cls.CHUNK_FUNCTION)
        if cls.GROUPED_HEADS:
            stash = kernels.modeling_of(hf_mixer).__dict__.get("_nnterp_kernels", {})
            chunk = kernels.torch_function(stash.get(cls.CHUNK_FUNCTION, getattr(kernels.modeling_of(hf_mixer), cls.CHUNK_FUNCTION)))
            if cls.EXPANDS_KEYS == ("repeat_interleave" in compiled(chunk).source):
                raise NnterpError(kernels._missing(
                    "where the query/key heads are repeated to the value heads (the mixer's forward up to 5.22, the "
                    f"kernel from 5.23), which sets `linear_attn.attention_queries`' key_heads; {cls.CHUNK_FUNCTION}",
                    hf_mixer.forward,
                ))

    def _continue_from(self, record: Any, position: int, value: torch.Tensor, what: str) -> None:
        # Token t+1 starts with S_t · α_{t+1} (the decay, before its write): put
        # value there, so token t's own readout keeps the state it computed.
        cls = type(self)
        decay_op, pre = getattr(record.source, cls.DECAY_OP), getattr(record.source, cls.PRE_STATE_OP)
        occurrence = record.first + position + 1
        self._visit(record, position + 1, what, op=decay_op)
        with pinned(occurrence):
            decay = decay_op.output
        with pinned(occurrence):
            pre.output = value * decay

    def _state_shape(self, args: tuple, kwargs: dict) -> tuple:
        key, value = args[1], args[2]
        return (value.shape[0], value.shape[2], key.shape[3], value.shape[3])


LinearAttention.resolve(_reference.Qwen3_5GatedDeltaNet)
