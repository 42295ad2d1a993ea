"""Public MX quantization entry points: each validates its arguments and dispatches to a backend.

The Triton backend (`triton_quantize.mx_cast_2d`) covers 1x32 blocks along the last axis (any rank),
32x1 blocks along axis 0 of a 2-D tensor, and 32x32 square blocks; with `backend="auto"` anything
else runs on the reference, with `backend="triton"` it is an error.
"""
from __future__ import annotations

import math

import torch

from gem_lp.runtime import dispatch
from gem_lp.runtime.device import skips_dispatch
from gem_lp.mx.formats import BLOCK, BLOCKS, PAYLOAD_DTYPE, SCALE_DTYPE, MXTensor, check_input, check_scaling
from gem_lp.mx.layout import blocked_size, to_blocked
from gem_lp.mx.reference import dequantize as _dequantize_reference
from gem_lp.mx.reference import quantize_reference

SCALE_LAYOUTS = ("plain", "blocked")


def _normalize_axis(x: torch.Tensor, axis: int) -> int:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dims")
    return axis % x.dim()


def _check_multiple(n: int, what: str) -> None:
    if n % BLOCK:
        raise ValueError(f"{what} has size {n}, which is not a multiple of {BLOCK}; MX blocks are {BLOCK} elements")


def _triton_unsupported(x: torch.Tensor, ax: int | None, block: str) -> str | None:
    """Why the Triton kernel cannot produce this quantization, or None when it can."""
    if block == "square":
        return None
    if ax == x.dim() - 1:
        return None
    if ax == 0 and x.dim() == 2:
        return None
    return (f"the Triton MX cast blocks along the last axis or along axis 0 of a 2-D tensor; "
            f"got axis={ax} for shape {tuple(x.shape)} (use backend='reference' or 'auto')")


def _quantize_triton(x: torch.Tensor, ax: int | None, scaling: str, block: str, scale_layout: str) -> MXTensor:
    from gem_lp.mx.kernels.triton_quantize import mx_cast_2d

    blocked = scale_layout == "blocked"
    if block == "square":
        R, C = x.shape[-2:]
        _check_multiple(R, f"x.shape[{x.dim() - 2}]")
        _check_multiple(C, f"x.shape[{x.dim() - 1}]")
        # 32x32 tiles of the [B*R, C] matrix are the per-matrix tiles because R % 32 == 0.
        rows = math.prod(x.shape[:-1])
        data, scale = mx_cast_2d(x.reshape(rows, C), rowwise=False, square=True, scaling=scaling)
        return MXTensor(data.view(x.shape), scale.view(*x.shape[:-2], R // BLOCK, C // BLOCK),
                        "square", None, scaling, x.dtype)
    if ax == x.dim() - 1:
        K = x.shape[-1]
        _check_multiple(K, f"x.shape[{ax}]")
        rows = math.prod(x.shape[:-1])
        data, scale = mx_cast_2d(x.reshape(rows, K), rowwise=True, scaling=scaling, blocked_scales=blocked)
        if not blocked:
            scale = scale.view(*x.shape[:-1], K // BLOCK)
        return MXTensor(data.view(x.shape), scale, "1d", ax, scaling, x.dtype, scale_layout)
    # axis 0 of a 2-D tensor: the colwise kernel writes x^T's payload [K, M]; present it as [M, K].
    _check_multiple(x.shape[0], "x.shape[0]")
    data_t, scale_t = mx_cast_2d(x, rowwise=False, colwise=True, scaling=scaling)
    return MXTensor(data_t.t(), scale_t.t(), "1d", 0, scaling, x.dtype)


def quantize(
    x: torch.Tensor,
    *,
    axis: int = -1,
    scaling: str = "rceil",
    block: str = "1d",
    scale_layout: str = "plain",
    backend: str = "auto",
) -> MXTensor:
    """Quantize `x` to MXFP8 (E4M3 payload, E8M0 scale per 32 elements).

    Args:
        x: float32/bfloat16/float16 tensor; the blocked dimension(s) must be multiples of 32.
        axis: dimension of the 1x32 blocks (`block="1d"`).
        scaling: `"rceil"` (default, never overflows the payload) or `"floor"` (OCP).
        block: `"1d"` or `"square"` (32x32 over the last two dims; transpose-invariant payload).
        scale_layout: `"plain"` (scales shaped like the payload with blocked dims divided by 32) or
            `"blocked"` (the 128x4 layout of `layout.to_blocked`; only for `"1d"` along the last
            axis of a 2-D `[M, K]` tensor: a flat uint8 tensor for the `[M, K/32]` scale matrix).
        backend: `"auto"` (the table's: triton on GPUs, the reference on the CPU), `"reference"` or `"triton"`.

    Returns:
        `MXTensor` with payload of `x`'s shape. From the Triton backend with `axis=0` the payload
        and scales are transposed views of the contiguous `[K, M]` / `[K, M/32]` tensors it writes.
    """
    check_input(x)
    check_scaling(scaling)
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    ax = _normalize_axis(x, axis) if block == "1d" else None
    if block == "square" and x.dim() < 2:
        raise ValueError(f"block='square' needs at least 2 dims, got shape {tuple(x.shape)}")
    if scale_layout == "blocked" and not (block == "1d" and x.dim() == 2 and ax == 1):
        raise ValueError(
            f"scale_layout='blocked' needs block='1d' along the last axis of a 2-D tensor; got "
            f"block={block!r}, axis={axis} for shape {tuple(x.shape)}")
    requested = backend
    backend = dispatch.choose("quantize", "mxfp8", x.device, backend)
    if backend == "triton":
        why = _triton_unsupported(x, ax, block)
        if why is None:
            return _quantize_triton(x, ax, scaling, block, scale_layout)
        if requested == "triton":
            raise ValueError(why)
    mx = quantize_reference(x, axis=axis, scaling=scaling, block=block)
    if scale_layout == "blocked":
        mx = MXTensor(mx.data, to_blocked(mx.scale), "1d", 1, scaling, x.dtype, "blocked")
    return mx


def quantize_dual(x: torch.Tensor, *, scaling: str = "rceil", backend: str = "auto") -> tuple[MXTensor, MXTensor]:
    """Both MXFP8 casts a GEMM and its transpose need, from one read of `x` (one kernel launch).

    Args:
        x: `[M, K]` float32/bfloat16/float16; K a multiple of 32, M any size.
        scaling: `"rceil"` (default) or `"floor"`.
        backend: `"auto"` (the table's: cute on sm_90 / sm_100 with the CuTe DSL stack, triton on other GPUs,
            the reference on the CPU), `"reference"`, `"triton"` or `"cute"` (K at most 8192).

    Returns:
        `(rowwise, colwise)`: `rowwise` has payload `[M, K]` (1x32 blocks along K) and the blocked
        layout of its `[M, K/32]` scales; `colwise` has payload `[K, M]`, the payload of `x^T`
        quantized along its last dim (a last partial block of M takes its max over the real rows
        only), and the blocked layout of its `[K, ceil(M/32)]` scales. Both have
        `scale_layout="blocked"` and `axis=1`. The colwise payload is contiguous from the reference; from
        the kernels it is a view whose rows are `formats.colwise_row_stride(M)` bytes apart (M rounded up to 32:
        contiguous when M is a multiple of 32), as the kernels' stores and a GEMM's TMA loads want it.
    """
    check_input(x)
    check_scaling(scaling)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _check_multiple(x.shape[1], "x.shape[1] (K)")
    requested = backend
    backend = dispatch.choose("quantize_dual", "mxfp8", x.device, backend)
    if backend == "cute":
        from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast, unsupported

        why = unsupported(x)
        if why is None:
            out = norm_mx_cast(x, None, scaling=scaling, blocked_scales=True)
            return (MXTensor(out.row_data, out.row_scale, "1d", 1, scaling, x.dtype, "blocked"),
                    MXTensor(out.col_data, out.col_scale, "1d", 1, scaling, x.dtype, "blocked"))
        if requested == "cute":
            raise ValueError(f"backend='cute' cannot run quantize_dual: {why}")
        backend = "triton"
    if backend == "triton":
        x = (x if x.stride(-1) == 1 else x.contiguous()).detach()  # not differentiable: no autograd graph
        args = (x, scaling == "rceil")
        row_data, row_scale, col_data, col_scale = (_dual_cast_triton(*args) if skips_dispatch(x)
                                                    else _dual_cast_triton_op(*args))
        return (MXTensor(row_data, row_scale, "1d", 1, scaling, x.dtype, "blocked"),
                MXTensor(col_data, col_scale, "1d", 1, scaling, x.dtype, "blocked"))
    row = quantize_reference(x, axis=1, scaling=scaling)
    col = quantize_reference(x.t(), axis=1, scaling=scaling, allow_partial=True)
    row_data, row_scale = row.data, to_blocked(row.scale)
    col_data, col_scale = col.data, to_blocked(col.scale)
    return (MXTensor(row_data, row_scale, "1d", 1, scaling, x.dtype, "blocked"),
            MXTensor(col_data, col_scale, "1d", 1, scaling, x.dtype, "blocked"))


def _dual_cast_triton(x: torch.Tensor, rceil: bool) -> list[torch.Tensor]:
    """`quantize_dual`'s Triton implementation: the MX cast kernel without its prologue (blocked scales; the colwise
    payload a `[K, M]` view, rows `colwise_row_stride(M)` bytes apart)."""
    from gem_lp.mx.kernels.triton_cast import rms_norm_mx

    out = rms_norm_mx(x, None, scaling="rceil" if rceil else "floor", blocked_scales=True)
    return [out.rowwise.data, out.rowwise.scale, out.colwise.data, out.colwise.scale]


# The custom op is what traced and compiled graphs call (`torch.compile(fullgraph=True)` traces `quantize_dual` without
# a graph break); eager calls skip its dispatch (`skips_dispatch`).
_dual_cast_triton_op = torch.library.custom_op("gem_lp::mx_dual_cast", _dual_cast_triton, mutates_args=())


@_dual_cast_triton_op.register_fake
def _(x: torch.Tensor, rceil: bool) -> list[torch.Tensor]:
    from gem_lp.mx.formats import colwise_row_stride

    M, K = x.shape
    stride = colwise_row_stride(M)
    return [x.new_empty((M, K), dtype=PAYLOAD_DTYPE), x.new_empty((blocked_size(M, K // BLOCK),), dtype=SCALE_DTYPE),
            x.new_empty((K * stride,), dtype=PAYLOAD_DTYPE).as_strided((K, M), (stride, 1)),
            x.new_empty((blocked_size(K, -(-M // BLOCK)),), dtype=SCALE_DTYPE)]


def dequantize(mx: MXTensor) -> torch.Tensor:
    """FP32 tensor of `mx`'s logical shape (exact; blocks with a NaN scale give NaN)."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx must be an MXTensor, got {type(mx).__name__}")
    return _dequantize_reference(mx)
