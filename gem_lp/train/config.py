"""The run configuration: dataclasses that Hydra's ConfigStore holds as the schema of `gem_lp/configs`.

Hydra merges every yaml file and command-line override into these structured configs, so a value of the
wrong type (`trainer.lr=abc`, `seed=abc`) fails while the config is composed. `load_run_config` then
builds the dataclasses, whose `__post_init__` checks ranges and choices; the command line does that
before Hydra makes a run directory (`gem_lp.train.cli.CheckConfig`). Errors are one line, naming the key
and the expected form.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from gem_lp.data import ParquetDataConfig, SyntheticDataConfig
from gem_lp.models import GemModelConfig

DECAYS = ("cosine", "linear", "none")

# Trainer settings that `resume=true` accepts changed (and records in the run's resume history): they decide
# how long the run goes and what it logs, evaluates and writes, not the optimization of the steps already
# taken. `max_steps` also sets the length of the LR schedule, which is recomputed for the new length.
# Any other trainer setting (lr, weight_decay, warm-up, ...) changed on resume needs `resume=force`.
# The sharding settings may change too: a sharded checkpoint is refused unless the plan they give is the checkpoint's.
RESUME_MAY_CHANGE = ("max_steps", "stop_after", "eval_every", "eval_batches", "log_every", "checkpoint_every",
                     "checkpoint_path", "device", "num_threads", "num_workers", "progress", "tensorboard", "cuda_graphs",
                     "sequence_graph_buckets", "sequence_graph_max_tokens",
                     "sharding", "table_sharding", "dist_timeout_s")
SHARDINGS = ("auto", "table_wise", "row_wise", "column_wise", "data_parallel")


class ConfigError(ValueError):
    """A config value of the wrong type or out of range; the message is one line naming the key."""


@dataclasses.dataclass
class TrainerConfig:
    """Optimization, evaluation and bookkeeping (`gem_lp/configs/trainer/*.yaml`).

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
    eval_batches: int | None = None  # evaluate the first this many batches of the eval set (None: all of it)
    log_every: int = 10
    checkpoint_every: int | None = 200  # null: no checkpoint file (nothing to resume, a signal stops without one)
    checkpoint_path: str | None = None  # default: <run dir>/checkpoint.pt
    lr: float = 2e-3  # AdamW, dense parameters
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    embedding_lr: float = 0.05  # row-wise Adagrad, embedding tables
    embedding_weight_decay: float = 0.0  # its L2 term on the rows a step touches (0: none)
    warmup_steps: int = 50
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0  # max global norm of the dense gradients (None: no clipping)
    progress: bool = True  # a progress bar when stderr is a terminal; otherwise a log line every log_every steps
    # CUDA graphs of the model's fixed-shape towers (GemRanker.capture_cuda_graphs), captured after the first step:
    # true needs one process on a CUDA device; None (default) uses them there and not elsewhere
    cuda_graphs: bool | None = None
    # With cuda_graphs: the sequence part of training steps from CUDA graphs too, one per bucket of token counts
    # (gem_lp.models.sequence_graphs), at most this many (sharing one memory pool; 0: none), for
    # batches of at most sequence_graph_max_tokens packed tokens (longer ones are GPU-bound: eager)
    sequence_graph_buckets: int = 4
    sequence_graph_max_tokens: int = 1 << 19
    tensorboard: bool = True
    # Under torchrun (several processes; see gem_lp.train.sharding): how the embedding tables are spread over the
    # ranks, per-table overrides ({table: table_wise | row_wise | column_wise}), and how long a collective waits
    # for every rank before the job fails.
    sharding: str = "auto"
    table_sharding: dict[str, str] = dataclasses.field(default_factory=dict)
    dist_timeout_s: float = 300.0

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"trainer.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        for name in ("max_steps", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"trainer.checkpoint_every must be null (no checkpoints) or >= 1, got "
                             f"{self.checkpoint_every}")
        if self.checkpoint_every is None and self.stop_after is not None:
            raise ValueError("trainer.stop_after stops the run with a checkpoint to resume from: it needs "
                             "trainer.checkpoint_every (not null)")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"trainer.eval_batches must be null (the whole eval set) or >= 1, got {self.eval_batches}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            raise ValueError(f"trainer.stop_after must be null or in [1, max_steps={self.max_steps}], "
                             f"got {self.stop_after}")
        if self.num_workers < 0:
            raise ValueError(f"trainer.num_workers must be >= 0, got {self.num_workers}")
        if self.sequence_graph_buckets < 0:
            raise ValueError(f"trainer.sequence_graph_buckets must be >= 0, got {self.sequence_graph_buckets}")
        if self.sequence_graph_max_tokens < 1:
            raise ValueError(f"trainer.sequence_graph_max_tokens must be >= 1, got {self.sequence_graph_max_tokens}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"trainer.num_threads must be null or >= 1, got {self.num_threads}")
        if self.decay not in DECAYS:
            raise ValueError(f"trainer.decay must be one of {DECAYS}, got {self.decay!r}")
        for name in ("lr", "embedding_lr"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"trainer.{name} must be a finite number > 0, got {getattr(self, name)}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must be [beta1, beta2] with each in [0, 1), got {list(self.betas)}")
        for name in ("weight_decay", "embedding_weight_decay"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"trainer.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and not 0 < self.grad_clip < float("inf"):
            raise ValueError(f"trainer.grad_clip must be null or a finite number > 0, got {self.grad_clip}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"trainer.sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        self.table_sharding = dict(self.table_sharding)
        for table, sharding in self.table_sharding.items():
            if sharding not in SHARDINGS[1:4]:
                raise ValueError(f"trainer.table_sharding.{table} must be one of {SHARDINGS[1:4]}, got {sharding!r}")
        if not 0 < self.dist_timeout_s < float("inf"):
            raise ValueError(f"trainer.dist_timeout_s must be a finite number of seconds > 0, got {self.dist_timeout_s}")
        if self.checkpoint_path is not None and not self.checkpoint_path.strip():
            raise ValueError("trainer.checkpoint_path must be null or a file path, got an empty string")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "TrainerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown trainer config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**cfg)


@dataclasses.dataclass
class RunConfig:
    """Everything a run is made of (`gem_lp/configs/config.yaml` and its groups).

    `data` is one of the data group's schemas: `SyntheticDataConfig` (`data=synthetic`, the default),
    `ParquetDataConfig` (`data=parquet`), or one's own next to a `DataSource` given to the `Trainer`.
    `resume`: false, true (continue the run's checkpoint, refusing changed settings other than
    `RESUME_MAY_CHANGE`) or force (continue it with every changed trainer setting; the changes are
    recorded).
    """

    model: GemModelConfig = dataclasses.field(default_factory=GemModelConfig)
    data: Any = None
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    seed: int = 0
    resume: Any = False

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.data):  # a structured config: typed, checked like the others
            raise ValueError(f"data must be a structured data config (data=synthetic, data=parquet, or a dataclass "
                             f"of one's own in Hydra's ConfigStore), got {type(self.data).__name__}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if not (self.resume is False or self.resume is True or self.resume == "force"):
            raise ValueError(f"resume must be false, true or force, got {self.resume!r}")


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore: `config.yaml` extends `run_schema`, `data/synthetic.yaml` and
    `data/parquet.yaml` extend `synthetic_schema` and `parquet_schema` (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="data", name="synthetic_schema", node=SyntheticDataConfig)
    store.store(group="data", name="parquet_schema", node=ParquetDataConfig)


register_configs()


def load_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The composed config as checked dataclasses; raises `ConfigError` (one line, naming the key).

    `cfg` may hold Hydra's own `hydra` node (it is left out).
    """
    if isinstance(cfg, RunConfig):
        return cfg
    node = cfg
    if "hydra" in cfg:
        node = cfg.copy()
        with read_write(node), open_dict(node):
            del node["hydra"]
    try:
        typed = OmegaConf.merge(OmegaConf.structured(RunConfig), node)
        missing = sorted(OmegaConf.missing_keys(typed))
        if missing:  # every one at once, not the first one to be reached
            raise ConfigError(f"{', '.join(missing)}: {'a value is' if len(missing) == 1 else 'values are'} required "
                              f"(the config leaves {'it' if len(missing) == 1 else 'them'} ???); set "
                              f"{'it' if len(missing) == 1 else 'each'}, e.g. {missing[0]}=...")
        run = OmegaConf.to_object(typed)
    except OmegaConfBaseException as err:
        raise ConfigError(one_line(err)) from None
    except (ValueError, TypeError) as err:  # a __post_init__ check
        raise ConfigError(str(err).splitlines()[0]) from None
    return run


def one_line(err: OmegaConfBaseException) -> str:
    """`<key>: <OmegaConf's message>` on one line."""
    key = getattr(err, "full_key", None)
    if isinstance(err, MissingMandatoryValue) and key:
        return f"{key}: a value is required (the config leaves it ???); set it, e.g. {key}=..."
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"{key}: {message}" if key and not message.startswith(f"{key}:") else message


def plain(obj: Any) -> Any:
    """A dataclass (or container of them) as JSON-like lists, dicts and scalars: for comparing and recording."""
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj))
