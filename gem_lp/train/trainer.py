"""The training loop: AdamW + row-wise Adagrad, warm-up + decay, clipping, eval, checkpoints, exact resume."""
from __future__ import annotations

import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from gem_lp.data import DataError, DataSource, RecBatch, make_source
from gem_lp.models import GemRanker

from .checkpoint import (CheckpointError, load_checkpoint, remove_stale_temp_files, restore_rng_states, rng_states,
                         save_atomic, seed_everything, write_json_atomic)
from .config import RESUME_MAY_CHANGE, ConfigError, RunConfig, load_run_config, plain
from .logging_utils import KernelBuilds, Progress, Scalars, Stopwatch
from .metrics import mean_bce, normalized_entropy, roc_auc
from .optim import RowWiseAdagrad, warmup_decay_lambda
from .signals import StopRequests, TrainingInterrupted, ignore_sigint_in_worker

log = logging.getLogger("gem_lp.train")

TRAIN_LOSS_WINDOW = 50  # `train_loss` in metrics.json: mean over the last this many steps
METRICS_FILE = "metrics.json"
_STATE_KEYS = ("step", "model", "dense_optimizer", "embedding_optimizer", "dense_scheduler", "embedding_scheduler",
               "rng", "losses", "evals", "stopwatch", "model_config", "data_config", "trainer_config", "seed")


class NonFiniteError(RuntimeError):
    """The loss, a gradient or a gradient norm stopped being finite; raised before the optimizer step.

    Attributes: `step` (1-based), `tensors` (the names of the offending tensors: parameters whose gradient it
    is, or "training loss").
    """

    def __init__(self, message: str, step: int, tensors: list[str]):
        super().__init__(message)
        self.step = step
        self.tensors = tensors


class RunDirectoryInUse(FileExistsError):
    """The run's checkpoint file exists and `resume` is false: the run would overwrite it."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer=cpu (or trainer.device=cpu)")
    return torch.device(name)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated by torch on a GPU; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def checkpoint_path_of(config: RunConfig, run_dir: str | Path) -> Path:
    """`trainer.checkpoint_path`, or `<run_dir>/checkpoint.pt`; a directory there is a `ConfigError`."""
    path = Path(config.trainer.checkpoint_path) if config.trainer.checkpoint_path else Path(run_dir) / "checkpoint.pt"
    if path.is_dir():
        raise ConfigError(f"trainer.checkpoint_path: expected a file path, got the directory {path}")
    return path


def check_run_directory(config: RunConfig, run_dir: str | Path) -> Path:
    """The run's checkpoint path, after checking that starting the run overwrites no checkpoint: with
    `resume` false, an existing checkpoint file is a `RunDirectoryInUse` error naming the directory."""
    path = checkpoint_path_of(config, run_dir)
    if config.resume is False and path.is_file():
        raise RunDirectoryInUse(
            f"{path.parent} already holds a checkpoint ({path.name}) from an earlier run; pass resume=true to "
            f"continue it, or choose another run directory (hydra.run.dir=...); nothing was overwritten")
    return path


class Trainer:
    """Trains `GemRanker` on the data source that a composed config selects.

    Args:
        cfg: the composed Hydra config (`model`, `data`, `trainer`, `seed`, `resume`) or a `RunConfig`.
        run_dir: where `metrics.json`, `checkpoint.pt` and TensorBoard events go.
        source: a data pipeline of one's own (`gem_lp.data.DataSource`); default: the one `cfg.data` selects.
            `cfg.data` is still what a resume compares, so it should describe the source.
    """

    def __init__(self, cfg: DictConfig | RunConfig, run_dir: str | Path, source: DataSource | None = None):
        self.config = load_run_config(cfg)
        self.tcfg, self.mcfg, self.dcfg = self.config.trainer, self.config.model, self.config.data
        self.seed = self.config.seed
        self.run_dir = Path(run_dir)
        self.checkpoint_path = check_run_directory(self.config, self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (remove_stale_temp_files(self.checkpoint_path)
                      + remove_stale_temp_files(self.run_dir / METRICS_FILE)):
            log.warning("removed %s, the temp file of a write that was interrupted", stale)
        t = self.tcfg
        self.device = resolve_device(t.device)
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        seed_everything(self.seed)

        self.source = source if source is not None else make_source(self.dcfg, self.seed)
        self.model = GemRanker(self.mcfg, self.source.features).to(self.device)
        self.dense_optimizer = torch.optim.AdamW(self.model.dense_parameters(), lr=t.lr, betas=t.betas,
                                                 weight_decay=t.weight_decay)
        self.embedding_optimizer = RowWiseAdagrad(self.model.embedding_parameters(), lr=t.embedding_lr)
        schedule = warmup_decay_lambda(t.warmup_steps, t.max_steps, t.decay, t.min_lr_ratio)
        self.dense_scheduler = torch.optim.lr_scheduler.LambdaLR(self.dense_optimizer, schedule)
        self.embedding_scheduler = torch.optim.lr_scheduler.LambdaLR(self.embedding_optimizer, schedule)

        self.step = 0  # optimizer steps taken == index of the next training batch
        self.losses: list[float] = []  # training loss of every step, in order
        self.evals: list[dict[str, float]] = []
        self.resumes: list[dict[str, Any]] = []  # what each resume of this run found changed, and did
        self.stopwatch = Stopwatch()
        self.kernel_builds_after_warmup = 0  # in this process
        if self.config.resume is not False:
            self._resume(force=self.config.resume == "force")

        self.eval_batches: list[RecBatch] = self.source.eval_batches(t.eval_batches)
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
            "resumes": list(self.resumes),
            "stopwatch": (self.stopwatch.seconds, self.stopwatch.samples),  # steady-state steps only
            "model_config": plain(self.mcfg),
            "data_config": plain(self.dcfg),
            "trainer_config": plain(self.tcfg),
            "seed": self.seed,
        }

    def save_checkpoint(self) -> None:
        save_atomic(self._state(), self.checkpoint_path)

    def _resume(self, force: bool) -> None:
        path = self.checkpoint_path
        state = load_checkpoint(path)
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {missing}: not a training state of this gem-lp version")
        for section, now in (("model", self.mcfg), ("data", self.dcfg)):
            differences = _differences(state[f"{section}_config"], plain(now), section)
            if differences:
                raise ConfigError(f"resume: the checkpoint's {section} config differs from this run's "
                                  f"({'; '.join(differences)}); a run resumes with the model, data and seed it "
                                  f"started with")
        if state["seed"] != self.seed:
            raise ConfigError(f"resume: checkpoint seed {state['seed']} != seed {self.seed}; a run resumes with the "
                              f"model, data and seed it started with")
        saved, now = state["trainer_config"], plain(self.tcfg)
        changed = {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k]}
        refused = [k for k in changed if k not in RESUME_MAY_CHANGE]
        if refused and not force:
            raise ConfigError(
                f"resume=true: trainer settings differ from the checkpoint's ("
                + "; ".join(f"trainer.{k}: {changed[k][0]!r} in the checkpoint, {changed[k][1]!r} now" for k in refused)
                + f"); drop those overrides to continue as the run started, or pass resume=force to continue with "
                  f"the new values (recorded in {METRICS_FILE}). May change with resume=true: "
                + ", ".join(RESUME_MAY_CHANGE))
        self.model.load_state_dict(state["model"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        self.embedding_optimizer.load_state_dict(state["embedding_optimizer"])
        self.dense_scheduler.load_state_dict(state["dense_scheduler"])
        self.embedding_scheduler.load_state_dict(state["embedding_scheduler"])
        restore_rng_states(state["rng"])
        self.step = state["step"]
        self.losses = list(state["losses"])
        self.evals = list(state["evals"])
        self.resumes = list(state.get("resumes", []))
        self.stopwatch.seconds, self.stopwatch.samples = state["stopwatch"]
        if self.step >= self.tcfg.max_steps:
            raise ConfigError(f"resume: the checkpoint is at step {self.step}, already at "
                              f"trainer.max_steps={self.tcfg.max_steps}; raise trainer.max_steps to train further")
        if changed:
            self._apply_trainer_settings()
        self.resumes.append({"step": self.step, "checkpoint": str(path), "forced": bool(refused),
                             "changed": {f"trainer.{k}": {"checkpoint": a, "now": b} for k, (a, b) in changed.items()}})
        log.info("resumed from %s at step %d", path, self.step)
        for k, (a, b) in changed.items():
            (log.warning if k in refused else log.info)("resume: trainer.%s changed from %r to %r%s", k, a, b,
                                                         " (resume=force)" if k in refused else "")

    def _apply_trainer_settings(self) -> None:
        """After loading a checkpoint: this run's optimizer settings and LR schedule instead of the saved ones
        (the schedule's multiplier is recomputed at the current step)."""
        t = self.tcfg
        for group in self.dense_optimizer.param_groups:
            group["betas"], group["weight_decay"] = t.betas, t.weight_decay
        for optimizer, scheduler, base_lr in ((self.dense_optimizer, self.dense_scheduler, t.lr),
                                              (self.embedding_optimizer, self.embedding_scheduler, t.embedding_lr)):
            scheduler.base_lrs = [base_lr] * len(optimizer.param_groups)
            for group, multiplier in zip(optimizer.param_groups, scheduler.lr_lambdas):
                group["initial_lr"] = base_lr
                group["lr"] = base_lr * multiplier(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    # ---- evaluation --------------------------------------------------------------------------------

    def _teacher_metrics(self) -> dict[str, float | None]:
        labels = torch.cat([b.labels for b in self.eval_batches])
        classes = torch.unique(labels)
        if classes.numel() < 2:
            raise DataError(f"data: every one of the {labels.numel()} eval labels is {float(classes[0]):g}, so AUC "
                             f"and NE are undefined; the eval data needs both classes")
        out: dict[str, float | None] = {"eval_base_rate": float(labels.mean())}
        if all(b.teacher_logits is not None for b in self.eval_batches):
            logits = torch.cat([b.teacher_logits for b in self.eval_batches])
            out.update(teacher_auc=roc_auc(logits, labels), teacher_ne=normalized_entropy(logits, labels),
                       teacher_loss=mean_bce(logits, labels))
        else:  # real data: no planted teacher
            out.update(teacher_auc=None, teacher_ne=None, teacher_loss=None)
        return out

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
            raise NonFiniteError(f"step {self.step}: the model produced non-finite eval logits", self.step,
                                 ["eval logits"])
        return {"eval_loss": mean_bce(logits, labels), "eval_auc": roc_auc(logits, labels),
                "eval_ne": normalized_entropy(logits, labels)}

    # ---- training ----------------------------------------------------------------------------------

    def _train_loader(self) -> DataLoader:
        workers = self.tcfg.num_workers
        return DataLoader(self.source.train_dataset(self.step), batch_size=None, num_workers=workers,
                          pin_memory=self.device.type == "cuda", prefetch_factor=4 if workers > 0 else None,
                          persistent_workers=False, worker_init_fn=ignore_sigint_in_worker if workers else None)

    def _checked_loss(self, loss: torch.Tensor, names: list[str], grads: list[torch.Tensor],
                      norms: torch.Tensor, dense_norm: torch.Tensor, step: int) -> float:
        """The loss as a float, after checking it, every gradient's norm and the dense gradients' global norm
        finite: one device-to-host copy per step, after the backward is queued (a read of the loss before it
        would leave the GPU idle while the host queues the backward). Raises `NonFiniteError` otherwise."""
        values = torch.cat([loss.detach().float().reshape(1), norms.float(), dense_norm.float().reshape(1)]).cpu()
        value = float(values[0])
        if not math.isfinite(value):
            raise NonFiniteError(f"step {step}: training loss is {value} (non-finite); stopping before the "
                                 f"optimizer step{self._last_checkpoint_note()}", step, ["training loss"])
        if bool(torch.isfinite(values[1:]).all()):
            return value
        raise self._gradient_error(step, names, grads, values[1:-1].tolist(), float(values[-1]))

    def _gradient_error(self, step: int, names: list[str], grads: list[torch.Tensor], norms: list[float],
                        dense_norm: float) -> NonFiniteError:
        """Says what is not finite: gradient values (NaN/Inf in a tensor), or only a norm (finite values whose
        sum of squares overflows float32: the gradient norm's overflow, typically a too high learning rate)."""
        stop = f"stopping before the optimizer step{self._last_checkpoint_note()}"
        bad = [n for n, g in zip(names, grads) if not bool(torch.isfinite(g).all())]
        if bad:
            return NonFiniteError(f"step {step}: non-finite gradients in {_listed(bad)}; {stop}", step, bad)
        overflowed = [n for n, v in zip(names, norms) if not math.isfinite(v)]
        hint = f"the learning rate may be too high (trainer.lr={self.tcfg.lr:g}, trainer.embedding_lr=" \
               f"{self.tcfg.embedding_lr:g})"
        if overflowed:
            largest = max(float(g.detach().abs().max()) for n, g in zip(names, grads) if n in overflowed)
            return NonFiniteError(f"step {step}: overflow of the gradient norm of {_listed(overflowed)}: the values "
                                  f"are finite (largest magnitude {largest:.3g}) but their L2 norm overflows float32; "
                                  f"{hint}; {stop}", step, overflowed)
        top = sorted(zip(norms, names), reverse=True)[:3]
        return NonFiniteError(f"step {step}: overflow of the gradient norm: every gradient's norm is finite but the "
                              f"global norm of the dense gradients ({dense_norm}) overflows float32; largest: "
                              + ", ".join(f"{n} {v:.3g}" for v, n in top) + f"; {hint}; {stop}",
                              step, [n for _, n in top])

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
        tables = {id(p) for p in self.model.embedding_parameters()}
        named = sorted(((n, p) for n, p in self.model.named_parameters() if p.grad is not None),
                       key=lambda item: id(item[1]) not in tables)  # the tables first, then the dense parameters
        names, grads = [n for n, _ in named], [p.grad for _, p in named]
        num_tables = sum(id(p) in tables for _, p in named)
        norms = torch.stack(torch._foreach_norm(grads))  # per tensor, in the gradients' dtype as clipping does
        dense_norm = torch.linalg.vector_norm(norms[num_tables:])  # what gradient clipping scales by
        value = self._checked_loss(loss, names, grads, norms, dense_norm, step)
        if self.tcfg.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_([p for _, p in named[num_tables:]], self.tcfg.grad_clip, dense_norm)
        self.dense_optimizer.step()
        self.embedding_optimizer.step()
        self.dense_scheduler.step()
        self.embedding_scheduler.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.embedding_optimizer.zero_grad(set_to_none=True)
        return value

    def fit(self) -> dict[str, Any]:
        """Train up to `max_steps` (or `stop_after`), evaluating and checkpointing on the way; returns metrics.

        SIGINT / SIGTERM stop the run at the next step boundary: it writes a checkpoint and raises
        `TrainingInterrupted` (the command line exits with 130 / 143).
        """
        t = self.tcfg
        stop = t.stop_after if t.stop_after is not None else t.max_steps
        if self.step >= stop:
            raise ConfigError(f"trainer.stop_after: nothing to do, the run is already at step {self.step} and "
                              f"would stop at {stop}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        scalars = Scalars(str(self.run_dir / "tensorboard"), t.tensorboard)
        progress = Progress(total=stop, initial=self.step, bar=t.progress, log_every=t.log_every)
        teacher = self.teacher_metrics["teacher_auc"]
        log.info("%s on %s: %s parameters%s", self.mcfg.precision, self.device,
                 f"{sum(p.numel() for p in self.model.parameters()):,}",
                 f"; teacher eval AUC {teacher:.4f}" if teacher is not None else "")
        self.model.train()
        started = time.perf_counter()
        builds = KernelBuilds().start()
        try:
            with StopRequests() as stop_requests:
                loader = iter(self._train_loader())
                while self.step < stop:
                    if stop_requests.requested is not None:
                        self.save_checkpoint()
                        raise TrainingInterrupted(stop_requests.requested, self.step, str(self.checkpoint_path))
                    self._one_step(loader, stop, progress, scalars, builds)
        finally:
            builds.stop()
            progress.close()
            scalars.close()
        if self.kernel_builds_after_warmup:
            log.info("note: %d Triton kernel builds happened during timed steps (samples_per_s counts them; "
                     "samples_per_s_median_step is a typical step: %s)", self.kernel_builds_after_warmup,
                     f"{self.stopwatch.median_rate:,.0f}")
        metrics = self.metrics(wall_s=time.perf_counter() - started)
        write_json_atomic(metrics, self.run_dir / METRICS_FILE)
        return metrics

    def _one_step(self, loader, stop: int, progress: Progress, scalars: Scalars, builds: KernelBuilds) -> None:
        """A training step with its logging, and the eval and checkpoint that fall on it."""
        t = self.tcfg
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
            teacher = self.teacher_metrics["teacher_auc"]
            log.info("step %d: eval loss %.4f  AUC %.4f%s  NE %.4f", self.step, point["eval_loss"], point["eval_auc"],
                     f" (teacher {teacher:.4f})" if teacher is not None else "", point["eval_ne"])
        if self.step % t.checkpoint_every == 0 or self.step == stop:
            self.save_checkpoint()

    def _recent_train_loss(self) -> float:
        window = self.losses[-TRAIN_LOSS_WINDOW:]
        return sum(window) / len(window)

    def metrics(self, wall_s: float) -> dict[str, Any]:
        last = self.evals[-1]
        return {
            "precision": self.mcfg.precision,
            "backend": self.mcfg.backend,
            "steps": self.step,
            "max_steps": self.tcfg.max_steps,
            "batch_size": getattr(self.dcfg, "batch_size", None),
            "train_loss": self._recent_train_loss(),
            "train_loss_window": TRAIN_LOSS_WINDOW,
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
            "resumes": self.resumes,
            "eval_history": self.evals,
            "train_loss_history": self.losses,
        }


def _differences(saved: Any, now: Any, prefix: str) -> list[str]:
    """`key: saved -> now` for each leaf where two plain configs differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for k in sorted(set(saved) | set(now))
                for d in _differences(saved.get(k), now.get(k), f"{prefix}.{k}")]
    return [] if saved == now else [f"{prefix}: {saved!r} in the checkpoint, {now!r} now"]


def _listed(names: list[str]) -> str:
    return str(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def train(cfg: DictConfig | RunConfig, run_dir: str | Path) -> dict[str, Any]:
    """Build a `Trainer` from `cfg` and run it; returns the metrics written to `<run_dir>/metrics.json`."""
    return Trainer(cfg, run_dir).fit()
