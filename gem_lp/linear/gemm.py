"""The GEMM routes of the MX linears, `Y = A B^T (+ bias)` with FP32 accumulation:

* `cublas` (Hopper and GPUs without block-scaled MMA): A and B are the MX-exact values of the MX operands in BF16
  (FP32 for FP32 layers), made by the casts; cuBLAS multiplies them. Exact: E4M3 x 2^k is exact in BF16.
* `scaled_mm` (Blackwell): A and B are MX tensors (E4M3 payloads + 128x4 blocked E8M0 scales, the layout cuBLAS
  calls SWIZZLE_32_4_4); cuBLAS's block-scaled GEMM multiplies them (`torch.nn.functional.scaled_mm` with
  `BlockWise1x32`). On a CPU (the emulated Blackwell plan) the same product is computed from the exact values.
"""
from __future__ import annotations

import torch

from gem_lp.linear.cache import PerTensorCache
from gem_lp.mx.formats import MXTensor
from gem_lp.mx.reference import dequantize
from gem_lp.runtime.device import capturing

ROUTES = ("cublas", "scaled_mm")
MX_ROUTES = ("scaled_mm",)  # routes whose operands are MX tensors (the others: exact values)

# The contraction dim of a block-scaled GEMM is a whole number of these (cuBLAS takes K % 16 == 0; MX blocks are 32).
SCALED_MM_K_MULTIPLE = 32

_BIAS_CACHE = PerTensorCache()  # bias -> (version, data_ptr, the bias in Y's dtype)


def clear_bias_cache() -> None:
    _BIAS_CACHE.clear()


def gemm_rows(M: int) -> int:
    """The M the `cublas` route's GEMMs run at: M rounded up to a multiple of 2^(bit_length(M) - 6) (at most 32
    buckets per power of two, under 1/32 more rows; zero rows past M). cuBLAS picks and caches a kernel per shape,
    costing host time at each new shape, and a jagged batch brings a new M every step: buckets make shapes repeat."""
    step = 1 << max(0, M.bit_length() - 6)
    return -(-M // step) * step


def route_rows(M: int, route: str) -> int | None:
    """The padded M of a layer's GEMMs on `route` (`gemm_rows` on `cublas`), None (M itself) on the others."""
    return gemm_rows(M) if route == "cublas" else None


def first_rows(t: torch.Tensor, M: int) -> torch.Tensor:
    """The first M rows of a GEMM result computed at a padded M (a view), or the result itself."""
    return t if t.shape[0] == M else t[:M]


def mm_out_dtype(a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b_t` (cuBLAS on CUDA) with the product accumulated in FP32 and rounded once to `out_dtype`."""
    if a.dtype == out_dtype:
        return torch.mm(a, b_t)
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b_t, out_dtype=torch.float32).to(out_dtype)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm's out_dtype
            pass
    return torch.mm(a.float(), b_t.float()).to(out_dtype)


def bias_as(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`bias` in `dtype` (for cuBLAS's addmm), cast once per version of the bias instead of once per call."""
    if bias.dtype == dtype:
        return bias
    if capturing(bias):
        return bias.detach().to(dtype)
    entry = _BIAS_CACHE.get(bias)
    if entry is not None and entry[0] == bias._version and entry[1] == bias.data_ptr() and entry[2].dtype == dtype:
        return entry[2]
    cast = bias.detach().to(dtype)
    _BIAS_CACHE.put(bias, (bias._version, bias.data_ptr(), cast))
    return cast


def gemm_nt(a, b, route: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """`a b^T (+ bias)`: `a [M, Kc]`, `b [N, Kc]`, exact values (any strides) on `cublas`, MX tensors with blocked
    scales on `scaled_mm`. `out`: a contiguous `[M, N]` tensor to write (`cublas`, `a` in `out_dtype`). The bias is
    added in Y's dtype on `cublas` (as cuBLAS's addmm does), in FP32 on `scaled_mm`."""
    if route == "scaled_mm":
        return block_scaled_mm(a, b, bias, out_dtype)
    if out is not None:
        if a.dtype != out_dtype:
            raise ValueError(f"gemm_nt writes into `out` with operands in {out_dtype} only, got {a.dtype}")
        if bias is None:
            return torch.mm(a, b.t(), out=out)
        return torch.addmm(bias_as(bias, out_dtype), a, b.t(), out=out)
    if bias is not None and a.dtype == out_dtype:
        return torch.addmm(bias_as(bias, out_dtype), a, b.t())
    y = mm_out_dtype(a, b.t(), out_dtype)
    return y if bias is None else (y.float() + bias.float()).to(out_dtype)


def _scales_e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.float8_e8m0fnu)


def _contraction_padded(mx: MXTensor) -> torch.Tensor:
    """The payload `[R, Kc]` as a contiguous `[R, round_up(Kc, 32)]` tensor whose columns past Kc are zero (the
    blocked scales already cover the last partial block: a colwise cast contracted over tokens)."""
    data = mx.data
    R, Kc = data.shape
    padded = -(-Kc // SCALED_MM_K_MULTIPLE) * SCALED_MM_K_MULTIPLE
    if padded == Kc:
        return data if data.is_contiguous() else data.contiguous()
    out = torch.zeros(R, padded, dtype=data.dtype, device=data.device)
    out[:, :Kc] = data
    return out


def block_scaled_mm(a: MXTensor, b: MXTensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`deq(a) deq(b)^T (+ bias)` of MX tensors `a [M, Kc]`, `b [N, Kc]` blocked along Kc with blocked scales (payload
    rows may be strided; a Kc that is not a multiple of 32, as the token count a colwise cast contracts over, is padded
    with zero payload), FP32 accumulation, Y in `out_dtype`. On CUDA, cuBLAS's block-scaled GEMM; on a CPU, the same
    product from the exact values."""
    if not a.data.is_cuda:
        y = dequantize(a) @ dequantize(b).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
    import torch.nn.functional as F

    mat_a, mat_b = _contraction_padded(a), _contraction_padded(b)
    acc_dtype = torch.float32 if bias is not None else out_dtype
    if hasattr(F, "scaled_mm"):
        y = F.scaled_mm(mat_a, mat_b.t(), _scales_e8m0(a.scale), F.ScalingType.BlockWise1x32, _scales_e8m0(b.scale),
                        F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.SWIZZLE_32_4_4,
                        output_dtype=acc_dtype)
    else:  # older torch: E8M0 scales select the MX recipe of `_scaled_mm`
        y = torch._scaled_mm(mat_a, mat_b.t(), _scales_e8m0(a.scale), _scales_e8m0(b.scale), out_dtype=acc_dtype)
    if bias is not None:
        y = (y + bias.float()).to(out_dtype)
    return y
