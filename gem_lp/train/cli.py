"""The command line: `python train.py`, `python -m gem_lp.train` and `gem-lp-train` all run `main`.

`python train.py [model=gem_mxfp8] [trainer=gpu] [data=parquet data.path=...] [key=value ...]`, or `-m` for a sweep.
The configs ship inside the package (`gem_lp/configs`), so any of the three works from any directory.

`torchrun --nproc_per_node=N train.py [key=value ...]` runs the same command on N processes: every rank gets rank
0's run directory, and only rank 0 writes Hydra's record (`.hydra/`), `train.log` and the console's INFO lines (the
other ranks print their warnings and errors, prefixed with their rank).
"""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write
from torch.distributed.elastic.multiprocessing.errors import record

from gem_lp.data import DataError, ParquetDataConfig
from gem_lp.models import GemRanker

from .checkpoint import CheckpointError
from .config import ConfigError, load_run_config
from .distributed import LaunchEnv, LaunchError, launch_env, rank_device, shared_value
from .sharding import sharding_choices
from .signals import TrainingInterrupted
from .trainer import NonFiniteError, RunDirectoryInUse, check_run_directory, resolve_device, train

log = logging.getLogger("gem_lp.train")

# The errors a user can act on from their message alone: printed as is, without a traceback.
USER_ERRORS = (ConfigError, DataError, CheckpointError, RunDirectoryInUse, NonFiniteError, FileNotFoundError)


class RunRefused(CompactHydraException):
    """An error Hydra prints as its message only (no traceback) before exiting with status 1."""


def check_config(cfg: DictConfig, run_dir: str | None, launch: LaunchEnv | None = None) -> None:
    """Build the run's dataclasses (types, ranges), check that the device and the data files are there and, given
    the run directory, that the run would not overwrite a checkpoint; on several processes (`launch`), also the
    sharding settings and the global batch against the number of processes. Raises `RunRefused` with a one-line
    message."""
    try:
        config = load_run_config(cfg)
        device = resolve_device(config.trainer.device)
        if isinstance(config.data, ParquetDataConfig):
            config.data.check_paths()
        if launch is not None:
            rank_device(device, launch)
            features = config.data.feature_spec() if hasattr(config.data, "feature_spec") else None
            if features is not None:
                sharding_choices(config.trainer, GemRanker.embedding_tables(features), device.type)
            batch_size = getattr(config.data, "batch_size", None)
            if batch_size is not None and batch_size < launch.world_size:
                raise ConfigError(f"data.batch_size={batch_size} is the global batch, split over the "
                                  f"{launch.world_size} processes: it must be at least {launch.world_size}")
        if run_dir is not None:
            check_run_directory(config, run_dir)
    except (ConfigError, DataError, RunDirectoryInUse, FileNotFoundError) as err:
        raise RunRefused(str(err)) from None


def _sweep_job_overrides(config: DictConfig) -> list[list[str]] | None:
    """The overrides of each job of a basic sweep (`-m a=1,2 b=x,y`), or None for another sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


class CheckConfig(Callback):
    """Hydra callback (`hydra.callbacks` in config.yaml): checks the config before Hydra creates a run
    directory, so a bad value leaves no stray `outputs/<date>/<time>/` behind; in a sweep, every job's config
    before the first job starts. A bad config prints its one-line error and exits with status 1 (Hydra turns
    a callback's exceptions into warnings, so the exit is the way to stop it)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            launch = launch_env()
        except LaunchError as err:
            _exit_with(str(err))
        try:
            check_config(config, None, launch)
            if launch is not None:
                _share_rank0_run_directory(config, launch)
            check_config(config, str(config.hydra.run.dir))
        except RunRefused as err:
            _exit_with(str(err))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            launch = launch_env()
        except LaunchError as err:
            _exit_with(str(err))
        if launch is not None:
            _exit_with("a sweep (-m) runs its jobs one after another in one process; under torchrun, start each job "
                       "with its own torchrun command")
        jobs = _sweep_job_overrides(config)
        try:
            if jobs is None:  # another sweeper chooses its jobs as it goes: each is checked when it starts
                check_config(config, None)
                return
            loader = GlobalHydra.instance().config_loader()
            for overrides in jobs:
                try:
                    check_config(loader.load_sweep_config(config, overrides), None)
                except RunRefused as err:
                    raise RunRefused(f"sweep job {' '.join(overrides)}: {err}") from None
        except CompactHydraException as err:  # RunRefused, or a job whose overrides do not compose
            _exit_with(str(err) + (f": {err.__cause__}".split("\n")[0] if err.__cause__ else ""))


def _share_rank0_run_directory(config: DictConfig, launch: LaunchEnv) -> None:
    """Every rank takes rank 0's run directory (each resolves `${now:...}` for itself); the ranks other than 0 write
    no `.hydra/` record and no `train.log`, and print only warnings and errors, prefixed with their rank."""
    timeout_s = float(config.trainer.dist_timeout_s)
    with read_write(config), open_dict(config):
        config.hydra.run.dir = shared_value("run_dir", str(config.hydra.run.dir), launch, timeout_s)
        if launch.rank == 0:
            return
        config.hydra.output_subdir = None
        logging_config = config.hydra.job_logging
        logging_config.root.handlers = ["console"]
        logging_config.handlers.pop("file", None)
        logging_config.formatters.console.format = f"[rank {launch.rank}] %(message)s"
        logging_config.loggers.gem_lp.level = "WARNING"


def _exit_with(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(1)


@hydra.main(config_path="pkg://gem_lp.configs", config_name="config", version_base="1.3")
def _run(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        metrics = train(cfg, run_dir)
    except TrainingInterrupted as stop:
        log.warning("%s", stop)
        sys.exit(stop.exit_code)
    except USER_ERRORS as err:
        log.error("%s", err)
        raise RunRefused(f"the run in {run_dir} failed (the error above is also in its train.log)") from None
    except Exception as err:
        launch = launch_env()
        if launch is not None and launch.world_size > 1:
            # A rank whose peer died or stopped answering fails inside a collective (gloo: "Connection reset by
            # peer"; NCCL or a silent peer: the trainer.dist_timeout_s timeout) with a message that does not say so.
            log.error("rank %d of %d failed: %s: %s\nIf another rank failed first, this is its consequence: "
                      "torchrun's summary names the rank that failed first, and that rank's output says why",
                      launch.rank, launch.world_size, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        raise
    teacher = metrics["teacher_auc"]
    log.info("done: %d steps, eval AUC %.4f%s, eval NE %.4f, %s samples/s", metrics["steps"], metrics["eval_auc"],
             f" (teacher {teacher:.4f})" if teacher is not None else "", metrics["eval_ne"],
             f"{metrics['samples_per_s']:,.0f}")
    return metrics["eval_ne"]


@record  # under torchrun: an exception's traceback goes into the launcher's summary of the failed rank
def main() -> float:
    """`python train.py ...`, `python -m gem_lp.train ...`, `gem-lp-train ...`, and each process of `torchrun ...
    train.py ...`."""
    return _run()
