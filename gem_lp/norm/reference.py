"""Reference RMSNorm, with and without the MX cast: FP32 math (the oracle of `gem_lp.norm`)."""
from __future__ import annotations

import dataclasses

import torch

from gem_lp.mx.formats import MXTensor
from gem_lp.mx.reference import quantize_reference, rms_norm_fp32


@dataclasses.dataclass
class RMSNormQuantized:
    """RMSNorm output `y [M, K]` in MXFP8 with both layouts, from one FP32 computation.

    Attributes:
        rowwise: y quantized 1x32 along K (payload `[M, K]`, scale `[M, K/32]`, or flat in the blocked layout
            with `rms_norm_quantize(..., scale_layout="blocked")`): the forward GEMM operand.
        colwise: y^T `[K, M]` quantized 1x32 along M (scale `[K, ceil(M/32)]`, a partial last block takes
            its max over the real rows): the operand of the weight gradient. Contiguous here; the kernels'
            payload is a view with rows padded to a multiple of 16 bytes (same values).
        rstd: `[M]` float32, `1 / sqrt(mean(x^2) + eps)`.
    """

    rowwise: MXTensor
    colwise: MXTensor
    rstd: torch.Tensor


def rms_norm_quantize_reference(x2: torch.Tensor, weight: torch.Tensor, eps: float, scaling: str) -> RMSNormQuantized:
    """RMSNorm of `x2 [M, K]` quantized rowwise and colwise from the FP32 output."""
    y, rstd = rms_norm_fp32(x2.detach(), weight.detach(), eps)
    rowwise = quantize_reference(y, axis=1, scaling=scaling)
    colwise = quantize_reference(y.t(), axis=1, scaling=scaling, allow_partial=True)
    return RMSNormQuantized(rowwise, colwise, rstd)


def rms_norm_backward_reference(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                                dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dx `[M, K]` in x's dtype and dweight `[K]` FP32 of `y = x * rstd * weight`, in FP32 from the saved rstd."""
    xhat = x.to(torch.float32) * rstd[:, None]
    dy32 = dy.to(torch.float32)
    dxhat = dy32 * weight.to(torch.float32)
    dx = rstd[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy32 * xhat).sum(0)
