"""Hypothesis profiles of the property tests: ``ci`` (the default: a fixed, small example budget, derandomized)
and ``long`` (by hand: ``HYPOTHESIS_PROFILE=long pytest tests/properties``)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,  # a first example builds its model; tiny models, but not a fixed time per example
    database=None,  # nothing written into the tree; a failure prints its reproduction blob
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.register_profile("ci", max_examples=5, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
