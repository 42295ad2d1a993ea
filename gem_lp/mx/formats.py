"""MXFP8 format constants, argument checks and the `MXTensor` container.

OCP MX v1.0 with an E4M3 payload and one E8M0 (power-of-two) scale byte per block of 32 elements.
The exact scale rules live in `reference.py`; this file only holds what every backend shares.
"""
from __future__ import annotations

import dataclasses

import torch

BLOCK = 32
E4M3_MAX = 448.0
# fp32(1/448): written as the exact float32 value so every backend multiplies by the same constant.
INV_E4M3_MAX = 0.0022321429569274187
E8M0_NAN = 255
E4M3_NAN = 0x7F
# Payload byte stored for every element of a block whose scale is NaN (the block holds NaN or Inf).
NONFINITE_PAYLOAD = E4M3_NAN

SCALINGS = ("rceil", "floor")
BLOCKS = ("1d", "square")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAYLOAD_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8


def check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")


def check_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class MXTensor:
    """An MXFP8 tensor: E4M3 payload plus one E8M0 scale byte per block.

    Attributes:
        data: `torch.float8_e4m3fn`, the logical shape of the quantized tensor. It may be a view with padded
            rows (a contiguous last dim, rows further apart than its length), as the colwise payloads of the
            Triton norm kernel are: read it by its strides (`nbytes` counts the logical bytes only).
        scale: `torch.uint8` E8M0 bytes. With `scale_layout == "plain"` its shape is `data.shape`
            with the blocked dimension(s) divided by 32 (rounded up where a partial last block was
            allowed). With `"blocked"`, `data` is 2-D `[rows, cols]` quantized along dim 1 and
            `scale` is the flat 128x4-tiled layout of the `[rows, ceil(cols/32)]` scale matrix
            (see `layout.to_blocked`).
        block: `"1d"` (32 consecutive elements along `axis`) or `"square"` (32x32 over the last
            two dims; the payload of X^T is the transposed payload of X).
        axis: the dimension blocked by `"1d"` (non-negative); `None` for `"square"`.
        scaling: `"rceil"` or `"floor"`, the rule that produced the scales.
        orig_dtype: dtype of the tensor that was quantized.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: str = "1d"
    axis: int | None = -1
    scaling: str = "rceil"
    orig_dtype: torch.dtype = torch.float32
    scale_layout: str = "plain"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def plain_scale(self) -> torch.Tensor:
        """Scale bytes in the plain layout, whatever the stored layout is."""
        if self.scale_layout == "plain":
            return self.scale
        from gem_lp.mx.layout import from_blocked

        rows, cols = self.data.shape
        return from_blocked(self.scale, rows, ceil_div(cols, BLOCK))

    def dequantize(self) -> torch.Tensor:
        from gem_lp.mx.reference import dequantize

        return dequantize(self)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel()


# The casts' colwise payload `y^T [K, M]` is the `[:, :M]` view of a `[K, colwise_row_stride(M)]` buffer whatever M
# is. The kernels need rows a multiple of COLWISE_ROW_ALIGN bytes apart (vector stores; a GEMM's TMA strides); the
# buffers round M up to COLWISE_ROW_PAD, one L2 sector, so that the 32 bytes a 32-row block writes into a column fill
# one sector: with rows 16 (mod 32) bytes apart every other column's bytes straddle two sectors, each half-written by
# two CTAs. The padding columns M .. stride - 1 hold no data.
COLWISE_ROW_ALIGN = 16
COLWISE_ROW_PAD = 32


def colwise_row_stride(M: int) -> int:
    """Row stride (elements = bytes) of a colwise payload buffer for M tokens: M rounded up to COLWISE_ROW_PAD."""
    return max(1, ceil_div(M, COLWISE_ROW_PAD)) * COLWISE_ROW_PAD
