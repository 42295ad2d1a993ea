"""Backend selection shared by every op: `reference` (plain PyTorch, the oracle) or `triton`."""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "triton")


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), which takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def skips_dispatch(*tensors: torch.Tensor) -> bool:
    """True when an eager call may run a custom op's implementation without the dispatcher: plain tensors, not
    under torch.compile, no dispatch mode (fake tensors, tracing) active. In eager mode a custom op's dispatch
    can cost as much host time as the rest of the call; traced and compiled graphs must see the op."""
    return (all(type(t) is torch.Tensor for t in tensors) and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """`auto` -> `triton` when every tensor is on CUDA, else `reference`; checks an explicit choice."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if on_cuda else "reference"
    if backend == "triton" and not on_cuda and not interpreter_enabled():
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {devices}); on a CPU machine set "
            f"TRITON_INTERPRET=1 before importing gem_lp to run the kernels in Triton's interpreter"
        )
    return backend


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached); `off_gpu` elsewhere (the interpreter, builds for a
    target without a GPU), where a persistent launch's program count only shapes the walk, not the bytes."""
    if device.type != "cuda":
        return off_gpu
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)
