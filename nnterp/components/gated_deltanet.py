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
* ``effective_attention`` ``[batch, mixer_heads, seq, seq]``: the exact
  coefficients ``A[t, s]`` with which the kernel's output at ``t`` is a sum
  over ``attention_values`` at ``s``, plus ``state_input_readout`` ``[batch,
  seq, mixer_heads, value_dim]`` (the entering state's part, ``None`` on a
  fresh prompt); ``effective_attention_of(positions=, heads=)`` for some rows
  and heads (`nnterp.fast.gated_deltanet`).
* ``attention_output`` ``[batch, seq, hidden]``: the mixer's output.

Every value but ``attention_output`` and the conv windows is read at the
kernel call, whatever kernel is bound (flash-linear-attention's included);
only the per-token states are read inside the kernel, and with
flash-linear-attention bound they say so (`needs_torch_kernels`).
The kernel's arguments are named ``q``, ``k``, ``v``, ``g``, ``beta``,
``state`` in its signature table (``argument(name)``, the fast path).
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.source import compiled

from ..core.calls import pinned
from ..core.dims import Gates, Queries, State, Values
from ..core.errors import UnsupportedRelease
from ..fast.gated_deltanet import GATED_EFFECTIVE as GATED_DELTA_ATTENTION
from ..fast.gated_deltanet import GATED_FAST as GATED_DELTA
from ..recurrent.arguments import SAME
from ..recurrent.call import Call
from ..recurrent.kernels import modeling_of, original_body
from ..recurrent.labels import Label, bindings, missing, repeats_first_argument, state_label
from .conv import conv_state_input, conv_state_output
from .recurrent import RecurrentMixer, kernel_argument

#: The gated delta rule's call, prompt and decode step alike:
#: ``kernel(query, key, value, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=)``.
DELTA_RULE_ARGUMENTS = {
    "q": (0, SAME),
    "k": (1, SAME),
    "v": (2, SAME),
    "g": ("g", SAME),
    "beta": ("beta", SAME),
    "state": ("initial_state", SAME),
    "final": ("output_final_state", SAME),
    "l2norm": ("use_qk_l2norm_in_kernel", SAME),
}


class LinearAttention(RecurrentMixer):
    """A gated DeltaNet block (``layer.linear_attn``): see the module docstring for its values."""

    REFERENCE = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet"
    FAST = GATED_DELTA
    SKIP = {"betas": 0.0, "decays": 0.0}  # no write, no decay: S_s = S_{s-1}
    EFFECTIVE = GATED_DELTA_ATTENTION
    CHUNK_FUNCTION = "torch_chunk_gated_delta_rule"
    RECURRENT_FUNCTION = "torch_recurrent_gated_delta_rule"
    STATE_VARIABLE = "last_recurrent_state"
    CHUNK_ARGUMENTS = DELTA_RULE_ARGUMENTS
    RECURRENT_ARGUMENTS = DELTA_RULE_ARGUMENTS
    #: Inside the token loop, the variable holding a token's decay factor.
    DECAY_VARIABLE = "decay_t"
    #: OLMo-Hybrid's mixer asks the cache without its layer index up to 5.20; the test is read from the source.
    CACHE_TEST_REQUIRED = True
    #: Whether query/key heads may be fewer than value heads (grouped), so one of the forward and the kernel repeats them.
    GROUPED_HEADS = True

    #: Inside the token loop: a token's decay factor, and the state after the decay, before the token's write.
    DECAY_OP = Label()
    PRE_STATE_OP = Label()
    #: Whether this release's forward repeats q and k to the value heads before the kernel (up to 5.22).
    EXPANDS_KEYS = Label()

    attention_queries = kernel_argument("q", "the kernel's queries q, [batch, seq, key_heads, key_dim]", Queries)
    attention_keys = kernel_argument("k", "the kernel's keys k, [batch, seq, key_heads, key_dim]", Queries)
    attention_values = kernel_argument("v", "the kernel's values v, [batch, seq, mixer_heads, value_dim]", Values)
    betas = kernel_argument("beta", "the write strength β in (0, 1), [batch, seq, mixer_heads]", Gates)
    decays = kernel_argument("g", "the log decay g ≤ 0 (the state is multiplied by exp(g)), [batch, seq, mixer_heads]", Gates)
    state_output = RecurrentMixer.state_output.variant(
        "the state after this call's last token, [batch, mixer_heads, key_dim, value_dim]", State
    )
    conv_state_input = conv_state_input()
    conv_state_output = conv_state_output()

    @classmethod
    def find_labels(cls, hf_mixer: type) -> dict:
        labels = super(LinearAttention, cls).find_labels(hf_mixer)
        modeling = modeling_of(hf_mixer)
        loop = cls.loop_body(modeling)
        labels["DECAY_OP"] = state_label(loop, cls.DECAY_VARIABLE, in_loop=True)
        labels["PRE_STATE_OP"] = bindings(loop, cls.STATE_VARIABLE, in_loop=True)[-2]
        labels["EXPANDS_KEYS"] = expands = repeats_first_argument(hf_mixer.forward, cls.CHUNK_FUNCTION)
        if cls.GROUPED_HEADS and expands == ("repeat_interleave" in compiled(original_body(modeling, cls.CHUNK_FUNCTION)).source):
            raise UnsupportedRelease(missing(
                "where the query/key heads are repeated to the value heads (the mixer's forward up to 5.22, the "
                f"kernel from 5.23), which sets `linear_attn.attention_queries`' key_heads; {cls.CHUNK_FUNCTION}",
                hf_mixer.forward,
            ))
        return labels

    def dims(self) -> dict[str, int]:
        module = self._module
        return {
            "key_heads": module.num_v_heads if self.EXPANDS_KEYS else module.num_k_heads,
            "mixer_heads": module.num_v_heads,
            "key_dim": module.head_k_dim,
            "value_dim": module.head_v_dim,
            "conv_channels": module.conv_dim,
            "conv_width": module.conv_kernel_size,
        }

    def _prompt_state_shape(self, call: Call) -> tuple:
        key, value = call.serve("k"), call.serve("v")
        return (value.shape[0], value.shape[2], key.shape[3], value.shape[3])

    def continue_op(self, call: Call) -> Any:
        return getattr(call.strategy["source"], self.DECAY_OP)

    def continue_from(self, call: Call, position: int, value: torch.Tensor) -> None:
        # Token t+1 starts with S_t · α_{t+1} (the decay, before its write): put
        # value there, so token t's own readout keeps the state it computed.
        decay_op, pre = self.continue_op(call), getattr(call.strategy["source"], self.PRE_STATE_OP)
        occurrence = call.strategy["first"] + position + 1
        with pinned(occurrence):
            decay = decay_op.output
        with pinned(occurrence):
            pre.output = value * decay
