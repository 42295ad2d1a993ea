"""Public MX quantization entry points: each validates its arguments and dispatches to a backend."""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from .formats import BLOCKS, MXTensor, check_input, check_scaling
from .reference import dequantize as _dequantize_reference
from .reference import quantize_reference


def quantize(
    x: torch.Tensor,
    *,
    axis: int = -1,
    scaling: str = "rceil",
    block: str = "1d",
    backend: str = "auto",
) -> MXTensor:
    """Quantize `x` to MXFP8 (E4M3 payload, E8M0 scale per 32 elements).

    Args:
        x: float32/bfloat16/float16 tensor; the blocked dimension(s) must be multiples of 32.
        axis: dimension of the 1x32 blocks (`block="1d"`).
        scaling: `"rceil"` (default, never overflows the payload) or `"floor"` (OCP).
        block: `"1d"` or `"square"` (32x32 over the last two dims; transpose-invariant payload).
        backend: `"auto"`, `"reference"` or `"triton"`.

    Returns:
        `MXTensor` with payload `[*x.shape]` and plain-layout scales.
    """
    check_input(x)
    check_scaling(scaling)
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    backend = resolve_backend(backend, x)
    if backend == "reference":
        return quantize_reference(x, axis=axis, scaling=scaling, block=block)
    from . import triton_quantize

    return triton_quantize.quantize(x, axis=axis, scaling=scaling, block=block)


def dequantize(mx: MXTensor) -> torch.Tensor:
    """FP32 tensor of `mx`'s logical shape (exact; blocks with a NaN scale give NaN)."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx must be an MXTensor, got {type(mx).__name__}")
    return _dequantize_reference(mx)
