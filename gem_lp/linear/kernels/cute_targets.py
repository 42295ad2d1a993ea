"""The MX GEMM builds, as `gem_lp.compile_check` builds them: sm_90a at the model's linear shapes, sm_100a quack's
block-scaled MXFP8 GEMM."""
from __future__ import annotations

from functools import partial

import torch

from gem_lp.compile_check import CompileTarget

# (K, N) of the model's linears (1024 -> 3072 / 4096, 4096 -> 1024, 256 -> 768, 512 -> 1536)
SHAPES = ((1024, 3072), (1024, 4096), (4096, 1024), (256, 768), (512, 1536))
_TOKENS = 1000  # M is dynamic in the builds


def _sm90(K: int, N: int, out_dtype: torch.dtype, bias: bool) -> None:
    from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90

    a = torch.empty(_TOKENS, K, dtype=torch.float8_e4m3fn, device="cuda")
    from gem_lp.mx.layout import blocked_size

    s = torch.empty(blocked_size(_TOKENS, K // 32), dtype=torch.uint8, device="cuda")
    b = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")
    mx_gemm_sm90(a, s, b, torch.empty(N, device="cuda") if bias else None, out_dtype, arch="sm_90a")


def _sm90_weight_grad(N: int, out_dtype: torch.dtype) -> None:
    from gem_lp.linear.gemm import gemm_rows
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90
    from gem_lp.mx.formats import BLOCK, ceil_div, colwise_row_stride
    from gem_lp.mx.layout import blocked_size

    K, M = 1024, 273044  # M dynamic: any token count takes this build
    stride, rows = colwise_row_stride(M), gemm_rows(M)
    x = torch.empty(K * stride, dtype=torch.float8_e4m3fn, device="cuda").as_strided((K, M), (stride, 1))
    s = torch.empty(blocked_size(K, ceil_div(M, BLOCK)), dtype=torch.uint8, device="cuda")
    dy = torch.empty(rows, N, dtype=torch.bfloat16, device="cuda")
    mx_weight_grad_sm90(x, s, dy.t(), out_dtype)


def builds() -> list[tuple[str, int, int, torch.dtype, bool]]:
    out = [(f"K{K} N{N} bf16", K, N, torch.bfloat16, False) for K, N in SHAPES]
    out.append(("K1024 N3072 bf16 bias", 1024, 3072, torch.bfloat16, True))
    out.append(("K1024 N3072 fp32", 1024, 3072, torch.float32, False))
    return out


def _sm100(out_dtype: torch.dtype, mx_out: str | None) -> None:
    from gem_lp.linear.kernels.cute_gemm import build_sm100_mxfp8

    build_sm100_mxfp8(out_dtype, mx_out)


def compile_targets(arch: str) -> list[CompileTarget]:
    """sm_90a: `mx_gemm_sm90` at the model shapes (N and K static, M dynamic) and the weight-gradient GEMM
    (`mx_weight_grad_sm90`, N static, K and the tokens dynamic); sm_100a: quack's block-scaled MXFP8
    GEMM (M, N, K dynamic) with BF16 output, and with MXFP8 output along N and along M (GEMM + quantize epilogue),
    built only (no public launch yet)."""
    if arch == "sm_100a":
        return [CompileTarget("linear", "fwd", "mxfp8", f"quack block-scaled mxfp8 {name} (build only)",
                              partial(_sm100, torch.bfloat16, mx_out))
                for name, mx_out in (("bf16 out", None), ("mxfp8 out along N", "row"),
                                     ("mxfp8 out along M", "col"))]
    return [CompileTarget("linear", "fwd", "mxfp8", mode, partial(_sm90, K, N, dt, bias))
            for mode, K, N, dt, bias in builds()] + \
        [CompileTarget("linear", "bwd", "mxfp8", f"weight grad N{N} {name}", partial(_sm90_weight_grad, N, dt))
         for N, dt, name in ((256, torch.float32, "fp32"), (768, torch.float32, "fp32"), (256, torch.bfloat16, "bf16"))]
