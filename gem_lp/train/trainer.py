"""The training loop: AdamW + row-wise Adagrad, warm-up + decay, clipping, eval, checkpoints, exact resume."""
from __future__ import annotations

import math
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gem_lp.data import PlantedTeacher, RecBatch, SyntheticDataConfig, SyntheticRecDataset
from gem_lp.models import GemModelConfig, GemRanker

from .checkpoint import load_checkpoint, restore_rng_states, rng_states, save_atomic, seed_everything, write_json_atomic
from .config import TrainerConfig
from .logging_utils import KernelBuilds, Progress, Scalars, Stopwatch
from .metrics import mean_bce, normalized_entropy, roc_auc
from .optim import RowWiseAdagrad, warmup_decay_lambda

_TRAIN_LOSS_WINDOW = 50  # `train_loss` in metrics.json: mean over the last this many steps


class NonFiniteError(RuntimeError):
    """Raised when the loss or a gradient stops being finite; the message names the step."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer=cpu")
    return torch.device(name)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated by torch on a GPU; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Trainer:
    """Trains `GemRanker` on the synthetic task described by a composed Hydra config.

    Args:
        cfg: the composed config (`model`, `data`, `trainer`, `seed`, `resume`).
        run_dir: where `metrics.json`, `checkpoint.pt` and TensorBoard events go.
    """

    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tcfg = TrainerConfig.from_mapping(OmegaConf.to_container(cfg.trainer, resolve=True))
        self.mcfg = GemModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
        self.dcfg = SyntheticDataConfig.from_mapping(OmegaConf.to_container(cfg.data, resolve=True))
        self.seed = int(cfg.seed)
        self.device = resolve_device(self.tcfg.device)
        if self.tcfg.num_threads is not None:
            torch.set_num_threads(self.tcfg.num_threads)
        seed_everything(self.seed)

        self.teacher = PlantedTeacher(self.dcfg)
        self.model = GemRanker(self.mcfg, self.dcfg).to(self.device)
        t = self.tcfg
        self.dense_optimizer = torch.optim.AdamW(self.model.dense_parameters(), lr=t.lr, betas=t.betas,
                                                 weight_decay=t.weight_decay)
        self.embedding_optimizer = RowWiseAdagrad(self.model.embedding_parameters(), lr=t.embedding_lr)
        schedule = warmup_decay_lambda(t.warmup_steps, t.max_steps, t.decay, t.min_lr_ratio)
        self.dense_scheduler = torch.optim.lr_scheduler.LambdaLR(self.dense_optimizer, schedule)
        self.embedding_scheduler = torch.optim.lr_scheduler.LambdaLR(self.embedding_optimizer, schedule)

        self.step = 0  # optimizer steps taken == index of the next training batch
        self.losses: list[float] = []  # training loss of every step, in order
        self.evals: list[dict[str, float]] = []
        self.stopwatch = Stopwatch()
        self.kernel_builds_after_warmup = 0  # in this process
        self.checkpoint_path = Path(t.checkpoint_path) if t.checkpoint_path else self.run_dir / "checkpoint.pt"
        if bool(cfg.get("resume", False)):
            self._resume()

        eval_set = SyntheticRecDataset(self.dcfg, self.seed, "eval", num_batches=t.eval_batches, teacher=self.teacher)
        self.eval_batches: list[RecBatch] = list(eval_set)
        self.teacher_metrics = self._teacher_metrics()

    # ---- bookkeeping -------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "next_batch_index": self.step,
            "model": self.model.state_dict(),
            "dense_optimizer": self.dense_optimizer.state_dict(),
            "embedding_optimizer": self.embedding_optimizer.state_dict(),
            "dense_scheduler": self.dense_scheduler.state_dict(),
            "embedding_scheduler": self.embedding_scheduler.state_dict(),
            "rng": rng_states(),
            "losses": list(self.losses),
            "evals": list(self.evals),
            "stopwatch": (self.stopwatch.seconds, self.stopwatch.samples),  # steady-state steps only
            "model_config": OmegaConf.to_container(self.cfg.model, resolve=True),
            "data_config": OmegaConf.to_container(self.cfg.data, resolve=True),
            "seed": self.seed,
        }

    def save_checkpoint(self) -> None:
        save_atomic(self._state(), self.checkpoint_path)

    def _resume(self) -> None:
        state = load_checkpoint(self.checkpoint_path)
        for key, now in (("model_config", self.cfg.model), ("data_config", self.cfg.data)):
            now = OmegaConf.to_container(now, resolve=True)
            if state[key] != now:
                raise ValueError(f"resume=true: the checkpoint's {key.split('_')[0]} config differs from this "
                                 f"run's; exact resume needs the same one.\n checkpoint: {state[key]}\n now: {now}")
        if state["seed"] != self.seed:
            raise ValueError(f"resume=true: checkpoint seed {state['seed']} != seed {self.seed}")
        self.model.load_state_dict(state["model"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        self.embedding_optimizer.load_state_dict(state["embedding_optimizer"])
        self.dense_scheduler.load_state_dict(state["dense_scheduler"])
        self.embedding_scheduler.load_state_dict(state["embedding_scheduler"])
        restore_rng_states(state["rng"])
        self.step = state["step"]
        self.losses = list(state["losses"])
        self.evals = list(state["evals"])
        self.stopwatch.seconds, self.stopwatch.samples = state["stopwatch"]
        if self.step >= self.tcfg.max_steps:
            raise ValueError(f"resume=true: the checkpoint is at step {self.step}, already at "
                             f"trainer.max_steps={self.tcfg.max_steps}")

    # ---- evaluation --------------------------------------------------------------------------------

    def _teacher_metrics(self) -> dict[str, float]:
        logits = torch.cat([b.teacher_logits for b in self.eval_batches])
        labels = torch.cat([b.labels for b in self.eval_batches])
        return {"teacher_auc": roc_auc(logits, labels), "teacher_ne": normalized_entropy(logits, labels),
                "teacher_loss": mean_bce(logits, labels), "eval_base_rate": float(labels.mean())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (mean BCE), AUC and NE of the model on the fixed eval batches."""
        was_training = self.model.training
        self.model.eval()
        logits, labels = [], []
        for batch in self.eval_batches:
            logits.append(self.model(batch.to(self.device)).float().cpu())
            labels.append(batch.labels)
        self.model.train(was_training)
        logits, labels = torch.cat(logits), torch.cat(labels)
        if not torch.isfinite(logits).all():
            raise NonFiniteError(f"step {self.step}: the model produced non-finite eval logits")
        return {"eval_loss": mean_bce(logits, labels), "eval_auc": roc_auc(logits, labels),
                "eval_ne": normalized_entropy(logits, labels)}

    # ---- training ----------------------------------------------------------------------------------

    def _train_loader(self) -> DataLoader:
        dataset = SyntheticRecDataset(self.dcfg, self.seed, "train", start=self.step, teacher=self.teacher)
        workers = self.tcfg.num_workers
        return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=self.device.type == "cuda",
                          prefetch_factor=4 if workers > 0 else None, persistent_workers=False)

    def _checked_loss(self, loss: torch.Tensor, dense_norm: torch.Tensor | None, step: int) -> float:
        """The loss as a float, after checking it and the gradients finite: one device-to-host copy per step,
        after the backward is queued (a read of the loss before it would leave the GPU idle while the host
        queues the backward). Raises `NonFiniteError` before the optimizer step otherwise."""
        norms = [p.grad.detach().norm() for p in self.model.embedding_parameters() if p.grad is not None]
        if dense_norm is not None:
            norms.append(dense_norm.detach())
        else:
            norms += [p.grad.detach().norm() for p in self.model.dense_parameters() if p.grad is not None]
        values = torch.stack([loss.detach().float()] + [n.float() for n in norms]).cpu()  # the one sync
        value = float(values[0])
        if not math.isfinite(value):
            raise NonFiniteError(f"step {step}: training loss is {value} (non-finite); stopping before the "
                                 f"optimizer step{self._last_checkpoint_note()}")
        if not bool(torch.isfinite(values[1:]).all()):
            bad = [name for name, p in self.model.named_parameters()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            raise NonFiniteError(f"step {step}: non-finite gradients in {bad[:5]}{' ...' if len(bad) > 5 else ''}; "
                                 f"stopping before the optimizer step{self._last_checkpoint_note()}")
        return value

    def _last_checkpoint_note(self) -> str:
        if self.checkpoint_path.is_file():
            return f" (last checkpoint: {self.checkpoint_path})"
        return " (no checkpoint written yet)"

    def train_step(self, batch: RecBatch, step: int) -> float:
        """One optimizer step on `batch`; `step` is its 1-based number (for messages). Returns the loss."""
        batch = batch.to(self.device, non_blocking=True)
        logits = self.model(batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())
        loss.backward()
        dense_norm = None
        if self.tcfg.grad_clip is not None:
            dense_norm = torch.nn.utils.clip_grad_norm_(self.model.dense_parameters(), self.tcfg.grad_clip)
        value = self._checked_loss(loss, dense_norm, step)
        self.dense_optimizer.step()
        self.embedding_optimizer.step()
        self.dense_scheduler.step()
        self.embedding_scheduler.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.embedding_optimizer.zero_grad(set_to_none=True)
        return value

    def fit(self) -> dict[str, Any]:
        """Train up to `max_steps` (or `stop_after`), evaluating and checkpointing on the way; returns metrics."""
        t = self.tcfg
        stop = t.stop_after if t.stop_after is not None else t.max_steps
        if self.step >= stop:
            raise ValueError(f"nothing to do: already at step {self.step}, stop at {stop}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        scalars = Scalars(str(self.run_dir / "tensorboard"), t.tensorboard)
        progress = Progress(total=stop, initial=self.step, enabled=t.progress, log_every=t.log_every)
        progress.write(f"{self.mcfg.precision} on {self.device}: {sum(p.numel() for p in self.model.parameters()):,} "
                       f"parameters; teacher eval AUC {self.teacher_metrics['teacher_auc']:.4f}")
        self.model.train()
        started = time.perf_counter()
        builds = KernelBuilds().start()
        try:
            loader = iter(self._train_loader())
            while self.step < stop:
                steady, builds_before = self.stopwatch.steady, builds.count
                self.stopwatch.start()
                batch = next(loader)
                loss = self.train_step(batch, self.step + 1)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.stopwatch.stop(batch.batch_size)
                if steady:
                    self.kernel_builds_after_warmup += builds.count - builds_before
                self.step += 1
                self.losses.append(loss)
                lr = self.dense_scheduler.get_last_lr()[0]
                progress.update(self.step, loss, self.stopwatch.rate, lr)
                if self.step % t.log_every == 0:
                    scalars.add("train/loss", loss, self.step)
                    scalars.add("train/lr", lr, self.step)
                    scalars.add("train/samples_per_s", self.stopwatch.rate, self.step)
                if self.step % t.eval_every == 0 or self.step == stop:
                    point = {"step": self.step, "train_loss": self._recent_train_loss(), **self.evaluate()}
                    self.evals.append(point)
                    for key in ("eval_loss", "eval_auc", "eval_ne"):
                        scalars.add(f"eval/{key[5:]}", point[key], self.step)
                    progress.write(f"step {self.step}: eval loss {point['eval_loss']:.4f}  AUC {point['eval_auc']:.4f} "
                                   f"(teacher {self.teacher_metrics['teacher_auc']:.4f})  NE {point['eval_ne']:.4f}")
                if self.step % t.checkpoint_every == 0 or self.step == stop:
                    self.save_checkpoint()
        finally:
            builds.stop()
            progress.close()
            scalars.close()
        if self.kernel_builds_after_warmup:
            progress.write(f"note: {self.kernel_builds_after_warmup} Triton kernel builds happened during timed steps "
                           f"(samples_per_s counts them; samples_per_s_median_step is a typical step: "
                           f"{self.stopwatch.median_rate:,.0f})")
        metrics = self.metrics(wall_s=time.perf_counter() - started)
        write_json_atomic(metrics, self.run_dir / "metrics.json")
        return metrics

    def _recent_train_loss(self) -> float:
        window = self.losses[-_TRAIN_LOSS_WINDOW:]
        return sum(window) / len(window)

    def metrics(self, wall_s: float) -> dict[str, Any]:
        last = self.evals[-1]
        return {
            "precision": self.mcfg.precision,
            "backend": self.mcfg.backend,
            "steps": self.step,
            "max_steps": self.tcfg.max_steps,
            "batch_size": self.dcfg.batch_size,
            "train_loss": self._recent_train_loss(),
            "eval_loss": last["eval_loss"],
            "eval_auc": last["eval_auc"],
            "eval_ne": last["eval_ne"],
            **self.teacher_metrics,
            "samples_per_s": self.stopwatch.rate,
            "samples_per_s_median_step": self.stopwatch.median_rate,
            "kernel_builds_after_warmup": self.kernel_builds_after_warmup,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "wall_s": wall_s,
            "seed": self.seed,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "eval_history": self.evals,
            "train_loss_history": self.losses,
        }


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Build a `Trainer` from `cfg` and run it; returns the metrics written to `<run_dir>/metrics.json`."""
    return Trainer(cfg, run_dir).fit()
