"""nnterp: read and patch what recurrent and hybrid language models carry forward.

``StandardizedTransformer`` gives every supported family one interface
(``model.layers[i].linear_attn`` / ``.self_attn`` / ``.mlp``,
``layer_output``, ``next_token_probs``, ``model.support()``); the recurrent
mixers serve their state entering and leaving a call, after every token, and
writable mid-prompt and on every step of ``generate``.
"""

from . import families
from .components.recurrent import RecurrentMixer
from .core.errors import (
    DeviceError,
    DtypeError,
    EmptyPrompt,
    InvalidArgument,
    KernelFailure,
    LoadError,
    NnterpError,
    NotInTrace,
    OrderError,
    OutOfVocabulary,
    PositionError,
    ReadOnlyValue,
    RenamingError,
    RoutingError,
    ShapeError,
    SignatureError,
    TokenizationError,
    Unavailable,
    UnsupportedModel,
    UnsupportedRelease,
    WrongType,
)
from .recurrent.routing import route_delta_rule, route_kernels
from .recurrent.settings import chunk_per_token, fast_states
from .standardized import StandardizedTransformer

__all__ = [
    "StandardizedTransformer",
    "RecurrentMixer",
    "route_kernels",
    "route_delta_rule",
    "chunk_per_token",
    "fast_states",
    "families",
    "NnterpError",
    "NotInTrace",
    "OrderError",
    "ReadOnlyValue",
    "RoutingError",
    "KernelFailure",
    "Unavailable",
    "UnsupportedModel",
    "UnsupportedRelease",
    "WrongType",
    "SignatureError",
    "InvalidArgument",
    "LoadError",
    "ShapeError",
    "DtypeError",
    "DeviceError",
    "PositionError",
    "EmptyPrompt",
    "OutOfVocabulary",
    "InvalidArgument",
    "RenamingError",
    "TokenizationError",
    "get_rename_dict",
    "ModuleAccessor",
    "state_steering_vectors",
    "knockout_sweep",
    "collect",
    "StateStore",
    "long_context_profile",
    "LongContextProfile",
]


#: nnterp 1.x's top-level names, imported on first use (``import nnterp`` stays light).
_ONEX = {"get_rename_dict": "nnterp.rename_utils", "ModuleAccessor": "nnterp.nnsight_utils"}
#: Toolkit functions, imported on first use too.
_LAZY = {**_ONEX, "state_steering_vectors": "nnterp.steering", "knockout_sweep": "nnterp.knockout", "collect": "nnterp.collection", "StateStore": "nnterp.store",
    "long_context_profile": "nnterp.long_context", "LongContextProfile": "nnterp.profile_result",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nnterp' has no attribute {name!r}")


def _version() -> str:
    """This package's version, from the metadata of the distribution it was installed from.

    pyproject.toml is the one place the version is written. An installed copy
    reads it back from its metadata; a source checkout that is not the
    installed copy (an editable install of another worktree, or no install at
    all, with the checkout on ``PYTHONPATH``) reads its own pyproject.toml.
    """
    import json
    import re
    from importlib import metadata
    from pathlib import Path

    here = Path(__file__).resolve().parent
    try:
        dist = metadata.distribution("nnterp")
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        if Path(dist.locate_file("nnterp/__init__.py")).resolve() == here / "__init__.py":
            return dist.version  # a regular install: this file is the distribution's
        direct_url = dist.read_text("direct_url.json")
        if direct_url and json.loads(direct_url).get("url") == here.parent.as_uri():
            return dist.version  # an editable install of this checkout
    pyproject = here.parent / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    return dist.version if dist is not None else "0+unknown"


__version__ = _version()
