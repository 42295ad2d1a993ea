"""Trainer: run config, optimizers, schedule, metrics (AUC, NE), checkpoints and the training loop."""
import os

# Jagged batches give every GEMM a new shape; oneDNN's per-shape primitive cache would then grow to
# gigabytes on the CPU (bfloat16) without ever hitting. Set here, before the imports below load torch: the command
# line's entry points (train.py, python -m gem_lp.train, gem-lp-train) import this package first.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

from .checkpoint import CheckpointError, load_checkpoint, save_atomic, seed_everything  # noqa: E402
from .config import RESUME_MAY_CHANGE, ConfigError, RunConfig, TrainerConfig, load_run_config  # noqa: E402
from .distributed import LaunchEnv, LaunchError, launch_env  # noqa: E402
from .metrics import binary_entropy, mean_bce, normalized_entropy, roc_auc  # noqa: E402
from .optim import RowWiseAdagrad, warmup_decay_lambda  # noqa: E402
from .signals import TrainingInterrupted  # noqa: E402
from .trainer import (NonFiniteError, RunDirectoryInUse, Trainer, peak_memory_bytes, resolve_device,  # noqa: E402
                      train)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "LaunchEnv",
    "LaunchError",
    "NonFiniteError",
    "RESUME_MAY_CHANGE",
    "RowWiseAdagrad",
    "RunConfig",
    "RunDirectoryInUse",
    "Trainer",
    "TrainerConfig",
    "TrainingInterrupted",
    "binary_entropy",
    "load_checkpoint",
    "launch_env",
    "load_run_config",
    "mean_bce",
    "normalized_entropy",
    "peak_memory_bytes",
    "resolve_device",
    "roc_auc",
    "save_atomic",
    "seed_everything",
    "train",
    "warmup_decay_lambda",
]
