"""Backend selection shared by every op: `reference` (plain PyTorch, the oracle), `triton`, or `cute`
(CuTe DSL kernels built on flash-attn-4 and quack, for sm_90 / sm_100)."""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "triton", "cute")
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
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cute_unavailable(device: torch.device) -> str | None:
    """One-line reason why the CuTe kernels cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return f"the CuTe kernels need a CUDA device, got {device}"
    major, minor = _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)
    if major not in CUTE_ARCH_MAJORS:
        return f"the CuTe kernels are built for sm_90 and sm_100, this GPU is sm_{major}{minor}"
    return cute_stack_missing()


def resolve_backend(backend: str, *tensors: torch.Tensor, kernels: tuple[str, ...] = ("triton",)) -> str:
    """The backend an op runs on; `kernels` lists the kernel toolchains the op has.

    `auto`: `cute` when the op has CuTe kernels and they can run on the tensors' GPU, else `triton` on CUDA,
    `reference` elsewhere. An explicit `triton` or `cute` that cannot run raises with the reason.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        if not on_cuda:
            return "reference"
        if "cute" in kernels and cute_unavailable(tensors[0].device) is None:
            return "cute"
        return "triton"
    if backend == "reference":
        return backend
    if backend not in kernels:
        raise ValueError(f"backend={backend!r} is not available for this op (it has: reference, "
                         f"{', '.join(kernels)})")
    if backend == "triton" and not on_cuda and not interpreter_enabled():
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {devices}); on a CPU machine set "
            f"TRITON_INTERPRET=1 before importing gem_lp to run the kernels in Triton's interpreter"
        )
    if backend == "cute":
        devices = {t.device for t in tensors}
        reason = (f"the tensors are on several devices {sorted(map(str, devices))}" if len(devices) > 1
                  else cute_unavailable(next(iter(devices))))
        if reason is not None:
            raise ValueError(f"backend='cute' cannot run: {reason}")
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


# Modules whose in-memory caches hold the CuTe kernels a process has built (or loaded from a persistent cache).
_CUTE_CACHE_MODULES = ("gem_lp.attention.cute.launch", "gem_lp.norm.cute.launch", "gem_lp.norm.cute.backward",
                       "gem_lp.norm.cute.forward", "gem_lp.gemm.cute.launch")


def _cute_caches():
    """(name, dict of compile key -> kernel) of every CuTe kernel cache of the modules imported so far."""
    import sys

    for name in _CUTE_CACHE_MODULES:
        if name in sys.modules:
            yield name, sys.modules[name]._COMPILED
    fa4 = sys.modules.get("flash_attn.cute.interface")
    if fa4 is not None:
        for attr, fn in vars(fa4).items():
            cache = getattr(getattr(fn, "compile_cache", None), "cache", None)
            if isinstance(cache, dict):
                yield f"flash_attn.cute.interface.{attr}", cache


def cute_kernel_builds() -> int:
    """CuTe kernels built in this process so far: ours (each kernel package's `_COMPILED`) and flash-attn-4's
    (its interface functions' `compile_cache`). Imports nothing: a stack not yet imported has built nothing."""
    return sum(len(cache) for _, cache in _cute_caches())


def cute_kernel_keys() -> set[str]:
    """`cache name: compile key` of every CuTe kernel `cute_kernel_builds` counts (to say which were built)."""
    return {f"{name}: {key}" for name, cache in _cute_caches() for key in cache}
