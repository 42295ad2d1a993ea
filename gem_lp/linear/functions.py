"""The autograd Functions of the MX linears on the GPU routes (`gem_lp.linear.gemm`): the same recipe as
`reference.MXLinearReference` / `RMSNormMXLinearReference`, every GEMM contracting operands quantized 1x32 along its
own contraction dim with FP32 accumulation, made by the cast kernels (`operands.casts`).

Saved for the backward: X's colwise MX tensor (payload `[K, M]` + scales, half of a BF16 X), or X itself where an
input activation is computed again from it; dY is quantized once, in both layouts, by one pass that also sums its
columns (the bias gradient; FP32 atomics, so the summation order differs from torch's: equal within FP32 rounding).

Host work per call: at small and mid shapes the GPU waits for the host, so a call does little besides its
launches. The public ops (`gem_lp.linear.ops`) check the arguments once; these Functions trust them; the cuBLAS
route's bias is cast to Y's dtype once per bias version; nothing reads device memory on the host (no sync).
"""
from __future__ import annotations

import torch

from gem_lp.linear.gemm import MX_ROUTES, first_rows, gemm_nt, route_rows
from gem_lp.linear.operands import (ACTIVATION_BACKWARDS, casts, col_operand_of, dy_operands, operand_dtype_for,
                                    saved_col_operand, weight_operands)
from gem_lp.runtime import dispatch
from gem_lp.runtime.device import build_arch


def _norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's dx and dweight (FP32 math) from the implementation the table gives the RMSNorm backward (on CPU
    tensors, as the route's casts, the Triton kernel in its interpreter)."""
    impl = dispatch.choose("rms_norm_backward", "fp32", x.device, "auto" if x.is_cuda else "triton")
    return dispatch.entry("gem_lp.norm.kernels:rms_norm_backward")(x, weight, rstd, dy, impl)


def _payload_weight_grad(payload, dy_col_t, route: str, dw_dtype: torch.dtype) -> torch.Tensor | None:
    """dW from X's saved colwise payload `(data, scale)` by the CuTe MX GEMM, which decodes the payload in registers
    (no dequantized copy of X), where the plan takes it and `weight_grad_taken` says so; else None (the caller
    dequantizes)."""
    if payload is None or route != "cublas" or dy_col_t is None or not dy_col_t.is_cuda:
        return None
    if dispatch.choose("linear_weight_grad", "mxfp8", dy_col_t.device) != "cute":
        return None
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90, weight_grad_taken

    data, scale = payload
    if not weight_grad_taken(build_arch(data.device), data.shape[1], dy_col_t):
        return None
    return mx_weight_grad_sm90(data, scale, dy_col_t, dw_dtype)


def _linear_backward(ctx, dy, w_ops, make_x_col, d_in_dtype, dw_dtype, need_in, need_w, need_b, rows=None,
                     dy_activation=None, dy_row_out=None, padded_d_in=False, payload=None):
    """dIn `[M, K]` (d_in_dtype), dW `[N, K]` (dw_dtype), db `[N]` FP32 of `Y = In W^T + b`. `make_x_col()`: the dW
    GEMM's B operand from what the forward kept (`saved_col_operand`, `col_operand_of`), made when dW is computed
    and released before dIn is allocated. `rows`: the GEMMs' padded M (the operand then has `rows` columns, zeros
    past M); dIn is then a view of its first M rows (with `padded_d_in`, the `[rows, K]` tensor itself).
    `dy_activation`: see `dy_operands` (`dy` is the gradient of an activation whose input is Y). `dy_row_out`: the
    buffer dY's row operand is written into (`dy_operands`' `row_out`; dy's own buffer, whose memory then serves
    again). db is the column sums the cast of dY makes. `payload`: X's saved colwise `(data, scale)` that
    `make_x_col` dequantizes, for `_payload_weight_grad`.

    dW comes first, then dIn: the input's operand (as large as the input on the cuBLAS route) and dIn are never live
    together. A dY whose exact-value operands exceed `FORWARD_OPERAND_MAX_BYTES` is cast in two passes (one more read
    of dY), the colwise operand released after dW before the rowwise one is made.
    """
    scaling, route = ctx.scaling, ctx.route
    separate = route == "cublas" and need_in and need_w and \
        dy.shape[0] * dy.shape[1] * operand_dtype_for(dy.dtype).itemsize > FORWARD_OPERAND_MAX_BYTES
    dy_row, dy_col_t, dy_sums = dy_operands(dy, scaling, route, need_b, rows, row=need_in and not separate,
                                            col=need_w or not need_in, dy_activation=dy_activation,
                                            row_out=None if separate else dy_row_out)
    d_in = d_w = None
    if need_w:
        d_w = _payload_weight_grad(payload, dy_col_t, route, dw_dtype)
        if d_w is None:
            d_w = gemm_nt(dy_col_t, make_x_col(), route, dw_dtype)
    del dy_col_t
    if need_in:
        if separate:
            dy_row = dy_operands(dy, scaling, route, False, rows, col=False, dy_activation=dy_activation,
                                 row_out=dy_row_out)[0]
        if route in MX_ROUTES:  # B = W^T quantized along N, [K, N]
            d_in = gemm_nt(dy_row, w_ops.col, route, d_in_dtype)
        else:  # B^T = the colwise values of W, [N, K]: B = their transposed view
            d_in = gemm_nt(dy_row, w_ops.col.t(), route, d_in_dtype)
        if not padded_d_in:
            d_in = first_rows(d_in, dy.shape[0])
    return d_in, d_w, dy_sums


def _as_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# The cuBLAS route casts the whole input into a BF16 operand as large as the input before the forward GEMM. At a long
# history that transient sets the step's peak (the MLP down-projection's operand is as large as its input). An
# operand above FORWARD_OPERAND_MAX_BYTES is cast and multiplied in row chunks of at most
# FORWARD_OPERAND_CHUNK_BYTES (powers of two: the full chunks' GEMMs share one shape and write Y in place), the
# colwise cast for dW and the norm's rstd made by a pass of their own: one more read of X, the same values.
FORWARD_OPERAND_MAX_BYTES = 1 << 30
FORWARD_OPERAND_CHUNK_BYTES = 1 << 28


def _cast_and_gemm(x: torch.Tensor, g: torch.Tensor | None, eps: float, w_row, bias: torch.Tensor | None,
                   scaling: str, route: str, opd: torch.dtype, colwise: bool, out_dtype: torch.dtype,
                   activation: str | None = None):
    """`(Y [M, N], the cast's outputs)` of a forward: `(RMSNorm(x) if g else activation(x))` cast for the route,
    times `w_row^T` (+ bias). The outputs hold the colwise cast when `colwise`, and rstd with `g`; in row chunks (see
    `FORWARD_OPERAND_MAX_BYTES`) they hold no row operand, and are None when neither was asked for."""
    M, K = x.shape
    mx_ops = route in MX_ROUTES
    row_bytes = K * opd.itemsize
    if route != "cublas" or M * row_bytes <= FORWARD_OPERAND_MAX_BYTES or x.dtype != out_dtype:
        out = casts(x, g, eps, scaling=scaling, rowwise=mx_ops, colwise=colwise, row_operand=not mx_ops,
                    operand_dtype=opd, operand_rows=route_rows(M, route), activation=activation)
        y = gemm_nt(out.rowwise if mx_ops else out.row_operand, w_row, route, out_dtype, bias)
        return first_rows(y, M), out
    out = None  # the colwise cast (and with the norm rstd, which the pass makes as well) by a pass of their own
    if colwise or g is not None:
        out = casts(x, g, eps, scaling=scaling, rowwise=False, colwise=True, activation=activation)
    chunk = 1 << max(5, (FORWARD_OPERAND_CHUNK_BYTES // row_bytes).bit_length() - 1)
    y = torch.empty(M, w_row.shape[0], dtype=out_dtype, device=x.device)
    for m0 in range(0, M, chunk):
        rows = min(chunk, M - m0)
        op = casts(x[m0:m0 + rows], g, eps, scaling=scaling, rowwise=False, colwise=False, row_operand=True,
                   operand_dtype=opd, operand_rows=route_rows(rows, route), activation=activation).row_operand
        if op.shape[0] == rows:  # a full chunk (or a partial one the buckets left unpadded): Y's rows in place
            gemm_nt(op, w_row, route, out_dtype, bias, out=y[m0:m0 + rows])
        else:
            y[m0:m0 + rows] = gemm_nt(op, w_row, route, out_dtype, bias)[:rows]
        del op  # freed before the next chunk's operand is allocated: one chunk live at a time
    return y, out


class MXLinearFunction(torch.autograd.Function):
    """`Y [M, N] = act(X [M, K]) W^T + b` by the MXLinear recipe on a GPU route.

    `activation` None (act the identity) or a key of `reference.INPUT_ACTIVATIONS`: the casts compute act(X) on the fly
    (it is never stored) and X is kept for the activation's backward. With X kept, the colwise cast of act(X) that dW
    needs is not: the backward makes it again from X (`col_operand_of`), the same bytes, so that the layer keeps X
    alone (2 bytes per element for BF16, where X and the colwise cast were 3). Arguments checked by the caller
    (`ops.mx_linear`); `route` one of `gemm.ROUTES`."""

    @staticmethod
    def forward(ctx, x2, weight, bias, scaling: str, route: str, activation: str | None = None):
        opd = operand_dtype_for(x2.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # only dW reads X's colwise cast
        w_ops = weight_operands(weight, scaling, route, opd, need_col=need_x)
        x = _contiguous_last(x2)
        keep_x = activation is not None and need_x
        colwise = need_w and not keep_x
        y, out = _cast_and_gemm(x, None, 0.0, w_ops.row, bias, scaling, route, opd, colwise, x2.dtype, activation)
        col = out.colwise if colwise else None
        ctx.save_for_backward(col.data if colwise else None, col.scale if colwise else None, weight,
                              x if keep_x else None)
        ctx.w_ops, ctx.scaling, ctx.route, ctx.activation = w_ops, scaling, route, activation
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _mx_linear_backward(ctx, dy)
        return dx, dw, db, None, None, None


def _mx_linear_backward(ctx, dy, activation_backward: bool = True):
    """`MXLinearFunction`'s dX, dW, db. With an input activation and `activation_backward=False`, dX is the
    gradient of act(X) (its backward left to the caller, `RMSNormMXMLPFunction`), as the GEMM wrote it: with
    its padded rows (`_linear_backward`'s `padded_d_in`)."""
    x_data, x_scale, weight, x = ctx.saved_tensors
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    w_ops = weight_operands(weight, ctx.scaling, ctx.route, operand_dtype_for(x_dtype), need_col=True) \
        if need_x and ctx.w_ops.col is None else ctx.w_ops
    rows = route_rows(dy.shape[0], ctx.route)

    def x_col():
        if x_data is None:  # X kept instead: the cast of its activation again
            return col_operand_of(x, ctx.activation, ctx.scaling, ctx.route, rows)
        return saved_col_operand(x_data, x_scale, ctx.scaling, ctx.route, x_dtype, rows)

    dx, dw, db = _linear_backward(ctx, dy, w_ops, x_col, x_dtype, w_dtype, need_x, need_w, need_b, rows,
                                  padded_d_in=not activation_backward,
                                  payload=None if x_data is None else (x_data, x_scale))
    if dx is not None and ctx.activation is not None and activation_backward:  # dX is act(X)'s gradient: in place
        dx = ACTIVATION_BACKWARDS[ctx.activation](dx, x, grad_input=dx)
    return dx, dw, _as_dtype(db, b_dtype)


class RMSNormMXLinearFunction(torch.autograd.Function):
    """`Y = RMSNorm(X) W^T + b` on a GPU route: the fused norm + cast kernel produces the forward operand and
    the saved colwise MX tensor; the backward runs the MXLinear GEMMs (dYn in X's dtype, as the reference's) and the
    norm backward kernel.

    Arguments checked by the caller (`ops.rms_norm_mx_linear`).
    """

    @staticmethod
    def forward(ctx, x2, norm_weight, weight, bias, eps: float, scaling: str, route: str):
        opd = operand_dtype_for(x2.dtype)
        x = _contiguous_last(x2)
        g = _contiguous_last(norm_weight)
        need_w = ctx.needs_input_grad[2]  # only dW reads the colwise cast of the normalized activation
        need_dyn = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w_ops = weight_operands(weight, scaling, route, opd, need_col=need_dyn)
        y, out = _cast_and_gemm(x, g, eps, w_ops.row, bias, scaling, route, opd, need_w, x2.dtype)
        col = out.colwise
        ctx.save_for_backward(x, g, out.rstd, col.data if need_w else None, col.scale if need_w else None, weight)
        ctx.w_ops, ctx.scaling, ctx.route = w_ops, scaling, route
        ctx.dtypes = (x2.dtype, norm_weight.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_norm_linear_backward(ctx, dy), None, None, None)


def _norm_linear_backward(ctx, dy, dy_activation=None, dy_row_out=None):
    """`RMSNormMXLinearFunction`'s dX, dnorm_weight, dW, db; `dy_activation`, `dy_row_out` as
    `_linear_backward`'s."""
    x, norm_weight, rstd, yn_data, yn_scale, weight = ctx.saved_tensors
    x_dtype, g_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_g, need_w, need_b = ctx.needs_input_grad[:4]
    need_dyn = need_x or need_g
    w_ops = weight_operands(weight, ctx.scaling, ctx.route, operand_dtype_for(x_dtype), need_col=True) \
        if need_dyn and ctx.w_ops.col is None else ctx.w_ops
    rows = route_rows(dy.shape[0], ctx.route)
    dyn, dw, db = _linear_backward(
        ctx, dy, w_ops, lambda: saved_col_operand(yn_data, yn_scale, ctx.scaling, ctx.route, x_dtype, rows),
        x_dtype, w_dtype, need_dyn, need_w, need_b, rows, dy_activation, dy_row_out,
        payload=None if yn_data is None else (yn_data, yn_scale))
    dx = dg = None
    if need_dyn:  # RMSNorm backward in FP32 from the saved rstd
        dx, dg = _norm_backward(x, norm_weight, rstd, dyn)
        dg = _as_dtype(dg, g_dtype)
    return dx, dg, dw, _as_dtype(db, b_dtype)


class _LayerContext:
    """The autograd context one layer's Function (`RMSNormMXLinearFunction`, `MXLinearFunction`) sees
    when a fused Function runs it: its `needs_input_grad`, the tensors it saves (the fused Function saves them
    through its own context) and its attributes."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


class RMSNormMXMLPFunction(torch.autograd.Function):
    """`down(act(up(X)))`: `RMSNormMXLinearFunction` (up) then `MXLinearFunction` with the input activation
    (down), whose backward hands the up-projection the gradient of act's output: the up-projection's dY casts compute
    act's backward on the fly (`dy_operands`' `dy_activation`), so that gradient is never stored and its own pass
    (read the gradient and the pre-activation, write their product) is gone. The same values as the two Functions
    composed (the activation's backward rounded to X's dtype either way). Arguments checked by the caller
    (`ops.rms_norm_mx_mlp`).
    """

    @staticmethod
    def forward(ctx, x2, norm_weight, w_up, b_up, w_down, b_down, eps: float, scaling: str, route: str,
                activation: str):
        need = ctx.needs_input_grad
        up = _LayerContext((need[0], need[1], need[2], need[3]))
        h = RMSNormMXLinearFunction.forward(up, x2, norm_weight, w_up, b_up, eps, scaling, route)
        down = _LayerContext((any(need[:4]), need[4], need[5]))
        y = MXLinearFunction.forward(down, h, w_down, b_down, scaling, route, activation)
        ctx.save_for_backward(*up.saved_tensors, *down.saved_tensors)
        ctx.layers, ctx.n_up = (up, down), len(up.saved_tensors)
        up.saved_tensors = down.saved_tensors = ()  # held by ctx alone
        return y

    @staticmethod
    def backward(ctx, dy):
        up, down = ctx.layers
        saved = ctx.saved_tensors
        up.saved_tensors, down.saved_tensors = saved[:ctx.n_up], saved[ctx.n_up:]
        d_act, dw_down, db_down = _mx_linear_backward(down, dy, activation_backward=False)
        dx = dg = dw_up = db_up = None
        if d_act is not None:
            h = down.saved_tensors[3]  # the pre-activation, which the down-projection keeps
            # act's gradient (rows padded for the GEMMs) is read once, by the up-projection's dY cast, which writes
            # its row operand over it: the memory of the composed layers' backward (there, act's backward ran in
            # place on this buffer before the pre-activation was freed)
            dx, dg, dw_up, db_up = _norm_linear_backward(up, first_rows(d_act, dy.shape[0]), (down.activation, h),
                                                         dy_row_out=d_act)
        up.saved_tensors = down.saved_tensors = ()
        return dx, dg, dw_up, db_up, dw_down, db_down, None, None, None, None
