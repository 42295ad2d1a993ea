"""RMSNorm's backward in Triton: `dx = rstd * (dxhat - xhat * mean(dxhat * xhat))` with `xhat = x * rstd`,
`dxhat = dy * w`, and per-program partial `dw = sum_rows(dy * xhat)` (FP32) reduced by one `sum` over programs."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gem_lp.mx.formats import ceil_div
from gem_lp.mx.kernels.triton_cast import _check_2d, _check_weight, _pow2_at_least, load_f32, store_operand
from gem_lp.runtime.device import interpreter_enabled
from gem_lp.runtime.triton_launch import KernelLaunch

# (largest K, block_m, num_warps) of `rms_norm_backward`, first match; otherwise 16 rows on 8 warps (more rows spill).
# A row is one tile up to K = 2048, wider rows go in 1024-column chunks.
BWD_LAUNCHES = ((256, 32, 4),)


@triton.jit(do_not_specialize=["M"])  # M (tokens) changes every batch and is used only in masks
def _rms_norm_bwd_kernel(
    x_ptr, stride_xm, dy_ptr, stride_dym, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)[:, None]
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if ONE_PASS:
        ok = row_ok[:, None] & (cols < K)[None, :]
        xhat = load_f32(x_ptr + rows64 * stride_xm + cols[None, :], ok) * rstd
        dy = load_f32(dy_ptr + rows64 * stride_dym + cols[None, :], ok)
        dxhat = dy * load_f32(w_ptr + cols, cols < K)[None, :]
        mean = tl.div_rn(tl.sum(dxhat * xhat, axis=1), tl.full((), K, tl.float32))[:, None]
        store_operand(dx_ptr + rows64 * K + cols[None, :], rstd * (dxhat - xhat * mean), ok, HW_CAST)
        tl.store(dw_part_ptr + pid.to(tl.int64) * K + cols, tl.sum(dy * xhat, axis=0), mask=cols < K)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            ok = row_ok[:, None] & (c < K)[None, :]
            xhat = load_f32(x_ptr + rows64 * stride_xm + c[None, :], ok) * rstd
            dxhat = load_f32(dy_ptr + rows64 * stride_dym + c[None, :], ok) * load_f32(w_ptr + c, c < K)[None, :]
            acc += dxhat * xhat
        mean = tl.div_rn(tl.sum(acc, axis=1), tl.full((), K, tl.float32))[:, None]
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            ok = row_ok[:, None] & (c < K)[None, :]
            xhat = load_f32(x_ptr + rows64 * stride_xm + c[None, :], ok) * rstd
            dy = load_f32(dy_ptr + rows64 * stride_dym + c[None, :], ok)
            dxhat = dy * load_f32(w_ptr + c, c < K)[None, :]
            store_operand(dx_ptr + rows64 * K + c[None, :], rstd * (dxhat - xhat * mean), ok, HW_CAST)
            tl.store(dw_part_ptr + pid.to(tl.int64) * K + c, tl.sum(dy * xhat, axis=0), mask=c < K)



def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *,
                      block_m: int | None = None, block_k: int | None = None,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `y = x * rstd * weight` (rstd from x, as RMSNorm) with respect to x and weight.

    Args:
        x: `[M, K]` the forward input; weight: `[K]`; rstd: `[M]` float32 from the forward.
        dy: `[M, K]` gradient of y (any float dtype, contiguous last dim; FP32 keeps the reference's math).

    Returns:
        `dx [M, K]` in x's dtype and `dweight [K]` float32 (FP32 math throughout).
    """
    _check_2d(x, "x")
    _check_2d(dy, "dy")
    M, K = x.shape
    _check_weight(weight, K, x)
    if dy.shape != x.shape or dy.device != x.device:
        raise ValueError(f"dy must be [M={M}, K={K}] on {x.device}, got {tuple(dy.shape)} on {dy.device}")
    if rstd.dtype != torch.float32 or rstd.shape != (M,) or rstd.device != x.device or not rstd.is_contiguous():
        raise ValueError(f"rstd must be a contiguous float32 [M={M}] tensor on {x.device}, got "
                         f"{rstd.dtype} {tuple(rstd.shape)} on {rstd.device}")
    if interpreter_enabled():
        bm, bk, nw = 16, min(_pow2_at_least(K, 16), 128), 1
    else:
        bm, nw = next(((b, w) for k_max, b, w in BWD_LAUNCHES if K <= k_max), (16, 8))
        bk = _pow2_at_least(K, 16) if K <= 2048 else 1024
    block_m = bm if block_m is None else block_m
    block_k = bk if block_k is None else block_k
    num_warps = nw if num_warps is None else num_warps
    for name, v in (("block_m", block_m), ("block_k", block_k), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    dx = torch.empty(M, K, dtype=x.dtype, device=x.device)
    n_prog = ceil_div(M, block_m)
    if n_prog == 0:
        return dx, torch.zeros(K, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(n_prog, K, dtype=torch.float32, device=x.device)
    on_gpu = x.is_cuda and not interpreter_enabled()
    x_stride, dy_stride = x.stride(0), dy.stride(0)
    launch = _backward_launch(M, K, x_stride, dy_stride, block_m, block_k, num_warps, on_gpu)
    launch((x.detach(), x_stride, dy.detach(), dy_stride, weight.detach(), rstd, dx, dw_part, M, K), on_gpu)
    return dx, dw_part.sum(0)


@functools.lru_cache(maxsize=256)
def _backward_launch(M: int, K: int, x_stride: int, dy_stride: int, block_m: int, block_k: int, num_warps: int,
                     on_gpu: bool) -> KernelLaunch:
    """`_rms_norm_bwd_kernel`'s launch for these ints (relaunched directly after the first: `KernelLaunch`)."""
    return KernelLaunch(_rms_norm_bwd_kernel, (ceil_div(M, block_m),), 10,
                        dict(BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=block_k >= K, HW_CAST=on_gpu,
                             num_warps=num_warps))
