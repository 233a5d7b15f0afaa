"""`nnterp.fast`'s shape: one file per kind, each with the same functions of a call's arguments and its specs.

Every kind file exposes ``states(arguments, out=None)``, ``state_shape(arguments)``,
``effective_attention(arguments, positions, <heads | channels>, coefficients)`` and,
where the kind has one, ``one_pass(arguments, out)`` (Mamba-1 also ``resume``), and
``FAST`` / ``EFFECTIVE`` built from exactly those; the gated DeltaNet's file holds two
kinds, so its names carry the kind (``gated_``, ``kimi_``). The package imports no
kind from `nnterp.fast.spec`, and stays within its size (≤ 13 files, ≤ 400 lines each).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import nnterp.fast
from nnterp.fast.spec import EffectiveSpec, FastSpec

FAST = Path(nnterp.fast.__file__).parent
KINDS = ["state_space", "selective_scan", "lightning_attention", "mlstm", "rg_lru", "wkv", "short_convolution"]
#: (module, prefix of its names, suffix of its spec constants' names)
PER_KIND = [(kind, "", "") for kind in KINDS] + [("gated_deltanet", "gated_", "GATED_"), ("gated_deltanet", "kimi_", "KIMI_")]


def parameters(function) -> list:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(("kind", "prefix", "constant"), PER_KIND, ids=[f"{k}-{p or 'one'}" for k, p, _ in PER_KIND])
def test_every_kind_has_the_same_functions_and_its_specs_are_built_from_them(kind, prefix, constant):
    module = importlib.import_module(f"nnterp.fast.{kind}")
    fast, effective = getattr(module, f"{constant}FAST"), getattr(module, f"{constant}EFFECTIVE")
    assert isinstance(fast, FastSpec) and isinstance(effective, EffectiveSpec)
    states = getattr(module, f"{prefix}states")
    assert parameters(states) == ["arguments", "out"] and inspect.signature(states).parameters["out"].default is None
    assert fast.compute is states and fast.state_shape is module.state_shape
    assert parameters(module.state_shape) == ["arguments"]
    attention = getattr(module, f"{prefix}effective_attention")
    assert effective.compute is attention
    assert parameters(attention) == ["arguments", "positions", effective.axis, "coefficients"]
    one_pass = getattr(module, f"{prefix}one_pass", None)
    assert fast.one_pass is one_pass
    if one_pass is not None:
        assert parameters(one_pass) == ["arguments", "out"]
    if fast.resume is not None:
        assert fast.resume is module.resume and parameters(module.resume) == ["arguments", "initial", "result"]


def test_the_package_keeps_its_names_and_its_size():
    for name in nnterp.fast.__all__:
        assert hasattr(nnterp.fast, name), name
    assert nnterp.fast.GATED_DELTA is importlib.import_module("nnterp.fast.gated_deltanet").GATED_FAST
    assert nnterp.fast.SCAN_ATTENTION is importlib.import_module("nnterp.fast.selective_scan").EFFECTIVE
    files = sorted(FAST.glob("*.py"))
    assert len(files) <= 13, [f.name for f in files]
    for file in files:
        assert len(file.read_text().splitlines()) <= 400, file.name
    spec = (FAST / "spec.py").read_text()
    assert not any(f"from .{kind} " in spec or f"import {kind}" in spec for kind in KINDS + ["gated_deltanet"])
