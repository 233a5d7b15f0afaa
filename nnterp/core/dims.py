"""Dimension names: the one glossary every shape in nnterp is written in.

A shape in a docstring reads ``[batch, seq, heads, key_dim, value_dim]``; the
jaxtyping aliases below spell the same names, so an annotation and a docstring
never disagree.

* ``batch``: rows of the batch (one per invoke, left-padded to one length).
* ``seq``: the tokens of *this call* of the module: the whole prompt on a
  prompt, one token on a decode step of ``generate``.
* ``hidden``: the residual stream.
* ``vocab``: the unembedding's output.
* ``heads``: attention heads of an ``Attention`` block.
* ``mixer_heads``: the heads a recurrent mixer keeps one state per: a gated
  DeltaNet's *value* heads (a hybrid's mixer usually has more than its
  attention blocks), Mamba-2's heads. Mamba-1 keeps one state per channel.
* ``key_heads``: a gated DeltaNet's query/key heads, Mamba-2's groups of
  ``B`` / ``C`` (its keys / queries); each serves ``mixer_heads // key_heads``
  consecutive heads.
* ``key_dim`` / ``value_dim``: a DeltaNet state is ``[key_dim, value_dim]`` per
  head, key first: the readout is ``Sᵀq`` and the update writes ``k ⊗ δ``.
* ``channels``: Mamba-1's inner channels (``intermediate_size``).
* ``head_dim``: Mamba-2's channels per head (the state's first axis there).
* ``state_size``: the SSM state dimension ``N`` of Mamba-1 and Mamba-2.
* ``conv_channels`` / ``conv_width``: the short-convolution window a mixer
  carries forward beside its state (LFM2's gated short convolution: its only
  state, ``conv_channels`` = ``hidden``).
* ``experts``: the routed experts of a mixture-of-experts block (the
  router's logits are one per expert).
* ``lru_width``: the channels of RecurrentGemma's RG-LRU (``config.lru_width``);
  its state is one number per channel, ``[batch, lru_width]``.
* ``conv_window``: the inputs a module-held convolution window keeps,
  ``conv_width - 1`` (RecurrentGemma's ``conv1d_state``).
* ``wkv_parts``: RWKV-4's WKV state, 3 numbers per ``channels`` entry (its
  attention channels there): 0 the numerator ``a``, 1 the denominator ``b``,
  2 the running maximum ``p`` they are scaled by (the sums are ``a·eᵖ`` and
  ``b·eᵖ``). Its token shift is a ``conv_width`` 1 window.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

BATCH = "batch"
SEQ = "seq"
HIDDEN = "hidden"
VOCAB = "vocab"
HEADS = "heads"
MIXER_HEADS = "mixer_heads"
KEY_HEADS = "key_heads"
KEY_DIM = "key_dim"
VALUE_DIM = "value_dim"
CHANNELS = "channels"
HEAD_DIM = "head_dim"
STATE_SIZE = "state_size"
CONV_CHANNELS = "conv_channels"
CONV_WIDTH = "conv_width"
EXPERTS = "experts"
LRU_WIDTH = "lru_width"
CONV_WINDOW = "conv_window"
WKV_PARTS = "wkv_parts"

Hidden = Float[Tensor, f"{BATCH} {SEQ} {HIDDEN}"]
Logits = Float[Tensor, f"{BATCH} {SEQ} {VOCAB}"]
Probs = Float[Tensor, f"{BATCH} {VOCAB}"]
Queries = Float[Tensor, f"{BATCH} {SEQ} {KEY_HEADS} {KEY_DIM}"]
Values = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {VALUE_DIM}"]
Gates = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS}"]
State = Float[Tensor, f"{BATCH} {MIXER_HEADS} {KEY_DIM} {VALUE_DIM}"]
States = Float[Tensor, f"{BATCH} {SEQ} {MIXER_HEADS} {KEY_DIM} {VALUE_DIM}"]
ConvState = Float[Tensor, f"{BATCH} {CONV_CHANNELS} {CONV_WIDTH}"]
RouterLogits = Float[Tensor, f"{BATCH} {SEQ} {EXPERTS}"]
