"""Qwen3.5: the gated-DeltaNet oracle suite (tests/families/gdn.py); the DeltaNet's own tests are in tests/components/."""

import pytest

from tests.families.gdn import *  # noqa: F401,F403  (the shared suite, run for this family)


@pytest.fixture(scope="module")
def model_type():
    return "qwen3_5_text"
