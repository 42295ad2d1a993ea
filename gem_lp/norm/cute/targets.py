"""The RMSNorm + MX cast builds the public ops launch on the cute backend (`rms_norm_quantize`: plain scales;
`quantize_dual` and the GEMM operand casts: blocked scales), the RMSNorm backward builds of the MX linears, and the
BF16 recipe's RMSNorm forward and backward, as `gem_lp.compile_check` builds them."""
from __future__ import annotations

from functools import partial

import torch

from ...compile_check import CompileTarget

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
    from .launch import norm_mx_cast

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
    return out


def _build_backward(K: int, dy_dtype: torch.dtype, arch: str, w_dtype: torch.dtype = torch.float32) -> None:
    from .backward import rms_norm_backward_cute

    x = torch.empty(_TOKENS, K, dtype=torch.bfloat16, device="cuda")
    rms_norm_backward_cute(x, torch.empty(K, dtype=w_dtype, device="cuda"), torch.empty(_TOKENS, device="cuda"),
                           torch.empty(_TOKENS, K, dtype=dy_dtype, device="cuda"), arch=arch)


def _build_plain_forward(K: int, arch: str) -> None:
    from .forward import rms_norm_forward_cute

    x = torch.empty(_TOKENS, K, dtype=torch.bfloat16, device="cuda")
    rms_norm_forward_cute(x, torch.empty(K, dtype=torch.bfloat16, device="cuda"), 1e-6, arch=arch)


# the MX linears' norm backward: BF16 x, FP32 norm weight and dY in x's dtype (the GEMM's dYn); FP32 dY once
BACKWARD_BUILDS = tuple((K, torch.bfloat16) for K in KS) + ((1024, torch.float32),)


def compile_targets(arch: str) -> list[CompileTarget]:
    fwd = [CompileTarget("norm", "fwd", "mxfp8", mode,
                         partial(_build, K, dtype, normalize, blocked, scaling, outputs, arch), needs_mma=False)
           for mode, K, dtype, normalize, blocked, scaling, outputs in builds()]
    bwd = [CompileTarget("norm", "bwd", "mxfp8", f"rmsnorm K{K} bf16 x, {str(dy).removeprefix('torch.')} dy",
                         partial(_build_backward, K, dy, arch), needs_mma=False)
           for K, dy in BACKWARD_BUILDS]
    # the BF16 recipe's norm (`RMSNormCute`): its forward, and the backward above with BF16 weight
    plain = [CompileTarget("norm", "fwd", "bf16", f"rmsnorm K{K} bf16", partial(_build_plain_forward, K, arch),
                           needs_mma=False) for K in KS]
    plain_bwd = [CompileTarget("norm", "bwd", "bf16", f"rmsnorm K{K} bf16 x, bf16 weight, bf16 dy",
                               partial(_build_backward, K, torch.bfloat16, arch, torch.bfloat16), needs_mma=False)
                 for K in KS]
    return fwd + bwd + plain + plain_bwd
