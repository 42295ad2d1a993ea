"""Facts about where an op runs: the device's architecture, the toolchains installed, the execution mode (Triton's
interpreter, fake tensors, CUDA graph capture)."""
from __future__ import annotations

import functools
import os

import torch

# Compute-capability majors the CuTe kernels are built for (Hopper sm_90a, Blackwell sm_100a).
CUTE_ARCH_MAJORS = (9, 10)


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), which takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def skips_dispatch(*tensors: torch.Tensor) -> bool:
    """True when an eager call may run a custom op's implementation without the dispatcher: plain tensors, not
    under torch.compile, no dispatch mode (fake tensors, tracing) active. In eager mode a custom op's dispatch
    can cost as much host time as the rest of the call; traced and compiled graphs must see the op."""
    return (all(type(t) is torch.Tensor for t in tensors) and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def fake_mode() -> bool:
    """True under `FakeTensorMode`, where the CuTe kernels are built and not launched (`gem_lp.compile_check`). The
    eager call answers from the length of the dispatch-mode stack; looking the mode up costs microseconds of host
    time, twice per kernel call."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (caches are then neither read nor written: what a graph
    reads must be made inside it)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def cute_stack_missing() -> str | None:
    """Why the CuTe DSL stack cannot be imported here (None when it can)."""
    try:
        import cutlass  # noqa: F401
        import flash_attn.cute  # noqa: F401
        import quack  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else at import
        return f"the CuTe DSL stack does not import ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def triton_missing() -> str | None:
    """Why Triton cannot be imported here (None when it can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:
        return f"Triton does not import ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (cached)."""
    return _cuda_capability(_index(device))


def build_arch(device: torch.device) -> str:
    """The CuTe DSL build target of a CUDA device: `sm_90a`, `sm_100a`, ..."""
    major, minor = capability(device)
    return f"sm_{major}{minor}a"


def cute_unavailable(device: torch.device) -> str | None:
    """One-line reason why the CuTe kernels cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return f"the CuTe kernels need a CUDA device, got {device}"
    major, minor = capability(device)
    if major not in CUTE_ARCH_MAJORS:
        return f"the CuTe kernels are built for sm_90 and sm_100, this GPU is sm_{major}{minor}"
    return cute_stack_missing()


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached); `off_gpu` elsewhere (the interpreter, builds for a
    target without a GPU), where a persistent launch's program count only shapes the walk, not the bytes."""
    if device.type != "cuda":
        return off_gpu
    return _cuda_sm_count(_index(device))
