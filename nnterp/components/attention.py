"""`Attention`: a softmax attention block, whatever the family calls it.

Serves the block's own output, unwrapped from the ``(output, weights)`` tuple
transformers' attention modules return and rewrapped on write.

* ``attention_output`` ``[batch, seq, hidden]``: what the block adds to the
  residual stream (after its output projection).
* ``attention_probabilities`` ``[batch, heads, seq, seq]``: the softmax
  weights (after dropout, as HF's eager attention multiplies them with the
  values), read and written where the model runs eager attention (load it
  with ``StandardizedTransformer(..., enable_attention_probs=True)``). A write
  changes the block's output as eager attention would with those weights. The
  weights are the first argument of the ``torch.matmul(weights, values)`` call
  inside the family's ``eager_attention_forward``, found from the installed
  release's source (as `nnterp.recurrent.labels` finds kernel labels).
"""

from __future__ import annotations

import ast
import re
from typing import Any

import torch
from nnsight.intervention.source import compiled, decorator_chain

from ..core.dims import Hidden
from ..core.errors import InvalidArgument, NnterpError, Unavailable, UnsupportedRelease, WrongType
from ..core.standard import Standard
from ..core.values import DerivedEProperty, module_output
from ..recurrent.knockout import as_positions, check_mode
from ..recurrent.labels import missing

#: HF attention class -> (the label of its ``attention_interface(...)`` call, the label of the
#: ``torch.matmul(weights, values)`` call in its eager function), or the error saying why not.
_FOUND: dict[type, tuple[str, str] | NnterpError] = {}


def _call_labels(fn: Any, accept: Any) -> list[str]:
    """The nnsight labels, in execution order, of the calls in ``fn`` whose AST node ``accept`` accepts."""
    info = compiled(fn)
    tree = ast.parse(info.source)
    lines = {node.lineno: node for node in ast.walk(tree) if isinstance(node, ast.Call) and accept(node)}
    return [name for name in info.names if info.lines.get(name) in lines and re.match(r"^.+_\d+$", name)]


def probability_labels(hf_attention: type) -> tuple[str, str]:
    """``(interface call, weights-times-values matmul)`` labels of an HF attention class, found once."""
    found = _FOUND.get(hf_attention)
    if found is None:
        inner = decorator_chain(hf_attention.forward)[0]
        try:
            calls = [
                name for name in _call_labels(inner, lambda n: isinstance(n.func, ast.Name) and n.func.id == "attention_interface")
                if name.startswith("attention_interface_")
            ]
            if not calls:
                raise UnsupportedRelease(missing("the `attention_interface(...)` call", inner))
            eager = inner.__globals__.get("eager_attention_forward")
            if eager is None:
                raise UnsupportedRelease(missing("`eager_attention_forward`", inner))

            def weights_times_values(node: ast.Call) -> bool:
                return (
                    isinstance(node.func, ast.Attribute) and node.func.attr == "matmul" and len(node.args) == 2
                    and "value" in ast.unparse(node.args[1])
                )

            matmuls = [name for name in _call_labels(eager, weights_times_values) if "matmul" in name]
            if not matmuls:
                raise UnsupportedRelease(missing("the `torch.matmul(weights, values)` call", eager))
            found = (calls[0], matmuls[0])
        except NnterpError as error:
            found = error
        _FOUND[hf_attention] = found
    if isinstance(found, NnterpError):
        raise found
    return found


def _probabilities_unavailable(envoy: Any) -> str | None:
    config = getattr(envoy._module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "eager":
        return (
            f"the model runs {implementation!r} attention, which never forms the probabilities; load it with "
            "StandardizedTransformer(..., enable_attention_probs=True) (eager attention)"
        )
    try:
        probability_labels(type(envoy._module))
    except NnterpError as error:
        return str(error)
    return None


def _matmul(envoy: Any) -> Any:
    interface, matmul = probability_labels(type(envoy._module))
    return getattr(getattr(envoy.source, interface).source, matmul)


def _read_probabilities(envoy: Any) -> Any:
    return _matmul(envoy).input


def _write_probabilities(envoy: Any, value: Any) -> None:
    # Not checked against the current weights: an operation's input inside the source is
    # served once, and the usual write follows a read of it.
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        raise WrongType(f"`self_attn.attention_probabilities` takes a [batch, heads, seq, seq] tensor, got {getattr(value, 'shape', type(value).__name__)}")
    _matmul(envoy).input = value


#: ``mode`` values an attention layer's knockout takes (`nnterp.knockout` says what each does).
ATTENTION_MODES = ("value", "mask")


def _knockout_reason(attention: Any) -> str | None:
    """Why ``self_attn.knockout`` cannot act now: the attention probabilities' reason (eager attention)."""
    return type(attention).values()["attention_probabilities"].reason(attention)


def _knock_out(attention: Any, sources: Any, targets: Any = None, mode: str = "value") -> None:
    """``self_attn.knockout``: edit this call's attention weights at ``(targets, sources)`` (module docstring)."""
    what = "self_attn.knockout"
    check_mode(mode, targets, what, ATTENTION_MODES)
    reason = _knockout_reason(attention)
    if reason is not None:
        raise Unavailable(what, reason)
    weights = attention.attention_probabilities  # [batch, heads, queries, keys]
    seq, keys = weights.shape[2], weights.shape[3]
    chosen = as_positions(sources, seq, f"`{what}` sources")
    rows = list(range(min(chosen), seq)) if targets is None else as_positions(targets, seq, f"`{what}` targets")
    pairs = torch.zeros(seq, keys, dtype=torch.bool, device=weights.device)
    for s in chosen:
        pairs[[t for t in rows if t >= s], keys - seq + s] = True
    edited = weights.masked_fill(pairs, 0.0)
    if mode == "mask":
        left = edited.sum(-1, keepdim=True) + (1 - weights.sum(-1, keepdim=True))  # a sink's share stays
        changed = pairs.any(-1)[None, None, :, None]
        if bool((changed & (left <= 0)).any()):
            raise InvalidArgument(
                f"`{what}`: mode='mask' would leave a target with no key to attend to (its row would be all -inf); "
                "keep at least one of its keys, or use mode='value'"
            )
        edited = torch.where(changed, edited / left.clamp_min(torch.finfo(left.dtype).tiny), edited)
    attention.attention_probabilities = edited


class Attention(Standard):
    """A softmax attention block (``layer.self_attn``)."""

    KIND = "self_attn"

    attention_output = module_output("the block's output, [batch, seq, hidden]", Hidden)
    attention_probabilities = DerivedEProperty(
        _read_probabilities,
        assign=_write_probabilities,
        description="the attention weights each head multiplies the values by, [batch, heads, seq, seq] (eager attention only)",
        unavailable=_probabilities_unavailable,
    )

    def knockout(self, sources: Any, targets: Any = None, mode: str = "value") -> None:
        """Remove the flow from token(s) ``sources`` to ``targets`` (``None``: every position at or after each
        source) in this call's attention, every head: ``mode="value"`` drops the term ``a[t, s] · v_s`` without
        renormalizing, ``mode="mask"`` sets the score to ``-inf`` and renormalizes. Eager attention only
        (``enable_attention_probs=True``); `nnterp.knockout` says more."""
        _knock_out(self, sources, targets, mode)

    def interventions(self) -> dict[str, str | None]:
        """Per intervention, ``None`` where it acts now, else why not (``support()``'s rows)."""
        return {"knockout": _knockout_reason(self)}
