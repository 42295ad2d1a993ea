"""The builds of the CuTe MX cast kernel (with and without its RMSNorm prologue) that the ops launch: `rms_norm_quantize`
(plain scales), `quantize_dual` and the MX linears' operand casts (blocked scales), as `gem_lp.compile_check` builds
them."""
from __future__ import annotations

from functools import partial

import torch

from gem_lp.compile_check import CompileTarget

# The K of the model and of the benchmark shapes; BF16 x is the model's, FP32 / FP16 x once each.
KS = (256, 512, 1024, 4096)
_TOKENS = 1000  # M is dynamic in the builds


# The outputs of the casts a BF16 GEMM consumes (`norm_mx_cast`'s): the forward of an RMSNorm + linear layer (its
# GEMM operand, and the colwise cast kept for dW) and the dual cast of dY into both operands with its column sums.
FORWARD_OPERAND = dict(rowwise=False, colwise=True, row_operand=True)
BOTH_OPERANDS = dict(rowwise=False, colwise=False, row_operand=True, col_operand=True, column_sums=True)
# an MLP down-projection's input SiLU(h) made on the fly: its forward operand and (in the backward) its dW operand
SILU_OPERANDS = (dict(rowwise=False, colwise=False, row_operand=True, activation="silu"),
                 dict(rowwise=False, colwise=False, col_operand=True, activation="silu"))


def _build(K: int, dtype: torch.dtype, normalize: bool, blocked: bool, scaling: str, outputs: dict, arch: str) -> None:
    from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast

    x = torch.empty(_TOKENS, K, dtype=dtype, device="cuda")
    w = torch.empty(K, dtype=torch.float32, device="cuda") if normalize else None
    norm_mx_cast(x, w, 1e-6, scaling=scaling, blocked_scales=blocked, arch=arch, **outputs)


def builds() -> list[tuple[str, int, torch.dtype, bool, bool, str, dict]]:
    """(mode, K, dtype, normalize, blocked scales, scaling, outputs) of every build."""
    out = []
    for K in KS:
        out.append((f"rmsnorm K{K} bf16 plain", K, torch.bfloat16, True, False, "rceil", {}))
        out.append((f"rmsnorm K{K} bf16 blocked", K, torch.bfloat16, True, True, "rceil", {}))
        out.append((f"dual-cast K{K} bf16 blocked", K, torch.bfloat16, False, True, "rceil", {}))
        out.append((f"rmsnorm K{K} bf16 blocked colwise + row operand", K, torch.bfloat16, True, True, "rceil",
                    FORWARD_OPERAND))
        out.append((f"dual-cast K{K} bf16 operands", K, torch.bfloat16, False, True, "rceil", BOTH_OPERANDS))
    for K in (1024, 4096):
        for name, outputs in zip(("row", "col"), SILU_OPERANDS):
            out.append((f"silu-cast K{K} bf16 {name} operand", K, torch.bfloat16, False, True, "rceil", outputs))
    out.append(("rmsnorm K1024 fp32 plain", 1024, torch.float32, True, False, "rceil", {}))
    out.append(("rmsnorm K1024 fp16 plain floor", 1024, torch.float16, True, False, "floor", {}))
    out.append(("dual-cast K1024 fp32 blocked", 1024, torch.float32, False, True, "rceil", {}))
    out.append(("rmsnorm K96 bf16 blocked", 96, torch.bfloat16, True, True, "rceil", {}))  # K not a tile multiple
    out.append(("rmsnorm K96 bf16 plain", 96, torch.bfloat16, True, False, "rceil", {}))  # row scales as bytes
    return out


def compile_targets(arch: str) -> list[CompileTarget]:
    return [CompileTarget("cast", "fwd", "mxfp8", mode,
                          partial(_build, K, dtype, normalize, blocked, scaling, outputs, arch), needs_mma=False)
            for mode, K, dtype, normalize, blocked, scaling, outputs in builds()]
