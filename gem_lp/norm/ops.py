"""Public RMSNorm ops: each validates its arguments and dispatches to the implementation the table gives it
(`gem_lp.runtime.dispatch`)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from gem_lp.checks import check_norm
from gem_lp.mx.formats import BLOCK, MXTensor, check_scaling
from gem_lp.mx.layout import to_blocked
from gem_lp.mx.ops import SCALE_LAYOUTS
from gem_lp.mx.reference import rms_norm_fp32
from gem_lp.norm.reference import RMSNormQuantized, rms_norm_quantize_reference
from gem_lp.runtime import dispatch

PRECISIONS = ("fp32", "bf16")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, precision: str = "fp32",
             backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim, `x [..., K]`, `weight [K]`, differentiable; output in x's dtype.

    `precision="fp32"`: `fp32(x) * rstd * fp32(weight)` in PyTorch. `"bf16"`: the BF16 recipe's norm, torch's
    `F.rms_norm` on x's dtype (its reference), or on sm_90 / sm_100 for a 16-bit x quack's CuTe kernels (FP32 math,
    one rounding; the order of the two multiplies may differ from torch's by one rounding). `backend`: "auto",
    "reference" or "cute".
    """
    check_norm(x, weight, eps)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        y, _ = rms_norm_fp32(x, weight, eps)
        return y.to(x.dtype)
    if dispatch.choose("rms_norm", "bf16", x.device, backend) == "cute" and x.is_cuda:
        from gem_lp.norm.kernels.cute_forward import RMSNormCute, takes

        if takes(x, weight):
            k = x.shape[-1]
            return RMSNormCute.apply(x.reshape(-1, k), weight, float(eps)).view(x.shape)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, scaling: str = "rceil",
                      scale_layout: str = "plain", backend: str = "auto") -> RMSNormQuantized:
    """RMSNorm of `x [..., K]` (flattened to `[M, K]`, K a multiple of 32) quantized to MXFP8.

    `y = fp32(x) * rstd * fp32(weight)` is quantized from FP32, rowwise (1x32 along K of `y [M, K]`) and
    colwise (`y^T [K, M]` along M, partial last block allowed); `rstd [M]` float32. `scale_layout`: "plain"
    (`[M, K/32]` and `[K, ceil(M/32)]`) or "blocked" (the flat 128x4 layout of `gem_lp.mx.to_blocked` that
    block-scaled GEMMs read; the CuTe kernel writes it faster than the plain one, docs/PERF.md). Not
    differentiable. `backend`: "auto" (the table's: cute on sm_90 / sm_100 with the CuTe DSL stack, triton on
    other GPUs, the reference on the CPU), "reference", "triton" or "cute" (K at most 8192). The kernels' colwise
    payload is a `[K, M]` view with rows padded to a multiple of 16 bytes (not contiguous unless M is a multiple of
    16), the CuTe kernel's plain colwise scales a transposed view (strides `(1, K)`); the reference's are contiguous:
    compare values, not layouts.
    """
    check_norm(x, weight, eps)
    check_scaling(scaling)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    blocked = scale_layout == "blocked"
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"rms_norm_quantize needs x's last dim K to be a multiple of {BLOCK}, got K={k}")
    x2 = x.reshape(-1, k)
    chosen = dispatch.choose("rms_norm_quantize", "mxfp8", x.device, backend)
    if chosen == "cute":
        from gem_lp.mx.kernels.cute_cast_launch import unsupported

        why = unsupported(x2)
        if why is not None:
            if backend == "cute":
                raise ValueError(f"backend='cute' cannot run rms_norm_quantize: {why}")
            chosen = "triton"
    if chosen == "cute":
        from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast

        out = norm_mx_cast(x2, weight, eps, scaling=scaling, blocked_scales=blocked)
        return RMSNormQuantized(MXTensor(out.row_data, out.row_scale, "1d", 1, scaling, torch.float32, scale_layout),
                                MXTensor(out.col_data, out.col_scale, "1d", 1, scaling, torch.float32, scale_layout),
                                out.rstd)
    if chosen == "triton":
        from gem_lp.mx.kernels.triton_cast import rms_norm_mx

        x2 = x2 if x2.stride(-1) == 1 or k == 1 else x2.contiguous()
        out = rms_norm_mx(x2, weight if weight.stride(0) == 1 else weight.contiguous(), eps, scaling=scaling,
                          blocked_scales=blocked)
        return RMSNormQuantized(out.rowwise, out.colwise, out.rstd)
    out = rms_norm_quantize_reference(x2, weight, eps, scaling)
    if blocked:
        out = RMSNormQuantized(*(replace(q, scale=to_blocked(q.scale), scale_layout="blocked")
                                 for q in (out.rowwise, out.colwise)), out.rstd)
    return out
