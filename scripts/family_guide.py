"""Write ``docs/families.md``: per family, the values served, their shapes on a real checkpoint, and the tested releases.

    python scripts/family_guide.py            # with the package's environment (e.g. .venv/bin/python)

Nothing here is written by hand:

* **served**: ``model.support()`` on the family's tiny checkpoint
  (`nnterp.testing.tiny_checkpoint`), once as loaded and once after
  ``route_kernels(model.family, "torch")``;
* **shapes**: each value's annotation (``[batch, seq, mixer_heads, key_dim]``)
  filled in with the component's ``dims()`` on a model built on the ``meta``
  device from a config with a real checkpoint's sizes (the family's first
  ``REAL_CHECKPOINTS`` entry: the config alone, no weights). Where a family
  records no real checkpoint, the shapes are the tiny checkpoint's and say so;
* **tested releases**: the results ``scripts/version_table.py`` left in
  ``docs/versions.md``.

A family's ``REAL_CHECKPOINTS`` hold only sizes taken from a public source
named beside them; every shape shown depends only on those fields (hidden
size, layer map, mixer head counts and dims, convolution width).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import nnterp  # noqa: E402
from nnterp import StandardizedTransformer  # noqa: E402
from nnterp.components.layer import PARTS  # noqa: E402
from nnterp.families import families  # noqa: E402
from nnterp.testing import tiny_checkpoint  # noqa: E402


def _results(path: Path) -> dict:
    if not path.exists():
        return {}
    found = re.search(r"<!-- nnterp-version-results (.*) -->", path.read_text())
    return json.loads(found.group(1)) if found else {}


def _releases(family: str, results: dict) -> str:
    if not results:
        return "not yet run (`python scripts/version_table.py`)"
    passed = [r for r, run in results.items() if family in run["families"] and not run["families"][family]["failed"]]
    failed = [r for r, run in results.items() if family in run["families"] and run["families"][family]["failed"]]
    text = ", ".join(passed) if passed else "none"
    if failed:
        text += f"; **failing** on {', '.join(failed)}"
    return text


def _components(layer) -> dict:
    found = {"layer": layer}
    for part in PARTS:
        envoy = getattr(layer, part, None)
        if envoy is not None and hasattr(type(envoy), "values"):
            found[part] = envoy
    return found


def _first_components(model) -> dict:
    """``{kind: (layer index, component)}``: the first block holding each kind of component."""
    found: dict = {}
    for index, layer in enumerate(model.layers):
        for kind, component in _components(layer).items():
            found.setdefault(kind, (index, component))
    return found


def _status(support: dict, routed: dict, key: str) -> str:
    def first(entry):
        if entry is None or isinstance(entry, str):
            return entry
        reasons = [reason for reason in (entry.values() if isinstance(entry, dict) else entry) if reason is not None]
        return reasons[0] if reasons else None

    if first(support.get(key)) is None:
        return "served"
    if first(routed.get(key)) is None:
        return "after `route_kernels(model.family, \"torch\")`"
    return f"unavailable: {first(routed.get(key))}"


def _component_name(component) -> str:
    """The nnterp component a family's resolved subclass specializes (``LinearAttention``), by its own name."""
    for klass in type(component).__mro__:
        if klass.__module__.startswith("nnterp.components."):
            return klass.__name__
    return type(component).__name__


def _shape(value, sizes: dict) -> str:
    dims = getattr(value.annotation, "dim_str", None)
    if not dims:
        return "—"
    return "[" + ", ".join(str(sizes.get(name, name)) for name in dims.split()) + "]"


def _layer_map(parts: list[set]) -> str:
    """``24 blocks: linear_attn at 0-2, 4-6, ...; self_attn at 3, 7, ...`` compressed into runs."""
    kinds = {}
    for index, block in enumerate(parts):
        for kind in sorted(block - {"mlp"}):
            kinds.setdefault(kind, []).append(index)

    def runs(indices: list[int]) -> str:
        out, start = [], indices[0]
        for prev, cur in zip(indices, indices[1:] + [None]):
            if cur != prev + 1:
                out.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        return ", ".join(out)

    mlp = sum("mlp" in block for block in parts)
    text = "; ".join(f"`{kind}` at {runs(indices)}" for kind, indices in sorted(kinds.items()))
    return f"{len(parts)} blocks: {text}" + (f"; `mlp` in {mlp}" if mlp else "; no `mlp`")


class _Blocks:
    """The standardized blocks of a model built on the meta device (no pipeline, no weights: envoys only)."""

    def __init__(self, family, built) -> None:
        from functools import reduce

        from nnsight.intervention.envoy import Envoy

        root = Envoy(built, envoys=family.envoys())
        self.layers = list(reduce(getattr, family.LAYERS.split("."), root))


def _real_model(family) -> tuple:
    """``(standardized blocks on meta, config, checkpoint, source)`` with the family's first real checkpoint's sizes, or ``None``."""
    if not family.REAL_CHECKPOINTS:
        return None
    checkpoint, real = next(iter(family.REAL_CHECKPOINTS.items()))
    # The config class's own defaults under the named sizes: every derived size (a Mamba's
    # intermediate_size, a layer map not given) is derived from them, never from the tiny config.
    config = family.real_config(checkpoint)
    source = real.source
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    return _Blocks(family, built), config, checkpoint, source


def _sizes(component, config) -> dict:
    return {"batch": "batch", "seq": "seq", "hidden": config.get_text_config().hidden_size, **component.dims()}


def family_section(family, results: dict) -> list[str]:
    name = family.NAME
    tiny = StandardizedTransformer(str(tiny_checkpoint(family.MODEL_TYPES[0])), dispatch=True, device="cpu")
    support = tiny.support()
    if family.MIXER is not None:
        with nnterp.route_kernels(tiny.family, "torch"):
            routed = tiny.support()
    else:
        routed = support
    real = _real_model(family)
    shown, config = (real[0], real[1]) if real is not None else (tiny, tiny._module.config)
    doc = (family.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    lines = [f"## {name}", "", doc, ""]
    lines.append(f"- `model_type`: {', '.join(f'`{t}`' for t in family.MODEL_TYPES)}; transformers module `{family.MODELING.__name__}`")
    if real is not None:
        lines.append(f"- shapes on **{real[2]}**'s config (sizes from {real[3]}), built on the meta device")
    else:
        lines.append("- shapes on the **tiny** test checkpoint's config (no public sizes recorded here for a real checkpoint)")
    lines.append(f"- layer map: {_layer_map(family.layer_parts(config))}")
    lines.append(f"- tested transformers releases (all suites passing): {_releases(name, results)}")
    lines.append("")
    lines += ["| value | component | served | shape |", "| --- | --- | --- | --- |"]
    first = _first_components(shown)
    for kind, (index, component) in first.items():
        sizes = _sizes(component, config)
        for value_name, value in type(component).values().items():
            key = f"{kind}.{value_name}"
            lines.append(f"| `{key}` | {_component_name(component)} | {_status(support, routed, key)} | `{_shape(value, sizes)}` |")
        for method in ("state_after(t)", "set_state_after(t, value)"):
            if hasattr(type(component), method.split("(")[0]) and f"{kind}.states" in support:
                lines.append(f"| `{kind}.{method}` | {_component_name(component)} | {_status(support, routed, f'{kind}.states')} | as `state` |")
    dims = {kind: component.dims() for kind, (_, component) in first.items() if component.dims()}
    if dims:
        lines.append("")
        lines.append("Dimensions: " + "; ".join(f"`{kind}` " + ", ".join(f"{k} {v}" for k, v in d.items()) for kind, d in dims.items()))
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "families.md")
    parser.add_argument("--versions", type=Path, default=REPO / "docs" / "versions.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = _results(args.versions)
    lines = [
        "# Families",
        "",
        "<!-- Generated by scripts/family_guide.py: do not edit by hand. -->",
        "",
        "Which values each family serves, with their shapes on a real checkpoint's config, and the",
        "transformers releases its suites pass on ([versions](versions.md)). *served* is `support()` on",
        "the family's tiny checkpoint as loaded; *after `route_kernels`* means the value is read inside",
        "the token-by-token kernel, which `nnterp.route_kernels(model.family, \"torch\")` routes prompts",
        "through. Shapes use `batch` and `seq` (this call's tokens: the prompt, or 1 on a decode step).",
        f"Generated with transformers {transformers.__version__}: up to 5.22 a gated DeltaNet's",
        "`attention_queries` / `attention_keys` reach the kernel already repeated to the value heads,",
        "and their `key_heads` is then `mixer_heads`.",
        "",
        "Every family also serves `model.logits` `[batch, seq, vocab]` and `model.next_token_probs` `[batch, vocab]`.",
        "",
    ]
    for family in families():
        lines += family_section(family, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
