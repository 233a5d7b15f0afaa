"""What a standardized model can serve now, per layer, and its printed tree.

`support_table` walks every layer's parts and asks each declared value's
``unavailable`` predicate, so the answer follows the live process: routing,
installed kernel packages, a Mamba-2 mixer's chunk size.
"""

from __future__ import annotations

from typing import Any

from .circuits.nodes import support as circuit_support
from .components.layer import PARTS

#: Component kind -> the standard attribute of a layer it is reached by.
KINDS = ("layer", *PARTS)


def _components(layer: Any) -> dict[str, Any]:
    found = {"layer": layer}
    for part in PARTS:
        envoy = getattr(layer, part, None)
        if envoy is not None and hasattr(type(envoy), "values"):
            found[part] = envoy
    return found


def support_table(model: Any) -> dict:
    """See `StandardizedTransformer.support`."""
    layers = list(model.layers)
    reasons: dict[str, dict[int, Any]] = {}
    for index, layer in enumerate(layers):
        for kind, envoy in _components(layer).items():
            for name, value in type(envoy).values().items():
                reasons.setdefault(f"{kind}.{name}", {})[index] = value.reason(envoy)
            if hasattr(type(envoy), "interventions"):
                for name, reason in envoy.interventions().items():
                    reasons.setdefault(f"{kind}.{name}", {})[index] = reason
            if hasattr(type(envoy), "gradients"):
                for name, reason in envoy.gradients().items():
                    reasons.setdefault(f"{kind}.{name}.grad", {})[index] = reason
    table: dict[str, Any] = {}
    for name, value in type(model).__dict__.items():
        if hasattr(value, "reason") and getattr(value, "description", None):
            table[f"model.{name}"] = value.reason(model)
    for key, per_layer in reasons.items():
        if all(reason is None for reason in per_layer.values()):
            table[key] = None
        elif len(per_layer) == len(layers):
            table[key] = [per_layer[i] for i in range(len(layers))]
        else:
            table[key] = dict(sorted(per_layer.items()))
    table.update(circuit_support(model))
    return table


def _group(layers: list) -> list[tuple[int, int, str]]:
    """Runs of consecutive layers with the same parts: ``(first, last, signature)``."""
    runs: list[tuple[int, int, str]] = []
    for index, layer in enumerate(layers):
        signature = ", ".join(f"{part}: {type(getattr(layer, part)).__name__}" for part in PARTS if getattr(layer, part) is not None)
        if runs and runs[-1][2] == signature and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index, signature)
        else:
            runs.append((index, index, signature))
    return runs


def describe(model: Any) -> str:
    """The standardized tree with each value's one-line description."""
    family = model.family
    lines = [f"StandardizedTransformer({family.NAME}: {type(model._module).__name__})"]
    lines.append(f"  embed_tokens: {family.EMBED_TOKENS}")
    layers = list(model.layers)
    lines.append(f"  layers: {len(layers)} x Layer ({family.LAYERS})")
    for name, value in type(layers[0]).values().items():
        lines.append(f"      {value}")
    shown: set = set()
    for first, last, signature in _group(layers):
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"    [{span}] {signature}")
        for part in PARTS:
            envoy = getattr(layers[first], part)
            if envoy is None or not hasattr(type(envoy), "values") or type(envoy) in shown:
                continue
            shown.add(type(envoy))
            for value in type(envoy).values().values():
                lines.append(f"        {part}.{value}")
    lines.append(f"  ln_final: {family.LN_FINAL}")
    lines.append(f"  lm_head: {family.LM_HEAD}")
    for name in ("logits", "next_token_probs"):
        lines.append(f"  {type(model).__dict__[name]}")
    return "\n".join(lines)
