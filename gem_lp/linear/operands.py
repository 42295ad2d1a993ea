"""The operands the MX linears' GEMMs read, and the casts that make them.

Every GEMM of the recipe contracts operands quantized 1x32 along its own contraction dim. On the `cublas` route the
casts write the MX-exact values (BF16, FP32 for FP32 layers); on `scaled_mm` they write MX tensors (E4M3 payload +
blocked scales). The casts are the MX cast kernels of `gem_lp.mx.kernels` (with the RMSNorm prologue for the norm
layers, with an input activation for an MLP's down-projection): the CuTe kernel where the per-arch table
(`cute_cast_config.LINEAR_CASTS_FROM_K`) and the dispatch table say so, else the Triton kernel.

W's two quantizations (along K for Y, along N for dX) are cached per weight until `weight._version` (or its storage)
changes, i.e. once per optimizer step; nothing is cached or read from the cache while a CUDA graph is captured.
"""
from __future__ import annotations

import dataclasses

import torch

from gem_lp.linear.cache import PerTensorCache
from gem_lp.linear.gemm import MX_ROUTES
from gem_lp.mx.formats import MXTensor
from gem_lp.mx.reference import dequantize
from gem_lp.mx.casts import NormMXOutputs, casts_reference
from gem_lp.mx.kernels.triton_cast import rms_norm_mx
from gem_lp.mx.kernels.triton_dequantize import dequantize_operand
from gem_lp.runtime import dispatch
from gem_lp.runtime.device import build_arch, capturing, interpreter_enabled

# The backward of each input activation the casts compute (`gem_lp.mx.reference.INPUT_ACTIVATIONS`), from the saved
# input and the gradient of the activation's output, as torch's autograd computes it.
ACTIVATION_BACKWARDS = {"silu": torch.ops.aten.silu_backward.grad_input}


def operand_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the MX-exact GEMM operands for activations of `dtype`: FP32 for FP32, else BF16."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def _cute_cast(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """The cast of `x` (normalized by `weight` unless None) runs on the CuTe kernel: the plan takes the CuTe MX cast on
    this device and the arch's table names the cast's K (most casts of a step have no norm or a narrow one: the
    cheap tests first)."""
    if not x.is_cuda:
        return False
    from gem_lp.mx.kernels.cute_cast_config import LINEAR_CASTS_FROM_K

    from_k = LINEAR_CASTS_FROM_K.get(build_arch(x.device), (None, None))[0 if weight is not None else 1]
    if from_k is None or x.shape[-1] < from_k:
        return False
    if dispatch.choose("rms_norm_quantize", "mxfp8", x.device) != "cute":
        return False
    from gem_lp.mx.kernels.cute_cast_launch import unsupported

    return unsupported(x) is None


def casts(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, *, scaling: str, rowwise: bool = True,
          colwise: bool = True, row_operand: bool = False, col_operand: bool = False,
          operand_dtype: torch.dtype = torch.bfloat16, operand_rows: int | None = None, column_sums: bool = False,
          activation: str | None = None, activation_input: torch.Tensor | None = None,
          row_operand_out: torch.Tensor | None = None) -> NormMXOutputs:
    """`rms_norm_mx`'s outputs (blocked scales) from the cast kernel `_cute_cast` chooses (the casts of an
    activation's gradient, `activation_input` given, and those into the caller's row operand buffer are the Triton
    kernel's only)."""
    kw = dict(scaling=scaling, rowwise=rowwise, colwise=colwise, row_operand=row_operand, col_operand=col_operand,
              operand_dtype=operand_dtype, operand_rows=operand_rows, column_sums=column_sums, activation=activation)
    if not x.is_cuda:
        if dispatch.emulated_arch():  # an emulated plan: the kernels' CPU model
            return casts_reference(x, weight, eps, activation_input=activation_input, **kw)
        if not interpreter_enabled():
            raise ValueError("the MX linears' casts on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before importing gem_lp (or use backend='reference')")
    if activation_input is not None or row_operand_out is not None or \
            not (operand_dtype == torch.bfloat16 and _cute_cast(x, weight)):
        return rms_norm_mx(x, weight, eps, activation_input=activation_input, row_operand_out=row_operand_out, **kw)
    from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast

    out = norm_mx_cast(x, weight, eps, scaling=scaling, blocked_scales=True, rowwise=rowwise, colwise=colwise,
                       row_operand=row_operand, col_operand=col_operand, operand_rows=operand_rows,
                       column_sums=column_sums, activation=activation)
    orig = x.dtype if weight is None else torch.float32  # as rms_norm_mx's: the normalized y is FP32
    return NormMXOutputs(
        rowwise=None if out.row_data is None else MXTensor(out.row_data, out.row_scale, "1d", 1, scaling, orig,
                                                           "blocked"),
        colwise=None if out.col_data is None else MXTensor(out.col_data, out.col_scale, "1d", 1, scaling, orig,
                                                           "blocked"),
        rstd=out.rstd, row_operand=out.row_operand, col_operand=out.col_operand, column_sums=out.column_sums)


@dataclasses.dataclass
class WeightOperands:
    """W `[N, K]`'s two quantizations: `row` along K (forward), `col` along N (dX); None until made.

    On `cublas` both are `[N, K]` tensors of exact MX values; on the MX routes `row` is the MX tensor `[N, K]` and
    `col` the MX tensor of `W^T`, `[K, N]`, both with blocked scales.
    """

    version: int
    data_ptr: int
    row: object
    col: object


_WEIGHT_CACHE = PerTensorCache()  # weight -> {(scaling, MX route, operand dtype): WeightOperands}


def clear_weight_cache() -> None:
    """Forget every cached weight quantization and bias cast (needed only after writes through `.data`)."""
    from gem_lp.linear.gemm import clear_bias_cache

    _WEIGHT_CACHE.clear()
    clear_bias_cache()


def weight_operands(weight: torch.Tensor, scaling: str, route: str, operand_dtype: torch.dtype,
                    need_col: bool) -> WeightOperands:
    """W's cached quantizations, remade when the weight changed (`_version` or storage) since they were made."""
    key = (scaling, route in MX_ROUTES, operand_dtype)
    in_capture = capturing(weight)
    per_weight = None if in_capture else _WEIGHT_CACHE.get(weight)
    entry = None if per_weight is None else per_weight.get(key)
    if (entry is not None and entry.version == weight._version and entry.data_ptr == weight.data_ptr()
            and (entry.col is not None or not need_col)):
        return entry
    w = weight.detach()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if route in MX_ROUTES:
        out = casts(w, None, scaling=scaling, rowwise=True, colwise=need_col)
        row, col = out.rowwise, out.colwise
    else:
        out = casts(w, None, scaling=scaling, rowwise=False, colwise=False, row_operand=True, col_operand=need_col,
                    operand_dtype=operand_dtype)
        row, col = out.row_operand, out.col_operand
    entry = WeightOperands(weight._version, weight.data_ptr(), row, col)
    if not in_capture:
        if per_weight is None:
            per_weight = {}
            _WEIGHT_CACHE.put(weight, per_weight)
        per_weight[key] = entry
    return entry


def dy_operands(dy: torch.Tensor, scaling: str, route: str, column_sums: bool = False, rows: int | None = None,
                row: bool = True, col: bool = True, dy_activation: tuple[str, torch.Tensor] | None = None,
                row_out: torch.Tensor | None = None):
    """dY `[M, N]` quantized along N (for dX, `row`) and along M (for dW, `col`), from one pass over dY.

    `dy_activation`: None, or `(activation, z)`: `dy` is then the gradient of `activation(z)` and dY is z's gradient
    (torch's `silu_backward(dy, z)`), made on the fly in the same pass. `row_out`: where the exact-value row
    operand goes when it is made and has its shape and dtype (it may be the buffer dy is the first rows of: see
    `rms_norm_mx`'s `row_operand_out`); else a new tensor.

    Returns `(row, col_t, sums)`: MX `[M, N]` and MX of dY^T `[N, M]`, or exact-value tensors `[rows, N]` and the
    `[N, rows]` transposed view of the colwise values (rows past M zeros; `rows` default M), None where not asked
    for; `sums`: dY's column sums, float32 `[N]`, when asked, else None.
    """
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    act, z = (None, None) if dy_activation is None else dy_activation
    if route in MX_ROUTES:
        out = casts(dy, None, scaling=scaling, rowwise=row, colwise=col, column_sums=column_sums, activation=act,
                    activation_input=z)
        return out.rowwise, out.colwise, out.column_sums
    opd = operand_dtype_for(dy.dtype)
    if row_out is not None and not (row and row_out.dtype == opd and row_out.is_contiguous()
                                    and row_out.shape == (dy.shape[0] if rows is None else rows, dy.shape[1])):
        row_out = None
    out = casts(dy, None, scaling=scaling, rowwise=False, colwise=False, row_operand=row, col_operand=col,
                operand_dtype=opd, column_sums=column_sums, operand_rows=rows, activation=act, activation_input=z,
                row_operand_out=row_out)
    return out.row_operand, None if out.col_operand is None else out.col_operand.t(), out.column_sums


def saved_col_operand(data: torch.Tensor, scale: torch.Tensor, scaling: str, route: str, dtype: torch.dtype,
                      rows: int | None = None):
    """The saved colwise MX tensor of X (`X^T [K, M]` along M, blocked scales; the payload a view with rows
    padded to a multiple of 16 bytes, see `triton_cast.colwise_payload_buffer`) as the dW GEMM's B operand.

    Dequantized, it is the `[K, M]` view of a contiguous `[M, K]` tensor: the GEMM reads both operands along
    their non-contracted dim, as for BF16 `nn.Linear` (contiguous along M, cuBLAS runs an M that is not a multiple of 8
    on an unvectorized kernel). `rows`: the padded M of the GEMM (`gemm_rows`), zeros past M.
    """
    if route in MX_ROUTES:
        return MXTensor(data, scale, "1d", 1, scaling, dtype, "blocked")
    if not data.is_cuda and dispatch.emulated_arch():  # the dequantize pass's CPU model
        values = dequantize(MXTensor(data, scale, "1d", 1, scaling, dtype, "blocked"))
        out = torch.zeros(data.shape[1] if rows is None else rows, data.shape[0], dtype=operand_dtype_for(dtype))
        out[: data.shape[1]] = values.t()
        return out.t()
    return dequantize_operand(data, scale, True, operand_dtype_for(dtype), transposed=True, padded_cols=rows)


def col_operand_of(x: torch.Tensor, activation: str | None, scaling: str, route: str, rows: int | None):
    """The dW GEMM's B operand made from `x [M, K]` itself (its input activation computed again): the values
    `saved_col_operand` gives from the colwise cast of `activation(x)` the forward would have saved."""
    if route in MX_ROUTES:
        return casts(x, None, scaling=scaling, rowwise=False, colwise=True, activation=activation).colwise
    out = casts(x, None, scaling=scaling, rowwise=False, colwise=False, col_operand=True,
                operand_dtype=operand_dtype_for(x.dtype), operand_rows=rows, activation=activation)
    return out.col_operand.t()
