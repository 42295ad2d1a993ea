"""Fixtures composing the shipped configs (see tests/train_helpers.py)."""
import pytest

from train_helpers import TINY, compose_config


@pytest.fixture
def composed():
    """`composed(*overrides)`: the composed config with the shipped defaults."""
    return compose_config


@pytest.fixture
def tiny_config():
    return lambda *overrides: compose_config(*TINY, *overrides)
