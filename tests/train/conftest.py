"""Hydra composition helper shared by the trainer tests."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# Tiny and quiet: a step takes tens of milliseconds on one CPU core.
TINY = ["experiment=smoke", "trainer.progress=false", "trainer.tensorboard=false", "trainer.num_threads=1",
        "data.batch_size=16", "data.num_items=300", "data.history_max=20", "trainer.eval_batches=2"]


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def composed():
    """`composed(*overrides)`: the composed config with the shipped defaults."""
    return compose_config


@pytest.fixture
def tiny_config():
    return lambda *overrides: compose_config(*TINY, *overrides)
