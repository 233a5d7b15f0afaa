"""`MLP`: a block's feed-forward part, whatever the family calls it.

A dense MLP, or the whole sparse block of a mixture of experts (router,
experts and any shared expert together), served from its own output,
unwrapped from the ``(output, router_logits)`` tuple some MoE blocks return
and rewrapped on write.

* ``mlp_output`` ``[batch, seq, hidden]``: what the block adds to the
  residual stream (before any post-norm a family applies in the layer).
* ``router_logits`` ``[batch, seq, experts]``: on a mixture of experts, the
  router's logits, one per routed expert, before the softmax (or sigmoid)
  and the top-k choice; read and written. A write changes the routing: the
  router picks its experts and weights from the written logits (the
  experts' outputs and any shared expert are computed as usual). On a dense
  block it is `Unavailable` ("this block's feed-forward part is dense: no
  router"), in ``support()`` too.

The router is found from the module tree, not declared per family: the
block's child at one of `MLP.ROUTERS` (``gate`` on Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next, Kimi Linear, Bailing, Nemotron-H; ``router`` on Jamba and
Granite-4.0). Its logits are the value its forward binds to
``router_logits`` (transformers' ``*TopKRouter`` classes, found in the
installed release's source as `nnterp.recurrent.labels` finds kernel labels),
or its output where the router is a plain ``nn.Linear``. Routers flatten the
tokens (``[batch * seq, experts]``); nnterp serves them per position.

Families do not map their MLP classes one by one: `Family.envoys` gives this
component to whatever module sits at the layer's ``MLP`` attribute.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import torch
from nnsight.intervention.source import compiled, decorator_chain

from ..core.dims import Hidden, RouterLogits
from ..core.errors import NnterpError, ShapeError, UnsupportedRelease, WrongType
from ..core.standard import Standard
from ..core.values import DerivedEProperty, EProperty, Unwrap, check_tensor
from ..recurrent.labels import missing

#: Why a dense block has no router logits.
DENSE = "this block's feed-forward part is dense: no router"

#: HF router class -> the label of its ``router_logits = ...`` binding, or the error saying why not.
_FOUND: dict[type, str | NnterpError] = {}


def router_label(router: type) -> str:
    """The nnsight label of the ``router_logits`` binding in an HF router class's forward, found once."""
    found = _FOUND.get(router)
    if found is None:
        inner = decorator_chain(router.forward)[0]
        info = compiled(inner)
        tree = ast.parse(info.source)
        lines = {
            node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "router_logits" for t in node.targets)
        }
        labels = [name for name in info.names if re.match(r"^router_logits_\d+$", name) and info.lines.get(name) in lines]
        found = labels[0] if labels else UnsupportedRelease(missing("the `router_logits = ...` binding", inner))
        _FOUND[router] = found
    if isinstance(found, UnsupportedRelease):
        raise found
    return found


def _router(envoy: Any) -> Any:
    """The router's envoy in this feed-forward block, or ``None`` on a dense one."""
    for name in type(envoy).ROUTERS:
        child = getattr(envoy._module, name, None)
        if isinstance(child, torch.nn.Module):
            return getattr(envoy, name)
    return None


def _logits_unavailable(envoy: Any) -> str | None:
    router = _router(envoy)
    if router is None:
        return DENSE
    if isinstance(router._module, torch.nn.Linear):
        return None
    try:
        router_label(type(router._module))
    except NnterpError as error:
        return str(error)
    return None


def _experts(module: Any) -> int:
    return module.out_features if isinstance(module, torch.nn.Linear) else module.weight.shape[0]


def _location(router: Any) -> Any:
    """Where the logits are: the router's output (a plain linear router) or its ``router_logits`` binding."""
    if isinstance(router._module, torch.nn.Linear):
        return router
    return getattr(router.source, router_label(type(router._module)))


def _read_logits(envoy: Any) -> Any:
    batch, seq = envoy.input.shape[:2]
    router = _router(envoy)
    logits = _location(router).output
    return logits.reshape(batch, seq, logits.shape[-1])


def _write_logits(envoy: Any, value: Any) -> None:
    # Not checked against the current logits: an operation inside the source is served once,
    # and the usual write follows a read of it (as attention probabilities).
    router = _router(envoy)
    experts = _experts(router._module)
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        raise WrongType(
            f"`mlp.router_logits` takes a [batch, seq, experts] tensor, got {getattr(value, 'shape', type(value).__name__)}"
        )
    if value.shape[-1] != experts:
        raise ShapeError(f"`mlp.router_logits` has {experts} experts, got a last dimension of {value.shape[-1]}")
    _location(router).output = value.reshape(-1, experts)


class MLP(Standard):
    """A feed-forward block (``layer.mlp``)."""

    KIND = "mlp"

    #: The names a mixture of experts keeps its router at (its child module); a dense block has none.
    ROUTERS = ("gate", "router")

    mlp_output = EProperty(
        "output", select=Unwrap(), description="the feed-forward block's output, [batch, seq, hidden]",
        validate=lambda envoy, new, current: check_tensor("`mlp.mlp_output`", new, current), annotation=Hidden,
    )
    router_logits = DerivedEProperty(
        _read_logits,
        assign=_write_logits,
        description="the router's logits, one per expert, [batch, seq, experts] (mixture-of-experts blocks only)",
        unavailable=_logits_unavailable,
        annotation=RouterLogits,
    )

    def dims(self) -> dict[str, int]:
        router = _router(self)
        return {} if router is None else {"experts": _experts(router._module)}
