"""Mamba-2: the state-space-duality oracle suite (tests/components/test_state_space.py); the mixer's own tests are in tests/components/."""

from tests.components.test_state_space import StateSpaceSuite


class TestMamba2(StateSpaceSuite):
    MODEL_TYPE = "mamba2"
