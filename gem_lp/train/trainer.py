"""The training loop: AdamW + row-wise Adagrad, warm-up + decay, clipping, eval, checkpoints, exact resume; on one
process, or on several under torchrun (TorchRec model parallelism, see `gem_lp.train.sharding`)."""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import resource
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from gem_lp.data import DataError, DataSource, RankSlices, RecBatch, make_source, rank_bounds, rank_slice
from gem_lp.models import GemRanker
from gem_lp.runtime import dispatch

from .checkpoint import (CheckpointError, load_checkpoint, load_sharded, remove_stale_shards, remove_stale_temp_files,
                         restore_rng_states, rng_states, save_atomic, save_sharded, seed_everything, verify_shards,
                         write_json_atomic)
from .config import RESUME_MAY_CHANGE, ConfigError, RunConfig, load_run_config, plain
from .distributed import LaunchEnv, ProcessGroup, launch_env, rank_device
from .logging_utils import KernelBuilds, Progress, Scalars, Stopwatch
from .metrics import mean_bce, normalized_entropy, roc_auc
from .optim import RowWiseAdagrad, warmup_decay_lambda
from .sharding import shard_model
from .signals import StopRequests, TrainingInterrupted, ignore_sigint_in_worker

log = logging.getLogger("gem_lp.train")

TRAIN_LOSS_WINDOW = 50  # `train_loss` in metrics.json: mean over the last this many steps
METRICS_FILE = "metrics.json"
_STATE_KEYS = ("step", "model", "dense_optimizer", "embedding_optimizer", "dense_scheduler", "embedding_scheduler",
               "rng", "losses", "evals", "stopwatch", "model_config", "data_config", "trainer_config", "seed")
# The checkpoint file of a multi-process run: the model (and the fused optimizer's state) are in its shards; RNG
# and embedding scheduler states are per rank.
_SHARDED_STATE_KEYS = ("step", "dense_optimizer", "dense_scheduler", "losses", "evals", "stopwatch", "model_config",
                       "data_config", "trainer_config", "seed", "world_size", "sharding_plan", "shards", "rank_states")


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

    def __init__(self, cfg: DictConfig | RunConfig, run_dir: str | Path, source: DataSource | None = None,
                 launch: LaunchEnv | None = None):
        """`launch`: this process's rank in a multi-process launch; default: torchrun's environment variables (none
        set: one process). Several processes share `data.batch_size` (the global batch) and the run directory."""
        self.config = load_run_config(cfg)
        self.tcfg, self.mcfg, self.dcfg = self.config.trainer, self.config.model, self.config.data
        self.seed = self.config.seed
        self.run_dir = Path(run_dir)
        self.checkpoint_path = check_run_directory(self.config, self.run_dir)
        self.launch = launch if launch is not None else launch_env()
        self.rank, self.world_size = (self.launch.rank, self.launch.world_size) if self.launch else (0, 1)
        self.is_main = self.rank == 0  # writes the run's files and logs; every rank writes its own shards
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            for stale in (remove_stale_temp_files(self.checkpoint_path)
                          + remove_stale_temp_files(self.run_dir / METRICS_FILE)):
                log.warning("removed %s, the temp file of a write that was interrupted", stale)
        t = self.tcfg
        self.device = resolve_device(t.device)
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        one_cuda_process = self.device.type == "cuda" and self.launch is None
        self.cuda_graphs = one_cuda_process if t.cuda_graphs is None else t.cuda_graphs
        if t.cuda_graphs and not one_cuda_process:
            raise ConfigError(f"trainer.cuda_graphs=true needs one process on a CUDA device, got device "
                              f"{self.device}{' under a multi-process launch' if self.launch is not None else ''}")
        self.group: ProcessGroup | None = None
        if self.launch is not None:
            self.device = rank_device(self.device, self.launch)
            self.group = ProcessGroup(self.launch, self.device, t.dist_timeout_s)
        try:
            self._build(source)
        except BaseException:
            self.close()
            raise

    def _build(self, source: DataSource | None) -> None:
        """The data source, the model (sharded on several processes), optimizers, schedulers, and the resumed state."""
        t = self.tcfg
        seed_everything(self.seed)

        self.source = source if source is not None else make_source(self.dcfg, self.seed)
        self.model = GemRanker(self.mcfg, self.source.features).to(self.device)
        self.network: torch.nn.Module = self.model  # what the forward pass calls
        # what runs where (first use on a GPU self-checks the kernels not yet verified on it)
        self.kernel_plan = dispatch.kernel_plan(self.model.kernel_ops(), self.device, self.mcfg.backend)
        unsafe = [c for c in self.kernel_plan if not c["capture_safe"]]
        # the sequence part (attention and the linears around it) runs from CUDA graphs only where all of it can
        self.graphs_off_because = (f"{unsafe[0]['op']} ({unsafe[0]['precision']}) runs {unsafe[0]['impl']} on "
                                   f"{unsafe[0]['arch']}, which a CUDA graph cannot capture") if unsafe else None
        self.sharding_plan: dict[str, dict[str, Any]] | None = None
        self.fused_tables = False  # the tables are sharded, updated inside the backward by TorchRec's optimizer
        if self.group is not None:
            sharded = shard_model(self.model, GemRanker.embedding_tables(self.source.features), t, self.launch,
                                  self.group)
            self.network, self.sharding_plan, self.fused_tables = sharded.module, sharded.plan, sharded.fused
            self.model = sharded.module.module  # the GemRanker inside, its embedding modules sharded
        # fused: its step takes `found_inf`, so that a step with a non-finite loss or gradient is skipped on the
        # device and the host reads the check only after the step is queued (see train_step)
        self.dense_optimizer = torch.optim.AdamW(self.model.dense_parameters(), lr=t.lr, betas=t.betas,
                                                 weight_decay=t.weight_decay, fused=True)
        if self.fused_tables:
            self.embedding_optimizer = self.network.fused_optimizer
        else:
            self.embedding_optimizer = RowWiseAdagrad(self.model.embedding_parameters(), lr=t.embedding_lr,
                                                      weight_decay=t.embedding_weight_decay)
        schedule = warmup_decay_lambda(t.warmup_steps, t.max_steps, t.decay, t.min_lr_ratio)
        self.dense_scheduler = torch.optim.lr_scheduler.LambdaLR(self.dense_optimizer, schedule)
        self.embedding_scheduler = torch.optim.lr_scheduler.LambdaLR(self.embedding_optimizer, schedule)

        self.step = 0  # optimizer steps taken == index of the next training batch
        self.losses: list[float] = []  # training loss of every step, in order
        self.evals: list[dict[str, float]] = []
        self.resumes: list[dict[str, Any]] = []  # what each resume of this run found changed, and did
        self.stopwatch = Stopwatch()
        self.kernel_builds_after_warmup = 0  # in this process
        self._stop_requests: StopRequests | None = None  # while fit() runs
        # one process on a GPU: the host reads each step's check one step late (see _one_step)
        self.pipelined = self.device.type == "cuda" and self.group is None
        self._queued: _QueuedStep | None = None
        self._agreed_stop: int | None = None  # a stop signal that some rank received, known to every rank
        shards_in_use = None
        if self.config.resume is not False:
            shards_in_use = self._resume(force=self.config.resume == "force")
        if self.group is not None and self.is_main:
            for stale in remove_stale_shards(self.checkpoint_path, keep=shards_in_use):
                log.warning("removed %s, sharded state that no checkpoint file names (an interrupted or superseded "
                            "save)", stale)
        if self.fused_tables:
            self.embedding_optimizer.zero_grad()  # hands the scheduled LR to the fused kernels (see train_step)

        self.teacher_metrics = self._teacher_metrics()  # also counts the eval rows
        self.data_fingerprint = self._data_fingerprint()
        if self.is_main:
            self._log_eval_coverage()

    def close(self) -> None:
        """End this rank's part in the process group (no-op on one process); call it once the run is over."""
        if self.group is not None:
            self.group.close()
            self.group = None

    # ---- bookkeeping -------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The checkpoint file's contents on one process (on several, `_sharded_state` adds to them)."""
        state = {
            "step": self.step,
            "next_batch_index": self.step,
            "dense_optimizer": self.dense_optimizer.state_dict(),
            "dense_scheduler": self.dense_scheduler.state_dict(),
            "losses": list(self.losses),
            "evals": list(self.evals),
            "resumes": list(self.resumes),
            "stopwatch": (self.stopwatch.seconds, self.stopwatch.samples),  # steady-state steps only
            "model_config": plain(self.mcfg),
            "data_config": plain(self.dcfg),
            "trainer_config": plain(self.tcfg),
            "seed": self.seed,
        }
        if self.group is None:
            state.update(model=self.model.state_dict(), embedding_optimizer=self.embedding_optimizer.state_dict(),
                         embedding_scheduler=self.embedding_scheduler.state_dict(), rng=rng_states())
        elif not self.fused_tables:  # data parallel: the tables' optimizer state is the same on every rank
            state["embedding_optimizer"] = self.embedding_optimizer.state_dict()
        return state

    def _sharded_tensors(self) -> dict[str, Any]:
        """What a multi-process checkpoint keeps through torch.distributed.checkpoint: the model (sharded tables
        as ShardedTensors, written by their owners) and the fused optimizer's state of the sharded tables."""
        tensors = {"model": self.network.state_dict()}
        if self.fused_tables:
            tensors["embedding_optimizer"] = self.embedding_optimizer.state_dict()
        return tensors

    def save_checkpoint(self) -> None:
        if self.group is None:
            save_atomic(self._state(), self.checkpoint_path)
            return
        shards = save_sharded(self._sharded_tensors(), self.checkpoint_path, self.step, self.group)
        rank_states = self.group.gather_objects({"rng": rng_states(),
                                                 "embedding_scheduler": self.embedding_scheduler.state_dict()})
        if self.is_main:
            save_atomic({**self._state(), "world_size": self.world_size, "sharding_plan": self.sharding_plan,
                         "shards": shards, "rank_states": rank_states}, self.checkpoint_path)
            remove_stale_shards(self.checkpoint_path, keep=shards["dir"])
        self.group.barrier()  # every rank sees the new checkpoint file from here on

    def _resume(self, force: bool) -> str | None:
        """Load the checkpoint; returns the name of the shard directory it uses (None on one process)."""
        path = self.checkpoint_path
        state = load_checkpoint(path)
        if ("shards" in state) != (self.group is not None):
            raise ConfigError(
                f"resume: checkpoint {path} was written by "
                + (f"torchrun ({state.get('world_size')} process(es)); resume it with torchrun on as many processes"
                   if "shards" in state else "a single process (no torchrun); resume it without torchrun"))
        if self.group is not None and state["world_size"] != self.world_size:
            raise ConfigError(f"resume: checkpoint {path} was written by {state['world_size']} process(es), this run "
                              f"has {self.world_size}; a run resumes on the number of processes it was written with")
        missing = [k for k in (_STATE_KEYS if self.group is None else _SHARDED_STATE_KEYS) if k not in state]
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
                "resume=true: trainer settings differ from the checkpoint's ("
                + "; ".join(f"trainer.{k}: {changed[k][0]!r} in the checkpoint, {changed[k][1]!r} now" for k in refused)
                + f"); drop those overrides to continue as the run started, or pass resume=force to continue with "
                  f"the new values (recorded in {METRICS_FILE}). May change with resume=true: "
                + ", ".join(RESUME_MAY_CHANGE))
        if self.group is None:
            self.model.load_state_dict(state["model"])
            rank_state = {"rng": state["rng"], "embedding_scheduler": state["embedding_scheduler"]}
        else:
            rank_state = self._load_sharded(state)
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        if not self.fused_tables:
            self.embedding_optimizer.load_state_dict(state["embedding_optimizer"])
        self.dense_scheduler.load_state_dict(state["dense_scheduler"])
        self.embedding_scheduler.load_state_dict(rank_state["embedding_scheduler"])
        if self.fused_tables:  # the scheduled LR, exactly as it was after the last step
            for group, lr in zip(self.embedding_optimizer.param_groups, self.embedding_scheduler.get_last_lr()):
                group["lr"] = lr
        restore_rng_states(rank_state["rng"])
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
        if self.is_main:
            log.info("resumed from %s at step %d", path, self.step)
            for k, (a, b) in changed.items():
                (log.warning if k in refused else log.info)("resume: trainer.%s changed from %r to %r%s", k, a, b,
                                                             " (resume=force)" if k in refused else "")
        return state["shards"]["dir"] if self.group is not None else None

    def _load_sharded(self, state: dict[str, Any]) -> dict[str, Any]:
        """A multi-process checkpoint's model and fused optimizer state, after checking its plan and the checksums
        of its shards (rank 0 reads them all; every rank then stops on the same error); returns this rank's RNG and
        embedding scheduler states."""
        path = self.checkpoint_path
        if state["sharding_plan"] != self.sharding_plan:
            differences = _differences(state["sharding_plan"], self.sharding_plan, "plan")
            raise ConfigError(f"resume: the sharding plan differs from the checkpoint's ({'; '.join(differences)}); "
                              f"a sharded checkpoint resumes with the plan it was written with (trainer.sharding, "
                              f"trainer.table_sharding)")
        error = self.group.broadcast_object(verify_shards(path, state["shards"]) if self.is_main else None)
        if error is not None:
            raise CheckpointError(error)
        tensors = self._sharded_tensors()
        load_sharded(tensors, path, state["shards"])
        self.network.load_state_dict(tensors["model"])
        if self.fused_tables:
            self.embedding_optimizer.load_state_dict(tensors["embedding_optimizer"])
        return state["rank_states"][self.rank]

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

    def _eval_batches(self):
        """The eval set's batches, as many as `trainer.eval_batches` allows (null: all), built as they come."""
        return self.source.eval_batches(self.tcfg.eval_batches)

    def _teacher_metrics(self) -> dict[str, float | None]:
        """The eval labels' base rate and the planted teacher's figures (None on real data), from one pass over the
        eval batches, which also counts the rows evaluated (`eval_rows`) and refuses labels of one class."""
        labels, teacher = [], []
        for batch in self._eval_batches():
            labels.append(batch.labels)
            teacher.append(batch.teacher_logits)
        if not labels:
            raise DataError("data: the eval set is empty; the eval data needs rows of both classes")
        labels = torch.cat(labels)
        self.eval_rows = labels.numel()
        total = getattr(self.source, "num_eval_rows", None)
        self.eval_rows_total = total if total is not None or self.tcfg.eval_batches is not None else self.eval_rows
        classes = torch.unique(labels)
        if classes.numel() < 2:
            raise DataError(f"data: every one of the {labels.numel()} eval labels is {float(classes[0]):g}, so AUC "
                            f"and NE are undefined; the eval data needs both classes")
        out: dict[str, float | None] = {"eval_base_rate": float(labels.mean())}
        if all(t is not None for t in teacher):
            logits = torch.cat(teacher)
            out.update(teacher_auc=roc_auc(logits, labels), teacher_ne=normalized_entropy(logits, labels),
                       teacher_loss=mean_bce(logits, labels))
        else:  # real data: no planted teacher
            out.update(teacher_auc=None, teacher_ne=None, teacher_loss=None)
        return out

    def _data_fingerprint(self) -> dict[str, Any]:
        """`metrics.json`'s `data`: the source's own fingerprint, or (a source without one) its type and config."""
        fingerprint = getattr(self.source, "fingerprint", None)
        if fingerprint is not None:
            return fingerprint()
        return {"source": type(self.source).__name__, "config": plain(self.dcfg)}

    def _log_eval_coverage(self) -> None:
        rows, total, limit = self.eval_rows, self.eval_rows_total, self.tcfg.eval_batches
        if total is not None and rows == total:
            log.info("eval: all %s eval rows", f"{rows:,}")
        else:
            log.info("eval: %s of %s eval rows (trainer.eval_batches=%d caps it; null evaluates them all)",
                     f"{rows:,}", "an unknown number" if total is None else f"{total:,}", limit)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (mean BCE), AUC and NE of the model on the eval set (`trainer.eval_batches` of it, null: all).

        The batches are built as they come and dropped once scored. On several processes each rank scores its slice
        of every eval batch; one all-gather brings every logit to every rank, in the order of one process, and the
        metrics are computed as on one process, over all samples. Every rank must call it then (it runs
        collectives).
        """
        was_training = self.network.training
        self.network.eval()
        logits, labels, sizes = [], [], []
        for batch in self._eval_batches():
            labels.append(batch.labels)
            sizes.append(batch.batch_size)
            part = rank_slice(batch, self.rank, self.world_size) if self.group is not None else batch
            logits.append(self.network(part.to(self.device)).float())
        self.network.train(was_training)
        logits = torch.cat(logits) if self.group is None else self._gathered_eval_logits(logits, sizes)
        logits, labels = logits.cpu(), torch.cat(labels)
        if labels.numel() != self.eval_rows:
            raise DataError(f"data: the eval set held {self.eval_rows} rows when the run started and {labels.numel()} "
                            f"now; a source's eval batches must be the same at every evaluation")
        if not torch.isfinite(logits).all():
            raise NonFiniteError(f"step {self.step}: the model produced non-finite eval logits", self.step,
                                 ["eval logits"])
        return {"eval_loss": mean_bce(logits, labels), "eval_auc": roc_auc(logits, labels),
                "eval_ne": normalized_entropy(logits, labels)}

    def _gathered_eval_logits(self, logits: list[torch.Tensor], batch_sizes: list[int]) -> torch.Tensor:
        """Every rank's eval logits (`logits[i]`: this rank's slice of eval batch `i`, of `batch_sizes[i]` samples)
        in the order of the eval batches, through one all-gather (each rank's logits padded to the longest rank's
        count for it, the padding dropped again)."""
        sizes = [[stop - start for start, stop in (rank_bounds(b, r, self.world_size) for b in batch_sizes)]
                 for r in range(self.world_size)]
        longest = max(sum(per_batch) for per_batch in sizes)
        mine = torch.cat(logits)
        padded = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
        gathered = self.group.gather(padded)
        per_rank = [gathered[r, :sum(sizes[r])].split(sizes[r]) for r in range(self.world_size)]
        return torch.cat([per_rank[r][i] for i in range(len(batch_sizes)) for r in range(self.world_size)])

    # ---- training ----------------------------------------------------------------------------------

    def _train_loader(self) -> DataLoader:
        workers = self.tcfg.num_workers
        dataset = self.source.train_dataset(self.step)
        if self.group is not None:
            dataset = RankSlices(dataset, self.rank, self.world_size)
        return DataLoader(dataset, batch_size=None, num_workers=workers,
                          pin_memory=self.device.type == "cuda", prefetch_factor=4 if workers > 0 else None,
                          persistent_workers=False, worker_init_fn=ignore_sigint_in_worker if workers else None)

    def _checked_loss(self, checks: torch.Tensor, names: list[str], grads: list[torch.Tensor], step: int) -> float:
        """The loss as a float, after checking it, every gradient's norm and the dense gradients' global norm
        (`checks`: `[loss, norms..., dense norm]`) finite: one device-to-host copy per step, after the optimizer
        step is queued (which skipped the update when they were not finite). Raises `NonFiniteError` otherwise."""
        values = checks.cpu()
        value = float(values[0])
        if not math.isfinite(value):
            raise NonFiniteError(f"step {step}: training loss is {value} (non-finite); stopping before the "
                                 f"optimizer step{self._last_checkpoint_note()}", step, ["training loss"])
        if bool(torch.isfinite(values[1:]).all()):
            return value
        raise self._gradient_error(step, names, grads, values[1:-1].tolist(), float(values[-1]))

    def _agreed_loss(self, loss_sum: torch.Tensor, global_batch_size: int, names: list[str],
                     grads: list[torch.Tensor], norms: torch.Tensor, dense_norm: torch.Tensor, step: int) -> float:
        """On several processes: the whole batch's mean loss, after every rank has learnt whether any rank found a
        non-finite loss or gradient (then every rank raises `NonFiniteError`, before the optimizer step) and
        whether any rank was asked to stop (`_agreed_stop`, for the next step boundary). One all-reduce per step:
        `[loss sum, non-finite flag of each rank, stop signal of each rank]`."""
        world, rank = self.world_size, self.rank
        local = torch.cat([loss_sum.detach().float().reshape(1), norms.float(), dense_norm.float().reshape(1)])
        slots = torch.zeros(1 + 2 * world, dtype=torch.float64, device=self.device)
        slots[0] = loss_sum.detach().double()
        slots[1 + rank] = (~torch.isfinite(local)).any().double()
        requested = self._stop_requests.requested if self._stop_requests is not None else None
        slots[1 + world + rank] = float(requested or 0)
        values = torch.cat([self.group.sum(slots), local.double()]).cpu()
        total, local = values[:1 + 2 * world], values[1 + 2 * world:]
        signals = [int(v) for v in total[1 + world:].tolist() if v > 0]
        self._agreed_stop = signals[0] if signals else None
        bad_ranks = [r for r in range(world) if total[1 + r] > 0]
        if not bad_ranks:
            return float(total[0]) / global_batch_size
        note = " (every rank stops)"
        if rank not in bad_ranks:
            raise NonFiniteError(
                f"step {step}: rank(s) {bad_ranks} found a non-finite training loss or gradient; every rank stops "
                f"before the optimizer step{self._last_checkpoint_note()}", step, [f"rank {r}" for r in bad_ranks])
        if not math.isfinite(float(local[0])):
            raise NonFiniteError(f"step {step}: training loss of rank {rank}'s samples is {float(local[0])} "
                                 f"(non-finite); stopping before the optimizer step{self._last_checkpoint_note()}"
                                 f"{note}", step, ["training loss"])
        error = self._gradient_error(step, names, grads, local[1:-1].tolist(), float(local[-1]))
        raise NonFiniteError(str(error) + note, error.step, error.tensors)

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

    def train_step(self, batch: RecBatch, step: int, global_batch_size: int | None = None) -> float:
        """One optimizer step on `batch`; `step` is its 1-based number (for messages). Returns the loss.

        On several processes `batch` is this rank's slice of a batch of `global_batch_size` samples and the step
        is that of one process on the whole batch: DDP and TorchRec's sharded tables average the ranks' gradients,
        so each rank's loss is its sum over `global_batch_size / world_size`, and the loss returned is the whole
        batch's mean (the same on every rank). Sharded tables are updated by TorchRec's fused optimizer inside the
        backward, with the LR that the previous step's `zero_grad` handed it (this step's scheduled LR).
        """
        if self.group is not None:
            return self._distributed_step(batch, step, global_batch_size)
        queued = self._forward_backward(batch, step)
        self._update(queued)
        return self._checked(queued)

    def _sequence_graph_metrics(self) -> dict:
        """How many encoder graphs the run captured and how many training batches ran the encoder eagerly because
        their bucket had none (`GemRanker.capture_sequence_graphs`)."""
        graphs = self.model._sequence_graphs
        return {"sequence_graphs": 0 if graphs is None else len(graphs.graphs),
                "sequence_graph_eager_batches": 0 if graphs is None else graphs.eager_batches}

    def _forward_backward(self, batch: RecBatch, step: int) -> _QueuedStep:
        """One process: the forward and backward of a step, and its check made on the device (the loss, each
        gradient's norm and the dense gradients' global norm, all finite), copied to the host asynchronously."""
        batch = batch.to(self.device, non_blocking=True)
        if self.cuda_graphs and step > 1 and self.model._graphs is None and \
                batch.batch_size == getattr(self.dcfg, "batch_size", None):  # after a step has built every kernel
            self.model.capture_cuda_graphs(batch.batch_size)  # the towers: no attention, capture-safe on every plan
            if self.tcfg.sequence_graph_buckets > 0 and self.graphs_off_because is None:
                self.model.capture_sequence_graphs(self.tcfg.sequence_graph_buckets,
                                                   self.tcfg.sequence_graph_max_tokens)
        logits = self.network(batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())
        loss.backward()
        names, params, num_tables, norms, dense_norm = self._gradients()
        checks = torch.cat([loss.detach().float().reshape(1), norms.float(), dense_norm.float().reshape(1)])
        found_inf = (~torch.isfinite(checks).all()).float()  # 0-dim, as a grad scaler makes it
        copied = None
        if checks.is_cuda:
            host = torch.empty(checks.shape, dtype=checks.dtype, pin_memory=True)
            host.copy_(checks, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            checks = host
        return _QueuedStep(step, batch.batch_size, checks, copied, found_inf, dense_norm, names, params, num_tables)

    def _gradients(self):
        """(names, parameters with a gradient, number of tables, per-tensor gradient norms, the dense gradients'
        global norm): the tables first, then the dense parameters."""
        tables = {id(p) for p in self.model.embedding_parameters()}
        named = sorted(((n, p) for n, p in self.model.named_parameters() if p.grad is not None),
                       key=lambda item: id(item[1]) not in tables)
        names, params = [n for n, _ in named], [p for _, p in named]
        num_tables = sum(id(p) in tables for _, p in named)
        norms = torch.stack(torch._foreach_norm([p.grad for p in params]))  # per tensor, in the gradients' dtype as clipping does
        dense_norm = torch.linalg.vector_norm(norms[num_tables:])  # what gradient clipping scales by
        return names, params, num_tables, norms, dense_norm

    def _update(self, queued: _QueuedStep) -> None:
        """The optimizer step of a queued step, skipped on the device when its check failed (the optimizers'
        `found_inf`), then the schedulers' step."""
        if self.tcfg.grad_clip is not None:
            # a skipped step's gradients stay as they are (a norm of 0 scales them by 1): the error names them
            clip_norm = torch.where(queued.found_inf > 0, 0.0, queued.dense_norm)
            torch.nn.utils.clip_grads_with_norm_(queued.params[queued.num_tables:], self.tcfg.grad_clip, clip_norm)
        self.dense_optimizer.found_inf = self.embedding_optimizer.found_inf = queued.found_inf
        self.dense_optimizer.step()
        self.embedding_optimizer.step()
        self.dense_optimizer.found_inf = self.embedding_optimizer.found_inf = None
        self.dense_scheduler.step()
        self.embedding_scheduler.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.embedding_optimizer.zero_grad(set_to_none=True)

    def _checked(self, queued: _QueuedStep) -> float:
        """A queued step's loss, read once its check has reached the host; raises `NonFiniteError` if it failed."""
        if queued.copied is not None:
            queued.copied.synchronize()
        return self._checked_loss(queued.checks, queued.names, queued.grads, queued.step)

    def _distributed_step(self, batch: RecBatch, step: int, global_batch_size: int | None) -> float:
        """`train_step` on several processes: the check is all-reduced before the optimizer step."""
        batch = batch.to(self.device, non_blocking=True)
        logits = self.network(batch)
        if global_batch_size is None:
            raise ValueError("train_step: global_batch_size is required on several processes (the size of the "
                             "batch that `batch` is this rank's slice of)")
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels.float(), reduction="sum")
        (loss_sum / (global_batch_size / self.world_size)).backward()
        names, params, num_tables, norms, dense_norm = self._gradients()
        value = self._agreed_loss(loss_sum, global_batch_size, names, [p.grad for p in params], norms, dense_norm,
                                  step)
        if self.tcfg.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params[num_tables:], self.tcfg.grad_clip, dense_norm)
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
        # The run's files, progress and log lines come from rank 0 only.
        scalars = Scalars(str(self.run_dir / "tensorboard"), t.tensorboard and self.is_main)
        progress = Progress(total=stop, initial=self.step, bar=t.progress, log_every=t.log_every,
                            enabled=self.is_main)
        teacher = self.teacher_metrics["teacher_auc"]
        if self.is_main:
            log.info("%s on %s: %s parameters%s%s", self.mcfg.precision, self.device,
                     f"{sum(p.numel() for p in self.model.parameters()):,}",
                     f"; teacher eval AUC {teacher:.4f}" if teacher is not None else "",
                     "" if self.group is None else f"; {self.world_size} processes, tables: " + ", ".join(
                         f"{table} {p['sharding_type']} on ranks {p['ranks']}" for table, p in self.sharding_plan.items()))
        if self.is_main:
            log.info("kernel plan (op, precision, arch, implementation):\n%s", "\n".join(
                f"  {c['op']:17s} {c['precision']:5s} {c['arch']:6s} {c['impl']:10s} {c['summary']}"
                + (f" [{c['why']}]" if c["why"] else "") + (f" (self-check: {c['self_check']})" if c["self_check"]
                                                             else "") for c in self.kernel_plan))
            if self.cuda_graphs and self.graphs_off_because:
                log.info("sequence graphs off: %s; the sequence part runs eagerly", self.graphs_off_because)
        self.network.train()
        started = time.perf_counter()
        builds = KernelBuilds().start()
        try:
            with StopRequests(checkpoint=self.tcfg.checkpoint_every is not None) as stop_requests:
                self._stop_requests = stop_requests
                loader = iter(self._train_loader())
                while self.step < stop:
                    requested = stop_requests.requested if self.group is None else self._agreed_stop
                    if requested is not None:
                        self._complete_queued(scalars)
                        saved = self.tcfg.checkpoint_every is not None
                        if saved:
                            self.save_checkpoint()
                        raise TrainingInterrupted(requested, self.step, str(self.checkpoint_path) if saved else None)
                    self._one_step(loader, stop, progress, scalars, builds)
        finally:
            self._stop_requests = None
            builds.stop()
            progress.close()
            scalars.close()
        if self.kernel_builds_after_warmup and self.is_main:
            log.info("note: %d kernel builds (Triton and CuTe DSL) happened during timed steps (samples_per_s counts them; "
                     "samples_per_s_median_step is a typical step: %s)", self.kernel_builds_after_warmup,
                     f"{self.stopwatch.median_rate:,.0f}")
        metrics = self.metrics(wall_s=time.perf_counter() - started)
        if self.is_main:
            write_json_atomic(metrics, self.run_dir / METRICS_FILE)
        return metrics

    def _one_step(self, loader, stop: int, progress: Progress, scalars: Scalars, builds: KernelBuilds) -> None:
        """A training step with its logging, and the eval and checkpoint that fall on it.

        Pipelined (`self.pipelined`: one process on a GPU), the host reads a step's check one step late: it queues
        step N's forward and backward, then reads step N-1's check (on the host by then: the GPU has finished that
        backward), then queues step N's update. The host never waits for the GPU to drain, so the GPU is kept busy
        through the host's work of the next step (data, launches); a failed check still stops the run before any
        later update (step N's is queued after step N-1's check). The progress line shows the latest loss read."""
        t = self.tcfg
        steady, builds_before = self.stopwatch.steady, builds.count
        self.stopwatch.start()
        batch = next(loader)
        batch, samples = batch if self.group is not None else (batch, batch.batch_size)  # (rank's slice, batch size)
        if self.pipelined:
            queued = self._forward_backward(batch, self.step + 1)
            self._complete_queued(scalars)
            self._update(queued)
            self._queued = queued
        else:
            loss = self.train_step(batch, self.step + 1, samples)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._record(self.step + 1, loss, scalars)
        self.stopwatch.stop(samples)
        if steady and builds.count > builds_before:
            self.kernel_builds_after_warmup += builds.count - builds_before
            if self.is_main:
                log.info("step %d built: %s", self.step + 1, "; ".join(builds.new_builds()))
        elif not steady:
            builds.new_builds()  # warm-up builds are expected: not reported
        self.step += 1
        lr = self.dense_scheduler.get_last_lr()[0]
        progress.update(self.step, self.losses[-1] if self.losses else math.nan, self.stopwatch.rate, lr)
        if self.step % t.log_every == 0:
            scalars.add("train/lr", lr, self.step)
            scalars.add("train/samples_per_s", self.stopwatch.rate, self.step)
        evaluate = self.step % t.eval_every == 0 or self.step == stop
        checkpoint = t.checkpoint_every is not None and (self.step % t.checkpoint_every == 0 or self.step == stop)
        if evaluate or checkpoint:
            self._complete_queued(scalars)
        if evaluate:
            point = {"step": self.step, "train_loss": self._recent_train_loss(), **self.evaluate()}
            self.evals.append(point)
            for key in ("eval_loss", "eval_auc", "eval_ne"):
                scalars.add(f"eval/{key[5:]}", point[key], self.step)
            teacher = self.teacher_metrics["teacher_auc"]
            if self.is_main:
                log.info("step %d: eval loss %.4f  AUC %.4f%s  NE %.4f", self.step, point["eval_loss"],
                         point["eval_auc"], f" (teacher {teacher:.4f})" if teacher is not None else "",
                         point["eval_ne"])
        if checkpoint:
            self.save_checkpoint()

    def _complete_queued(self, scalars: Scalars) -> None:
        """Reads the pipelined step still unchecked, if any: records its loss, or raises its `NonFiniteError` with
        the run's step count set back to the step before it (its update was skipped on the device, and no later
        one was queued)."""
        queued, self._queued = self._queued, None
        if queued is None:
            return
        try:
            loss = self._checked(queued)
        except NonFiniteError:
            self.step = queued.step - 1
            raise
        self._record(queued.step, loss, scalars)

    def _record(self, step: int, loss: float, scalars: Scalars) -> None:
        self.losses.append(loss)
        if step % self.tcfg.log_every == 0:
            scalars.add("train/loss", loss, step)

    def _recent_train_loss(self) -> float:
        window = self.losses[-TRAIN_LOSS_WINDOW:]
        return sum(window) / len(window)

    def metrics(self, wall_s: float) -> dict[str, Any]:
        """The run's figures (what `metrics.json` holds); on several processes every rank calls it (the peak memory
        is the largest rank's)."""
        last = self.evals[-1]
        peak_mem = peak_memory_bytes(self.device)
        if self.group is not None:
            peak_mem = int(self.group.max(peak_mem))
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
            "eval_rows": self.eval_rows,  # the rows each evaluation scored, of eval_rows_total in the eval set
            "eval_rows_total": self.eval_rows_total,
            "eval_batches": self.tcfg.eval_batches,
            "data": self.data_fingerprint,
            **self.teacher_metrics,
            "samples_per_s": self.stopwatch.rate,
            "samples_per_s_median_step": self.stopwatch.median_rate,
            "kernel_builds_after_warmup": self.kernel_builds_after_warmup,
            "kernel_plan": self.kernel_plan,
            "cuda_graphs": self.model._graphs is not None,
            "sequence_graphs_off_because": self.graphs_off_because if self.cuda_graphs else None,
            **self._sequence_graph_metrics(),
            "peak_mem_bytes": peak_mem,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "world_size": self.world_size,
            "sharding_plan": self.sharding_plan,  # table -> sharding type, compute kernel, ranks (null: one process)
            "wall_s": wall_s,
            "seed": self.seed,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "resumes": self.resumes,
            "eval_history": self.evals,
            "train_loss_history": self.losses,
        }


@dataclasses.dataclass
class _QueuedStep:
    """A single-process step whose forward and backward are queued: its device-side check (`checks`, the host copy
    when `copied` is an event still to complete) and what its optimizer step and error message need. `grads` keeps
    the step's gradients for the message until the check is read (the optimizers' `zero_grad` drops theirs)."""

    step: int
    samples: int
    checks: torch.Tensor
    copied: "torch.cuda.Event | None"
    found_inf: torch.Tensor
    dense_norm: torch.Tensor
    names: list[str]
    params: list[torch.nn.Parameter]
    num_tables: int
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.grads = [p.grad for p in self.params]


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
    trainer = Trainer(cfg, run_dir)
    try:
        return trainer.fit()
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)  # the finished frames' references to the trainer (see below)
        raise
    finally:
        trainer.close()
        # The sharded modules hold the process group's gloo backend after it is destroyed; freed at interpreter
        # exit instead, its worker threads can still need the interpreter and abort the process (SIGABRT).
        del trainer
        gc.collect()
