"""The CuTe RMSNorm builds (no MX cast), as `gem_lp.compile_check` builds them: the MX linears' norm backward and the
BF16 recipe's RMSNorm forward and backward."""
from __future__ import annotations

from functools import partial

import torch

from gem_lp.compile_check import CompileTarget
from gem_lp.mx.kernels.cute_targets import KS

_TOKENS = 1000  # M is dynamic in the builds


def _build_backward(K: int, dy_dtype: torch.dtype, arch: str, w_dtype: torch.dtype = torch.float32) -> None:
    from gem_lp.norm.kernels.cute_backward import rms_norm_backward_cute

    x = torch.empty(_TOKENS, K, dtype=torch.bfloat16, device="cuda")
    rms_norm_backward_cute(x, torch.empty(K, dtype=w_dtype, device="cuda"), torch.empty(_TOKENS, device="cuda"),
                           torch.empty(_TOKENS, K, dtype=dy_dtype, device="cuda"), arch=arch)


def _build_plain_forward(K: int, arch: str) -> None:
    from gem_lp.norm.kernels.cute_forward import rms_norm_forward_cute

    x = torch.empty(_TOKENS, K, dtype=torch.bfloat16, device="cuda")
    rms_norm_forward_cute(x, torch.empty(K, dtype=torch.bfloat16, device="cuda"), 1e-6, arch=arch)


# the MX linears' norm backward: BF16 x, FP32 norm weight and dY in x's dtype (the GEMM's dYn); FP32 dY once
BACKWARD_BUILDS = tuple((K, torch.bfloat16) for K in KS) + ((1024, torch.float32),)


def compile_targets(arch: str) -> list[CompileTarget]:
    bwd = [CompileTarget("norm", "bwd", "mxfp8", f"rmsnorm K{K} bf16 x, {str(dy).removeprefix('torch.')} dy",
                         partial(_build_backward, K, dy, arch), needs_mma=False)
           for K, dy in BACKWARD_BUILDS]
    # the BF16 recipe's norm: its forward, and the backward above with BF16 weight
    plain = [CompileTarget("norm", "fwd", "bf16", f"rmsnorm K{K} bf16", partial(_build_plain_forward, K, arch),
                           needs_mma=False) for K in KS]
    plain_bwd = [CompileTarget("norm", "bwd", "bf16", f"rmsnorm K{K} bf16 x, bf16 weight, bf16 dy",
                               partial(_build_backward, K, torch.bfloat16, arch, torch.bfloat16), needs_mma=False)
                 for K in KS]
    return bwd + plain + plain_bwd
