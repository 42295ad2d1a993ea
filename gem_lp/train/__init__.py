"""Trainer: optimizers, schedule, metrics (AUC, NE), checkpoints and the training loop."""
from .checkpoint import load_checkpoint, save_atomic, seed_everything
from .config import TrainerConfig
from .metrics import binary_entropy, mean_bce, normalized_entropy, roc_auc
from .optim import RowWiseAdagrad, warmup_decay_lambda
from .trainer import NonFiniteError, Trainer, peak_memory_bytes, resolve_device, train

__all__ = [
    "NonFiniteError",
    "RowWiseAdagrad",
    "Trainer",
    "TrainerConfig",
    "binary_entropy",
    "load_checkpoint",
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
