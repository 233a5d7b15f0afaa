"""`MLP`: a block's feed-forward part, whatever the family calls it.

A dense MLP, or the whole sparse block of a mixture of experts (router,
experts and any shared expert together), served from its own output,
unwrapped from the ``(output, router_logits)`` tuple some MoE blocks return
and rewrapped on write.

* ``mlp_output`` ``[batch, seq, hidden]``: what the block adds to the
  residual stream (before any post-norm a family applies in the layer).

Families do not map their MLP classes one by one: `Family.envoys` gives this
component to whatever module sits at the layer's ``MLP`` attribute.
"""

from __future__ import annotations

from ..core.dims import Hidden
from ..core.standard import Standard
from ..core.values import EProperty, Unwrap, check_tensor


class MLP(Standard):
    """A feed-forward block (``layer.mlp``)."""

    KIND = "mlp"

    mlp_output = EProperty(
        "output", select=Unwrap(), description="the feed-forward block's output, [batch, seq, hidden]",
        validate=lambda envoy, new, current: check_tensor("`mlp.mlp_output`", new, current), annotation=Hidden,
    )
