"""What the MX cast kernels (`gem_lp.mx.kernels.triton_cast`, `cute_cast`) write, and their CPU model.

A cast takes `x [M, K]` through an optional prologue (RMSNorm by a weight; an input activation; or, given the
activation's input, the activation's backward) to an FP32 `y`, and writes any of: y's rowwise and colwise MX casts,
their dequantized values as GEMM operands, rstd, and y's column sums. `casts_reference` computes the same outputs in
plain PyTorch: it is what the emulated plans run in place of the kernels on CPU tensors (`gem_lp.runtime.dispatch.
emulate`); the kernels' own tests hold them to the reference byte for byte.
"""
from __future__ import annotations

import dataclasses

import torch

from gem_lp.mx.formats import MXTensor
from gem_lp.mx.layout import to_blocked
from gem_lp.mx.reference import INPUT_ACTIVATIONS, dequantize, quantize_reference, rms_norm_fp32


@dataclasses.dataclass
class NormMXOutputs:
    """Outputs of a cast (each None unless requested).

    Attributes:
        rowwise: `y [M, K]` in MXFP8, 1x32 blocks along K (scales `[M, K/32]`, plain or blocked).
        colwise: `y^T [K, M]` in MXFP8, 1x32 blocks along M (scales `[K, ceil(M/32)]`, plain or blocked). From the
            kernels the payload is a view with a contiguous last dim and rows `colwise_row_stride(M)` bytes apart (M
            rounded up to 32): not contiguous unless M is a multiple of 32; the padding columns hold no data.
        rstd: `[M]` float32 (None without the norm).
        row_operand: `deq(rowwise)`, `[M, K]` in `operand_dtype`: the forward GEMM operand (`[operand_rows, K]`
            with zero rows past M when `operand_rows` is given; so is `col_operand`).
        col_operand: `deq(colwise)` laid out as `y`, `[M, K]` in `operand_dtype`: the operand of a GEMM
            contracting over M (read transposed).
        column_sums: y's column sums, `[K]` float32 (no norm only); the kernels sum in another order than torch's:
            equal within FP32 rounding, not bit for bit.
    """

    rowwise: MXTensor | None
    colwise: MXTensor | None
    rstd: torch.Tensor | None
    row_operand: torch.Tensor | None
    col_operand: torch.Tensor | None
    column_sums: torch.Tensor | None = None


def _padded(t: torch.Tensor, rows: int | None, dtype: torch.dtype) -> torch.Tensor:
    if rows is None or rows == t.shape[0]:
        return t.to(dtype)
    out = torch.zeros(rows, t.shape[1], dtype=dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def casts_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, *, scaling: str = "rceil",
                    rowwise: bool = True, colwise: bool = True, row_operand: bool = False, col_operand: bool = False,
                    operand_dtype: torch.dtype = torch.bfloat16, operand_rows: int | None = None,
                    column_sums: bool = False, activation: str | None = None,
                    activation_input: torch.Tensor | None = None, blocked_scales: bool = True) -> NormMXOutputs:
    """The cast kernels' outputs (see `triton_cast.rms_norm_mx` for the arguments) in plain PyTorch."""
    rstd = None
    if weight is not None:
        y, rstd = rms_norm_fp32(x, weight, eps)
    elif activation is not None and activation_input is not None:
        y = torch.ops.aten.silu_backward(x, activation_input).float()
    elif activation is not None:
        y = INPUT_ACTIVATIONS[activation](x).float()
    else:
        y = x.float()
    orig = torch.float32 if weight is not None else x.dtype
    layout = "blocked" if blocked_scales else "plain"

    def laid_out(mx: MXTensor) -> MXTensor:
        scale = to_blocked(mx.scale) if blocked_scales else mx.scale
        return MXTensor(mx.data, scale, "1d", 1, scaling, orig, layout)

    row = quantize_reference(y, axis=1, scaling=scaling) if (rowwise or row_operand) else None
    col = quantize_reference(y.t(), axis=1, scaling=scaling, allow_partial=True) if (colwise or col_operand) else None
    return NormMXOutputs(
        rowwise=laid_out(row) if rowwise else None,
        colwise=laid_out(col) if colwise else None,
        rstd=rstd,
        row_operand=_padded(dequantize(row), operand_rows, operand_dtype) if row_operand else None,
        col_operand=_padded(dequantize(col).t(), operand_rows, operand_dtype) if col_operand else None,
        column_sums=y.sum(0) if column_sums else None)
