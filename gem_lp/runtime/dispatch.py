"""Which implementation each op takes: backend resolution shared by every op."""
from __future__ import annotations

import torch

from gem_lp.runtime.device import cute_unavailable, interpreter_enabled

BACKENDS = ("auto", "reference", "triton", "cute")


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
