"""Training on several processes: the launcher's environment, the process group, and the collectives the trainer
uses.

`torchrun --nproc_per_node=N train.py ...` (or any launcher that sets torch's `env://` variables: `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) makes each process one rank; without those variables the
trainer runs as one process, as before. The process group uses gloo on the CPU and NCCL on CUDA, with
`trainer.dist_timeout_s` as the time a collective waits for every rank: a rank that dies or stops answering ends
the job with an error instead of a hang.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .config import ConfigError

log = logging.getLogger("gem_lp.train")

ENV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ConfigError):
    """The launcher's environment is incomplete or inconsistent, or asks for a device this host lacks; the message
    names the variable."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a multi-process launch (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node (LOCAL_WORLD_SIZE; WORLD_SIZE when unset)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launch this process belongs to, from torchrun's variables; None when none of them is set (one process).

    A partial or inconsistent set (e.g. `RANK` without `WORLD_SIZE`, a rank outside `[0, WORLD_SIZE)`) is a
    `LaunchError` naming the variable.
    """
    env = os.environ if environ is None else environ
    present = [name for name in ENV_VARIABLES if name in env]
    if not present:
        return None
    missing = [name for name in ENV_VARIABLES if name not in env]
    if missing:
        raise LaunchError(f"the environment sets {', '.join(present)} but not {', '.join(missing)}: start several "
                          f"processes with torchrun (torchrun --nproc_per_node=N train.py ...), or unset the torch "
                          f"distributed variables to run one process")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            values[name] = int(env[name])
        except ValueError:
            raise LaunchError(f"environment variable {name}={env[name]!r}: expected an integer") from None
    if values["WORLD_SIZE"] < 1:
        raise LaunchError(f"environment variable WORLD_SIZE={values['WORLD_SIZE']}: expected >= 1")
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise LaunchError(f"environment variable RANK={values['RANK']}: expected 0 <= RANK < WORLD_SIZE="
                          f"{values['WORLD_SIZE']}")
    local_world_size = env.get("LOCAL_WORLD_SIZE", str(values["WORLD_SIZE"]))
    try:
        values["LOCAL_WORLD_SIZE"] = int(local_world_size)
    except ValueError:
        raise LaunchError(f"environment variable LOCAL_WORLD_SIZE={local_world_size!r}: expected an integer") from None
    if not 0 <= values["LOCAL_RANK"] < values["LOCAL_WORLD_SIZE"] <= values["WORLD_SIZE"]:
        raise LaunchError(f"environment variables LOCAL_RANK={values['LOCAL_RANK']}, LOCAL_WORLD_SIZE="
                          f"{values['LOCAL_WORLD_SIZE']}: expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE="
                          f"{values['WORLD_SIZE']}")
    return LaunchEnv(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"],
                     local_world_size=values["LOCAL_WORLD_SIZE"])


def rank_device(device: torch.device, launch: LaunchEnv) -> torch.device:
    """The device of this rank: the CPU, or the CUDA device of index `LOCAL_RANK` (one GPU per process)."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if launch.local_rank >= count:
        raise LaunchError(f"LOCAL_RANK={launch.local_rank} but this host shows {count} CUDA device(s): start at most "
                          f"{count} processes per node (torchrun --nproc_per_node={count})")
    return torch.device("cuda", launch.local_rank)


def shared_value(key: str, value: str, launch: LaunchEnv, timeout_s: float) -> str:
    """Rank 0's `value` under `key`, on every rank, through the launcher's key-value store (before the process
    group exists: the command line uses it to give every rank rank 0's run directory)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"gem_lp/{run_id}/{attempt}/", store)
    if launch.rank == 0:
        store.set(key, value)
    return store.get(key).decode()


class ProcessGroup:
    """The default process group of this launch: gloo on the CPU, NCCL on CUDA, every collective bounded by
    `timeout_s`. Call `close()` at the end (also after an error)."""

    def __init__(self, launch: LaunchEnv, device: torch.device, timeout_s: float):
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        self.group = dist.group.WORLD

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over the ranks (on the tensor's device; the input is not changed)."""
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def max(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return float(total)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[world_size, *tensor.shape]`: every rank's `tensor` (the same shape on every rank), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous())
        return torch.stack(out)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
