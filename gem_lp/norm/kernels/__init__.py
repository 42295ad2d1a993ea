"""RMSNorm kernels by toolchain: the BF16 recipe's forward and backward (quack's CuTe kernels, `cute_forward`,
`cute_backward`) and the backward in Triton (`triton_backward`). The norm fused with the MX cast is the MX cast
kernel's RMSNorm prologue (`gem_lp.mx.kernels`)."""
from __future__ import annotations

import torch


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                      impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's dx (x's dtype) and dweight (FP32) on implementation `impl` of the dispatch table (`cute`, `triton`,
    `reference`); on CPU tensors the Triton kernel runs in its interpreter when that is on, except in an emulated plan
    (`dispatch.emulate`), which runs the reference as the kernels' CPU model."""
    if impl == "cute" and x.is_cuda:
        from gem_lp.norm.kernels.cute_backward import rms_norm_backward_cute

        return rms_norm_backward_cute(x, weight, rstd, dy)
    from gem_lp.runtime.device import interpreter_enabled
    from gem_lp.runtime.dispatch import emulated_arch

    if impl != "reference" and (x.is_cuda or (interpreter_enabled() and not emulated_arch())):
        from gem_lp.norm.kernels.triton_backward import rms_norm_backward as triton_backward

        return triton_backward(x, weight, rstd, dy)
    from gem_lp.norm.reference import rms_norm_backward_reference

    return rms_norm_backward_reference(x, weight, rstd, dy)
