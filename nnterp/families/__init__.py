"""The families nnterp wraps, registered in this one place, keyed by ``config.model_type``.

A family is a module (one file per transformers ``model_type``) naming the
transformers modeling module it wraps (``MODELING``), where the standard parts
live (``LAYERS``, ``EMBED_TOKENS``, ``LN_FINAL``, ``LM_HEAD``), which component
serves each HF module class (``COMPONENTS``, ``DECODER_LAYER`` -> ``LAYER``),
its recurrent mixer component (``MIXER``, for `route_kernels`) and, from a
config alone, which parts each block has (``layer_parts``). A new family is a
file written as the difference from its nearest sibling, added to
``FAMILIES`` below.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

from ..core.errors import UnsupportedModel
from . import kimi_linear, llama, mamba, mamba2, olmo_hybrid, qwen3_5_moe, qwen3_5_text, qwen3_next

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3_5_text, qwen3_5_moe, qwen3_next, olmo_hybrid, kimi_linear, mamba, mamba2)

REGISTRY: dict[str, ModuleType] = {model_type: family for family in FAMILIES for model_type in family.MODEL_TYPES}


def family_for(config: Any) -> ModuleType:
    """The family wrapping ``config.model_type``, or `UnsupportedModel` naming the fix."""
    model_type = getattr(config, "model_type", None)
    family = REGISTRY.get(model_type)
    if family is None:
        supported = ", ".join(sorted(REGISTRY))
        raise UnsupportedModel(
            f"nnterp has no family for model_type {model_type!r}; supported: {supported}. To add one, write "
            "nnterp/families/<model_type>.py as the difference from its nearest sibling (its MODELING module, "
            "COMPONENTS map and layer_parts) and add it to FAMILIES in nnterp/families/__init__.py"
        )
    return family


def family_of_modeling(modeling: ModuleType) -> Optional[ModuleType]:
    """The family whose ``MODELING`` is ``modeling``, if any."""
    for family in FAMILIES:
        if getattr(family, "MODELING", None) is modeling:
            return family
    return None


def envoys(family: ModuleType) -> dict:
    """nnsight's ``envoys=`` map for a family: HF module class -> component."""
    return {family.DECODER_LAYER: family.LAYER, **family.COMPONENTS}
