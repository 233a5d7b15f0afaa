"""Value names: the one glossary every value a component serves is named from.

`nnterp.core.dims` names the axes of a shape; this module names the values
themselves. Every name a component declares (``type(component).values()``:
a layer's, an attention block's, an MLP's, every recurrent mixer's) has one
line in `VALUES`, and the contract test (tests/test_contract.py) fails on a
served name missing here or a name here that nothing serves. A new value
takes a name already here where it means the same kind of thing, or adds one.

The conventions the names keep:

* ``*_input`` / ``*_output``: what enters / leaves one call of the module;
  ``state_input`` is ``None`` on a fresh prompt.
* A value with one entry per token is tokens first (``[batch, seq, ...]``) and
  plural (``betas``, ``decays``, ``forget_gates``); a parameter of the module
  (``[channels]``) is singular or names what it holds (``bonus``,
  ``decay_rates``). ``dt`` keeps the spec's name.
* ``attention_queries`` / ``attention_keys`` / ``attention_values``: a
  recurrent mixer read as linear attention: the keys say where each token
  writes the state, the values what it writes, the queries how it reads it
  back, whatever the kind calls them (Mamba's ``C``, ``B``, ``x``).
* ``decays`` is always a log decay, ``<= 0``: the state is multiplied by its
  exponential at each token. ``betas`` is the write strength (a DeltaNet's
  ``β``; Mamba's step size ``Δ``, the spec's name).
"""

from __future__ import annotations

#: ``{value name: what it is}``, every name a component serves, one line each.
VALUES: dict[str, str] = {
    # the block and its parts
    "layer_input": "the hidden states entering a block (the residual stream), [batch, seq, hidden]",
    "layer_output": "the hidden states leaving a block, [batch, seq, hidden]",
    "attention_output": "the output of a block's token mixer (attention or a recurrent mixer), [batch, seq, hidden]",
    "attention_probabilities": "the softmax weights each attention head multiplies its values by, [batch, heads, seq, seq]",
    "mlp_output": "the feed-forward block's output, [batch, seq, hidden]",
    "router_logits": "a mixture-of-experts router's logits, one per expert, [batch, seq, experts]",
    # a recurrent mixer's state
    "state_input": "the recurrent state entering this call (None on a fresh prompt), a copy; assign it to continue from another",
    "state_output": "the recurrent state after this call's last token, what the next call starts from",
    "state": "the state after one token: the one tracer.iter pins (token 0 outside a loop)",
    "states": "the state after every token of this call, [batch, seq, ...state]",
    "state_input_readout": "the part of the mixer's output read from the state entering the call (None on a fresh prompt)",
    "effective_attention": "the exact effective attention A[t, s]: the output at t is sum_s A[t, s] * attention_values[s] (+ state_input_readout)",
    "conv_state_input": "the short-convolution window (or token shift) entering this call (None on a fresh prompt)",
    "conv_state_output": "the short-convolution window (or token shift) leaving this call",
    # a recurrent mixer read as linear attention
    "attention_queries": "how each token reads the state: a kernel's queries q (Mamba's C), tokens first",
    "attention_keys": "where each token writes the state: a kernel's keys k (Mamba's B; RWKV's log weight k), tokens first",
    "attention_values": "what each token writes into the state: a kernel's values v (Mamba's x; RG-LRU's u), tokens first",
    "betas": "each token's write strength: a DeltaNet's β in (0, 1), Mamba's step size Δ = softplus(dt + dt_bias)",
    "decays": "the log decay <= 0: the state is multiplied by its exponential at each token",
    # the kinds' own inputs to the recurrence
    "dt": "Mamba's time step before its bias and softplus (betas = softplus(dt + dt_bias))",
    "decay_rates": "RWKV's decay rate per channel, time_decay: decays = -exp(decay_rates), [channels]",
    "bonus": "RWKV's u, the current token's bonus (its weight is e^(u + k)), [channels]",
    "receptances": "RWKV's receptance gate sigma(r), multiplied into the WKV kernel's output, [batch, seq, channels]",
    "input_gates": "a gate on what enters: RG-LRU's i_t = sigmoid(W_x x_t + b_x); the mLSTM's pre-activation (gate exp of it); a short convolution's B",
    "forget_gates": "the mLSTM's forget gate pre-activation (gate sigmoid of it; decays = log sigmoid of it)",
    "output_gates": "a short convolution's C, the gate on the convolution's output (y = C * conv(B * x))",
    "recurrence_gate": "RG-LRU's recurrence gate r_t = sigmoid(W_a x_t + b_a), which scales its log decay",
    "recurrent_gate": "RG-LRU's a_t = exp(decays), the per-token decay its scan multiplies the state by",
    "lru_input": "RG-LRU's x_t, its input after the convolution, [batch, seq, lru_width]",
    "conv_input": "a short convolution's u = B * x, what the convolution window keeps, [batch, seq, conv_channels]",
}

__all__ = ["VALUES"]
