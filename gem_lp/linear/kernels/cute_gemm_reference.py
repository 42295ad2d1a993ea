"""The MX GEMM oracle in plain PyTorch: `Y = deq(A).float() @ B.float().T (+ bias)` (docs/numerics.md's dequantize
rule: `fp32(payload) * 2^(byte - 127)`, byte 255 -> NaN)."""
from __future__ import annotations

import torch

from gem_lp.mx.formats import BLOCK
from gem_lp.mx.layout import from_blocked
from gem_lp.mx.reference import scale_f32


def plain_scale(a_scale: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """`[M, K/32]` scale bytes from the flat blocked layout (1-D) or the plain matrix (2-D)."""
    s = a_scale.view(torch.uint8)
    return from_blocked(s, M, K // BLOCK) if s.dim() == 1 else s


def dequantize_a(a_payload: torch.Tensor, a_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`deq(A) [M, K]` in FP32 (exact) or FP64."""
    M, K = a_payload.shape
    factor = scale_f32(plain_scale(a_scale, M, K)).repeat_interleave(BLOCK, dim=1)
    return (a_payload.to(torch.float32) * factor).to(dtype)


def mx_gemm_reference(a_payload: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                      bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`deq(A) @ B^T (+ bias)` computed in `dtype` (float32, or float64 for a tighter oracle)."""
    y = dequantize_a(a_payload, a_scale, dtype) @ b.to(dtype).t()
    return y if bias is None else y + bias.to(dtype)
