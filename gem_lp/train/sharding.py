"""The model on several processes: TorchRec's `DistributedModelParallel` with a plan from TorchRec's planner.

`trainer.sharding` chooses how the embedding tables are spread over the ranks; the dense layers are always data
parallel (DDP, inside `DistributedModelParallel`):

- `table_wise`, `row_wise`, `column_wise`: every table is sharded so (whole tables, row ranges or column ranges
  on the ranks that the planner picks); `trainer.table_sharding` overrides single tables (`{item: row_wise}`).
  Sharded tables run fbgemm's batched embedding kernels with TorchRec's fused optimizer: fbgemm's exact row-wise
  Adagrad, the same update as `gem_lp.train.optim.RowWiseAdagrad`, applied inside the backward.
- `data_parallel`: every table whole on every rank; TorchRec's `EmbeddingCollection` and
  `EmbeddingBagCollection` stay as they are (no sharder: `DistributedModelParallel` hands them to DDP with the
  dense layers) and the trainer's `RowWiseAdagrad` updates them from all-reduced gradients. No fbgemm kernel
  runs, so this works wherever the plain modules do.
- `auto`: the planner's choice among the sharded types the device allows, or `data_parallel` where this fbgemm
  build has no kernels for the device (the CPU build of fbgemm-gpu on a CUDA host).

What runs where (TorchRec 1.8, fbgemm-gpu-cpu 1.8): on the CPU, `EmbeddingBagCollection` tables take table-wise
and column-wise sharding (TorchRec offers row-wise for them on CUDA only), `EmbeddingCollection` tables take
table-wise, row-wise and column-wise. TorchRec's own `data_parallel` sharding type is not used: it runs fbgemm's
dense kernel, which pools the lookups of an `EmbeddingCollection` on the CPU build (the sequence comes back with
one row per sample) and which the CPU build lacks on CUDA.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
from torch import nn

from .config import ConfigError, TrainerConfig
from .distributed import LaunchEnv, ProcessGroup
from .optim import ROWWISE_ADAGRAD_EPS

class _DropDryRunNotice(logging.Filter):
    """TorchRec's planner warns, on every plan, that its dense-size estimate is wrong for models not materialized
    (a dry run); the trainer plans a materialized model, for which the estimate holds: drop that one message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("There is a known issue with TorchRec's dense tensor size")


logging.getLogger("torchrec.distributed.planner.storage_reservations").addFilter(_DropDryRunNotice())

SHARDED_TYPES = ("table_wise", "row_wise", "column_wise")
DATA_PARALLEL = "data_parallel"
UNSHARDED_KERNEL = "unsharded module (DDP)"  # the plan's compute kernel of a `data_parallel` table


def fbgemm_has_kernels_for(device_type: str) -> bool:
    """Whether the installed fbgemm-gpu registers its sparse kernels for `device_type` (the CPU build registers
    none for CUDA; TorchRec's sharded modules cannot run there)."""
    if device_type == "cpu":
        return True
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::permute_2D_sparse_data", device_type.upper())
    except RuntimeError:  # the op is not registered at all
        return False


def _sharders(embedding_lr: float | None, weight_decay: float = 0.0) -> dict[str, Any]:
    """TorchRec's sharders of the model's two embedding modules, with the fused optimizer's settings: exact
    row-wise Adagrad with the trainer's embedding LR, its L2 weight decay (`RowWiseAdagrad`'s rule: added to the
    touched rows' gradients) and `RowWiseAdagrad`'s epsilon. Without `embedding_lr`, sharders only to ask which
    sharding types they offer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = None
    if embedding_lr is not None:
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": embedding_lr,
                 "eps": ROWWISE_ADAGRAD_EPS}
        if weight_decay:
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

            fused.update(weight_decay=weight_decay, weight_decay_mode=WeightDecayMode.L2)
    return {"sequence_embeddings": EmbeddingCollectionSharder(fused_params=fused),
            "pooled_embeddings": EmbeddingBagCollectionSharder(fused_params=fused)}


def sharding_choices(tcfg: TrainerConfig, tables: dict[str, list[str]], device_type: str) -> dict[str, list[str]]:
    """The sharding types each table may take (the planner picks among them), or `{}` for `data_parallel`.

    Args:
        tcfg: `trainer.sharding` and `trainer.table_sharding`.
        tables: the table names of each embedding module (`GemRanker.embedding_tables`).
        device_type: "cpu" or "cuda".
    Raises `ConfigError` for a table name that is not one of the model's, or a type the table's module cannot take
    on the device.
    """
    known = {table: module for module, names in tables.items() for table in names}
    unknown = sorted(set(tcfg.table_sharding) - set(known))
    if unknown:
        raise ConfigError(f"trainer.table_sharding: unknown table(s) {unknown}; the model's tables are "
                          f"{sorted(known)}")
    has_kernels = fbgemm_has_kernels_for(device_type)
    if tcfg.sharding == DATA_PARALLEL or (tcfg.sharding == "auto" and not has_kernels and not tcfg.table_sharding):
        if tcfg.table_sharding:
            raise ConfigError(f"trainer.table_sharding={dict(tcfg.table_sharding)} with trainer.sharding="
                              f"{DATA_PARALLEL}: data_parallel keeps every table whole on every rank; drop the "
                              f"per-table overrides, or choose a sharded type for the others")
        return {}
    if not has_kernels:
        raise ConfigError(f"trainer.sharding={tcfg.sharding} (table_sharding={dict(tcfg.table_sharding)}): sharded "
                          f"tables run fbgemm's kernels, which this fbgemm-gpu build lacks for {device_type} (the CPU "
                          f"build of fbgemm-gpu); use trainer.sharding=data_parallel (or auto) and no "
                          f"trainer.table_sharding")
    sharders = _sharders(embedding_lr=None)
    choices = {}
    for table, module in known.items():
        offered = [t for t in SHARDED_TYPES if t in sharders[module].sharding_types(device_type)]
        wanted = tcfg.table_sharding.get(table, tcfg.sharding)
        if wanted == "auto":
            choices[table] = offered
        elif wanted in offered:
            choices[table] = [wanted]
        else:
            key = f"trainer.table_sharding.{table}" if table in tcfg.table_sharding else "trainer.sharding"
            kind = "EmbeddingCollection" if module == "sequence_embeddings" else "EmbeddingBagCollection"
            raise ConfigError(f"{key}={wanted}: TorchRec shards the {kind} table {table!r} on {device_type} as "
                              f"{' / '.join(offered)} only")
    return choices


@dataclasses.dataclass
class ShardedModel:
    """The model wrapped for `world_size` processes.

    Attributes:
        module: the `DistributedModelParallel` (call it for the forward pass).
        plan: table -> {"module", "sharding_type", "compute_kernel", "ranks"}: the same on every rank.
        fused: the tables are sharded and updated by TorchRec's fused optimizer (`module.fused_optimizer`);
            otherwise they are data parallel and the trainer's optimizer updates them.
    """

    module: nn.Module
    plan: dict[str, dict[str, Any]]
    fused: bool


def shard_model(model: nn.Module, tables: dict[str, list[str]], tcfg: TrainerConfig, launch: LaunchEnv,
                group: ProcessGroup) -> ShardedModel:
    """Wrap `model` (a `GemRanker` on `group.device`, initialized the same on every rank) in TorchRec's
    `DistributedModelParallel` with a plan from `EmbeddingShardingPlanner` (computed on rank 0, shared); the
    sharded tables start from `model`'s own initial weights, so every world size starts from the same model."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    device = group.device
    choices = sharding_choices(tcfg, tables, device.type)
    env = ShardingEnv.from_process_group(group.group)
    if not choices:
        with warnings.catch_warnings():
            _ignore_torchrec_notices()
            module = DistributedModelParallel(model, env=env, device=device, plan=ShardingPlan(plan={}), sharders=[])
        ranks = list(range(group.world_size))
        plan = {table: {"module": name, "sharding_type": DATA_PARALLEL, "compute_kernel": UNSHARDED_KERNEL,
                        "ranks": ranks} for name, names in tables.items() for table in names}
        return ShardedModel(module, plan, fused=False)

    initial = {name: value.detach().clone() for name, value in model.state_dict().items()
               if name.split(".")[0] in tables}
    sharders = _sharders(tcfg.embedding_lr, tcfg.embedding_weight_decay)
    constraints = {table: ParameterConstraints(sharding_types=types, compute_kernels=["fused"])
                   for table, types in choices.items()}
    with warnings.catch_warnings():
        _ignore_torchrec_notices()
        planner = EmbeddingShardingPlanner(topology=_topology(launch, device), constraints=constraints)
        sharding_plan = planner.collective_plan(model, list(sharders.values()), group.group)
        module = DistributedModelParallel(model, env=env, device=device, plan=sharding_plan,
                                          sharders=list(sharders.values()))
    _load_unsharded_tables(module, initial)
    return ShardedModel(module, _plan_summary(sharding_plan), fused=True)


def _ignore_torchrec_notices() -> None:
    """Inside `warnings.catch_warnings()`: TorchRec 1.8's own calls of deprecated APIs (its default storage
    reservation, DDP's `broadcast_buffers`) warn on every run; they are about TorchRec's code, not the trainer's."""
    warnings.filterwarnings("ignore", message="HeuristicalStorageReservation is known to cause issues",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)


def _topology(launch: LaunchEnv, device: torch.device):
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory
    from torchrec.distributed.planner.types import TrainerConfig as PlannerTrainerConfig

    hbm = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return TopologyFactory.create_topology(
        PlannerTrainerConfig(world_size=launch.world_size, local_world_size=launch.local_world_size,
                             hbm_cap_bytes=hbm),
        kernel_config=KernelConfig(compute_device=device.type))


def _load_unsharded_tables(module: nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """Copy each whole initial table into this rank's shards of it (TorchRec's sharded modules initialize their
    shards themselves)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = module.state_dict()
    for name, value in state.items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(initial[name][row:row + rows, col:col + cols])
    module.load_state_dict(state)


def _plan_summary(sharding_plan) -> dict[str, dict[str, Any]]:
    """table -> {"module", "sharding_type", "compute_kernel", "ranks"} of a TorchRec `ShardingPlan`."""
    summary = {}
    for module_path, module_plan in sorted(sharding_plan.plan.items()):
        for table, sharding in sorted(module_plan.items()):
            ranks = sharding.ranks
            if sharding.sharding_spec is not None:
                ranks = [shard.placement.rank() for shard in sharding.sharding_spec.shards]
            summary[table] = {"module": module_path, "sharding_type": sharding.sharding_type,
                              "compute_kernel": sharding.compute_kernel, "ranks": sorted(set(ranks or []))}
    return summary
