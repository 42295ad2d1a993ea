"""Reference MXFP8 linear layers (the oracle of `gem_lp.linear`): FP32 math with MX rounding at the recipe's points.

MXLinear recipe, `X [M, K]`, `W [N, K]`, `Y = X W^T + b [M, N]`:

* forward   Y  = deq(X 1x32 along K) deq(W 1x32 along K)^T + b
* backward  dX = deq(dY 1x32 along N) deq(W^T 1x32 along N)^T
            dW = deq(dY^T 1x32 along M) deq(X^T 1x32 along M)^T   (M may end in a partial block)
            db = sum of dY over M in FP32

Only X's colwise MX tensor (`X^T` along M) is saved for the backward, not X: half the activation bytes of
a BF16 layer. All GEMMs take exactly dequantized operands and accumulate in FP32.
"""
from __future__ import annotations

import functools

import torch

from gem_lp.mx.formats import MXTensor
from gem_lp.mx.reference import dequantize, quantize_reference, rms_norm_fp32


def rows_mx(t: torch.Tensor, scaling: str) -> torch.Tensor:
    """Dequantized 1x32 blocks along dim 1 of a 2-D tensor (FP32)."""
    return dequantize(quantize_reference(t, axis=1, scaling=scaling))


def cols_mx(t: torch.Tensor, scaling: str) -> MXTensor:
    """`t [M, C]` as `t^T [C, M]` quantized along M (partial last block allowed)."""
    return quantize_reference(t.t(), axis=1, scaling=scaling, allow_partial=True)


def mx_linear_grads(dy: torch.Tensor, weight: torch.Tensor, in_col: MXTensor, scaling: str, with_bias: bool):
    """dIn `[M, K]`, dW `[N, K]`, db `[N]` (FP32) of `Y = In W^T + b` from dY `[M, N]`."""
    d_in = rows_mx(dy, scaling) @ rows_mx(weight.t(), scaling).t()
    d_w = dequantize(cols_mx(dy, scaling)) @ dequantize(in_col).t()
    d_b = dy.to(torch.float32).sum(0) if with_bias else None
    return d_in, d_w, d_b


def no_autocast(fn):
    """Run an autograd Function's forward/backward with autocast off: the recipe fixes every GEMM's dtype."""

    @functools.wraps(fn)
    def wrapper(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return fn(ctx, first, *args)

    return wrapper


def _saved_mx(ctx, mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    ctx.mx_meta = (mx.block, mx.axis, mx.scaling, mx.orig_dtype)
    return mx.data, mx.scale


def _restore_mx(ctx, data: torch.Tensor, scale: torch.Tensor) -> MXTensor:
    block, axis, scaling, orig_dtype = ctx.mx_meta
    return MXTensor(data, scale, block, axis, scaling, orig_dtype)


class MXLinearReference(torch.autograd.Function):
    """`Y [M, N] = X [M, K] W^T + b` by the MXLinear recipe; saves X's colwise MX tensor, not X."""

    @staticmethod
    @no_autocast
    def forward(ctx, x2, weight, bias, scaling: str):
        y = rows_mx(x2, scaling) @ rows_mx(weight, scaling).t()
        if bias is not None:
            y = y + bias.to(torch.float32)
        ctx.save_for_backward(*_saved_mx(ctx, cols_mx(x2, scaling)), weight)
        ctx.scaling, ctx.has_bias = scaling, bias is not None
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x2.dtype)

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        x_data, x_scale, weight = ctx.saved_tensors
        x_col = _restore_mx(ctx, x_data, x_scale)
        dx, dw, db = mx_linear_grads(dy, weight, x_col, ctx.scaling, ctx.has_bias)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        return dx.to(x_dtype), dw.to(w_dtype), None if db is None else db.to(b_dtype), None


class RMSNormMXLinearReference(torch.autograd.Function):
    """`Y = RMSNorm(X) W^T + b` with the normalized activation produced once in both MX layouts.

    Forward: rowwise MX of yn feeds the GEMM; its colwise MX, rstd and X are saved. Backward: dYn and dW
    by the MXLinear recipe, dYn rounded once to X's dtype (what BF16 autograd hands a norm: the GEMM writes half
    the bytes and the norm backward reads half), then RMSNorm's backward in FP32 with the saved rstd.
    """

    @staticmethod
    @no_autocast
    def forward(ctx, x2, norm_weight, weight, bias, eps: float, scaling: str):
        yn, rstd = rms_norm_fp32(x2.detach(), norm_weight.detach(), eps)
        y = rows_mx(yn, scaling) @ rows_mx(weight, scaling).t()
        if bias is not None:
            y = y + bias.to(torch.float32)
        ctx.save_for_backward(x2, norm_weight, rstd, *_saved_mx(ctx, cols_mx(yn, scaling)), weight)
        ctx.scaling, ctx.has_bias = scaling, bias is not None
        ctx.dtypes = (x2.dtype, norm_weight.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x2.dtype)

    @staticmethod
    @no_autocast
    def backward(ctx, dy):
        x2, norm_weight, rstd, yn_data, yn_scale, weight = ctx.saved_tensors
        dyn, dw, db = mx_linear_grads(dy, weight, _restore_mx(ctx, yn_data, yn_scale), ctx.scaling, ctx.has_bias)
        dyn = dyn.to(x2.dtype).to(torch.float32)
        # RMSNorm backward, FP32: yn = xhat * g with xhat = x * rstd
        xhat = x2.to(torch.float32) * rstd[:, None]
        dxhat = dyn * norm_weight.to(torch.float32)
        dx = rstd[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dg = (dyn * xhat).sum(0)
        x_dtype, g_dtype, w_dtype, b_dtype = ctx.dtypes
        return (dx.to(x_dtype), dg.to(g_dtype), dw.to(w_dtype), None if db is None else db.to(b_dtype),
                None, None)
