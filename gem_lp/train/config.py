"""Trainer settings (`configs/trainer/*.yaml` map onto this dataclass)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

DECAYS = ("cosine", "linear", "none")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimization, evaluation and bookkeeping.

    `max_steps` is the length of the run and of the LR schedule; `stop_after` (optional) stops the
    run earlier, after writing a checkpoint, so that `resume=true` can continue it (the schedule
    still spans `max_steps`).
    """

    device: str = "cpu"  # "cpu", "cuda" or "auto"
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    num_workers: int = 0  # DataLoader worker processes generating batches
    max_steps: int = 600
    stop_after: int | None = None
    eval_every: int = 200
    eval_batches: int = 32
    log_every: int = 10
    checkpoint_every: int = 200
    checkpoint_path: str | None = None  # default: <run dir>/checkpoint.pt
    lr: float = 2e-3  # AdamW, dense parameters
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    embedding_lr: float = 0.05  # row-wise Adagrad, embedding tables
    warmup_steps: int = 50
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0  # max global norm of the dense gradients (None: no clipping)
    progress: bool = True
    tensorboard: bool = True

    def __post_init__(self):
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"trainer.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        for name in ("max_steps", "eval_every", "eval_batches", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            raise ValueError(f"trainer.stop_after must be null or in [1, max_steps={self.max_steps}], "
                             f"got {self.stop_after}")
        if self.num_workers < 0:
            raise ValueError(f"trainer.num_workers must be >= 0, got {self.num_workers}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"trainer.num_threads must be null or >= 1, got {self.num_threads}")
        if self.decay not in DECAYS:
            raise ValueError(f"trainer.decay must be one of {DECAYS}, got {self.decay!r}")
        if self.lr <= 0 or self.embedding_lr <= 0:
            raise ValueError(f"trainer.lr and trainer.embedding_lr must be > 0, got {self.lr}, {self.embedding_lr}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"trainer.grad_clip must be null or > 0, got {self.grad_clip}")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "TrainerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown trainer config keys {unknown}; expected a subset of {sorted(known)}")
        cfg = dict(cfg)
        if "betas" in cfg:
            cfg["betas"] = tuple(cfg["betas"])
        return cls(**cfg)
