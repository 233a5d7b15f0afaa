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
    NnterpError,
    NotInTrace,
    OrderError,
    OutOfVocabulary,
    PositionError,
    ReadOnlyValue,
    RoutingError,
    ShapeError,
    Unavailable,
    UnsupportedModel,
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
    "Unavailable",
    "UnsupportedModel",
    "WrongType",
    "ShapeError",
    "DtypeError",
    "DeviceError",
    "PositionError",
    "EmptyPrompt",
    "OutOfVocabulary",
]

__version__ = "0.1.0"
