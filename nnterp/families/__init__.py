"""The families nnterp wraps, found by ``config.model_type`` and imported only when asked for.

A family is a class (`~nnterp.families.base.Family`) in
``nnterp/families/<model_type>.py``, written as the difference from its
nearest sibling; the file's name is its key here. `REGISTRY` lists the keys
from the folder alone, without importing a family file (so ``import nnterp``
imports no transformers modeling module), and ``REGISTRY[model_type]``
imports the one file (and its siblings up to `llama`). A few model types are
served by a family filed under another name: the hub's vision-language
composites and Qwen3.5-MoE's text model (`ALIASES`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Any

from ..core.errors import UnsupportedModel
from ..core.local import LocalDict
from ..recurrent import routing
from .base import Family


class FamilyAbsent(UnsupportedModel):
    """A registered family whose transformers classes the installed release does not have (added later)."""

#: A ``model_type`` served by the family filed under another name -> that name.
ALIASES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe_text": "qwen3_5_moe"}

#: Modules of this folder that are not families.
_NOT_FAMILIES = {"base"}


def _files() -> tuple[str, ...]:
    return tuple(
        sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_") and info.name not in _NOT_FAMILIES)
    )


class _Registry(Mapping):
    """``model_type -> family class``; the keys come from the folder, a value imports its file on first use."""

    def __init__(self) -> None:
        self._loaded: dict[str, type[Family]] = LocalDict()  # pickled empty: a request carries only its family
        self._keys = tuple(sorted({*_files(), *ALIASES}))

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, model_type: object) -> bool:
        return model_type in self._keys

    def __getitem__(self, model_type: str) -> type[Family]:
        if model_type not in self._keys:
            raise KeyError(model_type)
        name = ALIASES.get(model_type, model_type)
        if name not in self._loaded:
            try:
                module = importlib.import_module(f"{__name__}.{name}")
            except ImportError as error:
                if "transformers" not in str(error) and "cannot import name" not in str(error):
                    raise
                import transformers

                raise FamilyAbsent(
                    f"model_type {model_type!r} is not in the installed transformers {transformers.__version__} "
                    f"({type(error).__name__}: {error}); nnterp serves it with a release that has it"
                ) from error
            found = [
                value for value in vars(module).values()
                if isinstance(value, type) and issubclass(value, Family) and value.__module__ == module.__name__
            ]
            if len(found) != 1:
                raise TypeError(f"{module.__name__} must define exactly one Family subclass, found {len(found)}")
            self._loaded[name] = found[0]
        family = self._loaded[name]
        if model_type not in family.MODEL_TYPES:
            raise TypeError(f"{family.__name__}.MODEL_TYPES does not list {model_type!r}, which the registry files under it")
        return family

    def __repr__(self) -> str:
        return f"REGISTRY({', '.join(self._keys)})"


def __getattr__(name: str) -> Any:
    """``nnterp.families.qwen3_5_text``: a family's file, imported on first use like the registry's values."""
    if name in _files():
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: ``model_type -> family class``, importing a family's file only when it is looked up.
REGISTRY: Mapping[str, type[Family]] = _Registry()

#: Every ``model_type`` nnterp serves, sorted.
MODEL_TYPES: tuple[str, ...] = tuple(REGISTRY)


def family_for(config_or_model_type: Any) -> type[Family]:
    """The family serving a config's ``model_type`` (or a ``model_type`` string), or `UnsupportedModel` naming the fix."""
    if isinstance(config_or_model_type, str):
        model_type = config_or_model_type
    else:
        model_type = getattr(config_or_model_type, "model_type", None)
    if model_type not in REGISTRY:
        raise UnsupportedModel(
            f"nnterp has no family for model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}. To add one, "
            f"write nnterp/families/{model_type or '<model_type>'}.py, a Family subclass of its nearest sibling "
            "declaring what differs (MODELING, MODEL_TYPES, DECODER_LAYERS, COMPONENTS, layer_parts, tiny_sizes), "
            f"and its tests in tests/families/test_{model_type or '<model_type>'}.py"
        )
    return REGISTRY[model_type]


def family_of_modeling(modeling: Any) -> type[Family] | None:
    """The registered family whose ``MODELING`` is ``modeling`` (a transformers modeling module), or ``None``.

    ``transformers.models.<model_type>.modeling_<model_type>`` is looked up by
    its folder's name first (importing one family file); otherwise every
    family the installed release has is asked.
    """
    folder = getattr(modeling, "__name__", "").split(".")[2:3]
    candidates = [folder[0]] if folder and folder[0] in REGISTRY else []
    for model_type in [*candidates, *(name for name in _files() if name not in candidates)]:
        if absent(model_type) is None and REGISTRY[model_type].MODELING is modeling:
            return REGISTRY[model_type]
    return None


routing.MODELING_LOOKUP.append(family_of_modeling)


def absent(model_type: str) -> str | None:
    """Why the installed transformers cannot serve a registered ``model_type`` (a release without it), or ``None``."""
    try:
        REGISTRY[model_type]
    except FamilyAbsent as error:
        return str(error)
    return None


def present() -> tuple[str, ...]:
    """The registered model types the installed transformers release has (imports their family files)."""
    return tuple(model_type for model_type in MODEL_TYPES if absent(model_type) is None)


def families() -> list[type[Family]]:
    """Every registered family the installed release has, once, each after the sibling it is written as the difference from.

    Imports them all. Depth first from `llama`; among siblings, the one with
    more descendants first, then by name.
    """
    every = {REGISTRY[name] for name in _files() if absent(name) is None}

    def children(parent: type) -> list[type[Family]]:
        return [f for f in every if f.__base__ is parent]

    def size(family: type) -> int:
        return sum(1 + size(child) for child in children(family))

    ordered: list[type[Family]] = []

    def visit(parent: type) -> None:
        for child in sorted(children(parent), key=lambda f: (-size(f), f.NAME)):
            ordered.append(child)
            visit(child)

    visit(Family)
    return ordered

