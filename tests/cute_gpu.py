"""The module-level skip of the CuTe kernels' GPU tests."""
import pytest
import torch

from gem_lp.runtime.device import cute_unavailable


def require_cute_gpu(arch_major: int | None = None) -> None:
    """Skip the calling test module unless a CUDA device (of compute capability `arch_major`.x, when given) can
    run the CuTe kernels."""
    if not torch.cuda.is_available():
        reason = "needs a CUDA device"
    elif arch_major is not None and torch.cuda.get_device_capability()[0] != arch_major:
        reason = f"needs sm_{arch_major}0"
    else:
        reason = cute_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
