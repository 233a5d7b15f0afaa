"""The fill every state-writing test of `nnterp.fast` runs under: the token loop (a CPU's default) and the closed-form
blocks (`nnterp.fast.scan.block_states`, a GPU's), so both are checked against the same oracles on the CPU."""

from __future__ import annotations

import pytest

import nnterp.fast.scan as scan


@pytest.fixture(params=["token loop", "blocks"])
def fill(request, monkeypatch):
    if request.param == "blocks":
        monkeypatch.setattr(scan, "LOOP_FREE", frozenset({"cpu", "cuda"}))
    return request.param
