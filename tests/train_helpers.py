"""Shared by the trainer, report and packaging tests: composing the shipped configs, running the command line."""
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import gem_lp.train.config  # noqa: F401  (puts the schemas in Hydra's ConfigStore)

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "gem_lp" / "configs"
TRAIN_PY = ROOT / "train.py"
# Tiny and quiet: a step takes tens of milliseconds on one CPU core.
TINY = ["experiment=smoke", "trainer.progress=false", "trainer.tensorboard=false", "trainer.num_threads=1",
        "data.batch_size=16", "data.num_items=300", "data.history_max=20", "trainer.eval_batches=2"]


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_cli(*args, cwd, check=True, timeout=300):
    """`python <args>` in a subprocess with the worktree importable; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
