"""`Attention`: a softmax attention block, whatever the family calls it.

Serves the block's own output, unwrapped from the ``(output, weights)`` tuple
transformers' attention modules return and rewrapped on write.

* ``attention_output`` ``[batch, seq, hidden]``: what the block adds to the
  residual stream (after its output projection).
"""

from __future__ import annotations

from ..core.dims import Hidden
from ..core.standard import Standard
from ..core.values import module_output


class Attention(Standard):
    """A softmax attention block (``layer.self_attn``)."""

    KIND = "self_attn"

    attention_output = module_output("the block's output, [batch, seq, hidden]", Hidden)
