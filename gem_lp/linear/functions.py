"""Exact MXFP8 GEMM `Y = A B^T` in Triton (three operand routes, a quantizing epilogue) and its dequantize pass.

`A [M, Kc]` and `B [N, Kc]` are MX tensors blocked along Kc (their last, contiguous dim; a last partial
block is allowed, as for the colwise casts contracted over tokens). The exact product is
`Y = deq(A) deq(B)^T` with FP32 accumulation; the routes differ only in the order of the FP32 sums:

* `"fp8"`: FP8 `tl.dot` per 32-wide k chunk (one E4M3 MMA), each chunk result promoted into the FP32
  accumulator by the product of its two E8M0 scales: `acc += (dot * sa) * sb`. Hopper's FP8 MMA sums the
  32 products of a chunk with a limited alignment (about 14 bits below the largest product, as the
  DeepSeek-V3 report measured on H800), so on sm_90 each chunk may differ from the exact sum by ~2^-13 of its magnitude:
  exact when the chunk's sum fits those bits (e.g. small-integer payloads), not in general. Scaling after
  the dot also keeps finite a product whose dequantized operand alone would overflow FP32 (never written
  by a cast).
* `"dot_scaled"`: `tl.dot_scaled` per BLOCK_K (native block-scaled MMA on sm_100; on sm_90 Triton
  decomposes it into a BF16 upcast and a BF16 dot). A NaN scale byte (255) is applied by the kernel itself
  (sm_90 builds of Triton 3.6 do not decode it as NaN); Triton 3.6 on sm_90 decodes byte 0 as 0 instead
  of 2^-127, which only changes products of magnitude below ~2^-118 * |other operand|.
* `"dequant_triton"` / `"dequant_cublas"`: a memory-bound pass writes `deq(A)`, `deq(B)` as BF16 (exact:
  E4M3 times a power of two fits BF16 down to 2^-133), then a BF16 GEMM: ours (with the epilogue below)
  or cuBLAS (`torch.mm`; an MX output then costs a separate cast of Y).

Epilogue (every Triton route): `+ bias` in FP32, then any of: Y in bf16/fp16/fp32; Y's rowwise MX cast
(1x32 along N, payload `[M, N]`); Y's colwise MX cast (32x1 along M, payload of `Y^T`, `[N, M]`, partial last
block allowed). The MX bytes come from the FP32 accumulator by `gem_lp.mx.kernels.triton_numerics`, so they equal
`quantize_reference` of the FP32 Y that the same launch writes.

The last section of this file is the MXLinear Triton path (`mx_linear_triton`, `rms_norm_mx_linear_triton`
and their autograd Functions), built on these GEMMs and on `triton_norm`'s producer passes.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
import triton
import triton.language as tl
from torch.optim.optimizer import register_optimizer_step_post_hook

from gem_lp.runtime.device import interpreter_enabled
from gem_lp.runtime.triton_launch import KernelLaunch
from gem_lp.mx.formats import BLOCK, INPUT_DTYPES, PAYLOAD_DTYPE, SCALE_DTYPE, MXTensor, ceil_div, check_scaling
from gem_lp.mx.layout import blocked_size
from gem_lp.mx.kernels.triton_numerics import abs_bits, encode, scale_byte
from gem_lp.linear.reference import INPUT_ACTIVATIONS, check_input_activation
from gem_lp.mx.kernels.triton_cast import (NormMXOutputs, e4m3_value, load_f32, rms_norm_backward, rms_norm_mx, scale_offset,
                          scale_value, store_operand)

GEMM_VARIANTS = ("fp8", "dot_scaled", "dequant_triton", "dequant_cublas")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OPERANDS_FP8, _OPERANDS_SCALED, _OPERANDS_PLAIN = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile of one program (BLOCK_M x BLOCK_N, BLOCK_K per loop step), L2 grouping, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Defaults per operand route on sm_90, the largest tiles that ptxas builds without (or with few) spills
# (FP8: 255 registers, ~180 spill bytes; dot_scaled: ~100-400; plain BF16: 240-251, none, MX epilogue
# included); `benchmarks/bench_norm_gemm.py` measures alternatives.
DEFAULT_CONFIGS = {
    _OPERANDS_FP8: GemmConfig(128, 128, 32, 8, 8, 3),
    _OPERANDS_SCALED: GemmConfig(128, 128, 64, 8, 8, 3),
    _OPERANDS_PLAIN: GemmConfig(128, 128, 64, 8, 8, 3),
}
# Under the interpreter the cost is per program and per op: small tiles keep the masks exercised.
INTERPRETER_CONFIG = GemmConfig(32, 32, 64, 2, 1, 1)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _k_step(acc, nan_m, nan_n, a_rows, b_cols, a_scale_ptr, b_scale_ptr, m_ld, n_ld, k0, Kc, n_kb, stride_ak, stride_bk,
            OPERANDS: tl.constexpr, A_BLOCKED: tl.constexpr, B_BLOCKED: tl.constexpr, EVEN_K: tl.constexpr,
            BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One BLOCK_K step of the contraction: A rows `a_rows [BM, 1]`, B rows as columns `b_cols [1, BN]`."""
    if OPERANDS == 0:  # FP8 dot per 32-chunk, promoted by the scale product
        for j in tl.static_range(BLOCK_K // 32):
            kk = k0 + j * 32 + tl.arange(0, 32)
            if EVEN_K:
                a = tl.load(a_rows + kk[None, :])
                b = tl.load(b_cols + kk[:, None])
            else:
                a = tl.load(a_rows + kk[None, :], mask=kk[None, :] < Kc, other=0.0)
                b = tl.load(b_cols + kk[:, None], mask=kk[:, None] < Kc, other=0.0)
            kb = k0 // 32 + j
            sa = scale_value(tl.load(a_scale_ptr + scale_offset(m_ld, kb, n_kb, A_BLOCKED),
                                     mask=kb < n_kb, other=127).to(tl.int32))
            sb = scale_value(tl.load(b_scale_ptr + scale_offset(n_ld, kb, n_kb, B_BLOCKED),
                                     mask=kb < n_kb, other=127).to(tl.int32))
            d = tl.dot(a, b, out_dtype=tl.float32)
            acc += (d * sa[:, None]) * sb[None, :]
    elif OPERANDS == 1:  # block-scaled dot
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :])
            b = tl.load(b_cols + kk[:, None])
        else:
            a = tl.load(a_rows + kk[None, :], mask=kk[None, :] < Kc, other=0.0)
            b = tl.load(b_cols + kk[:, None], mask=kk[:, None] < Kc, other=0.0)
        kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
        sa = tl.load(a_scale_ptr + scale_offset(m_ld[:, None], kb, n_kb, A_BLOCKED), mask=kb < n_kb, other=127)
        sb = tl.load(b_scale_ptr + scale_offset(n_ld[:, None], kb, n_kb, B_BLOCKED), mask=kb < n_kb, other=127)
        acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
        nan_m = tl.maximum(nan_m, tl.max((sa == 255).to(tl.int32), axis=1))
        nan_n = tl.maximum(nan_n, tl.max((sb == 255).to(tl.int32), axis=1))
    else:  # exact BF16 (or FP32) operands
        kk = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = a_rows + kk[None, :] * stride_ak
        b_ptrs = b_cols + kk[:, None] * stride_bk
        if INTERPRET:  # the interpreter's bf16 arithmetic is not exact: widen by bits, dot in FP32
            a = load_f32(a_ptrs, kk[None, :] < Kc)
            b = load_f32(b_ptrs, kk[:, None] < Kc)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=kk[None, :] < Kc, other=0.0)
                b = tl.load(b_ptrs, mask=kk[:, None] < Kc, other=0.0)
            acc = tl.dot(a, b, acc)
    return acc, nan_m, nan_n


@triton.jit
def _epilogue(acc, nan_m, nan_n, pid_m, pid_n, M, N, bias_ptr, y_ptr, yr_data_ptr, yr_scale_ptr,
              yc_data_ptr, yc_scale_ptr,
              OPERANDS: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_PLAIN: tl.constexpr, OUT_ROW_MX: tl.constexpr,
              OUT_COL_MX: tl.constexpr, BLOCKED_OUT: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    if HAS_BIAS:
        acc = acc + load_f32(bias_ptr + n, n_ok)[None, :]
    if OPERANDS == 1:
        acc = tl.where((nan_m[:, None] + nan_n[None, :]) > 0, float("nan"), acc)
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.where(ok, acc, 0.0)  # rows past M are 0 for the colwise block maxima
    m64 = m.to(tl.int64)
    if OUT_PLAIN:
        store_operand(y_ptr + m64[:, None] * N + n[None, :], acc, ok, HW_CAST)
    if OUT_ROW_MX:  # 1x32 blocks along N (N is a multiple of 32)
        NB: tl.constexpr = BLOCK_N // 32
        v = tl.reshape(acc, (BLOCK_M, NB, 32))
        byte = scale_byte(tl.max(abs_bits(v), axis=2), RCEIL)  # [BM, NB]
        q = encode(v, byte[:, :, None], HW_CAST)
        nn = pid_n * BLOCK_N + tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        mm = m64[:, None, None]
        tl.store(yr_data_ptr + mm * N + nn, q, mask=(mm < M) & (nn < N))
        c = pid_n * NB + tl.arange(0, NB)[None, :]
        tl.store(yr_scale_ptr + scale_offset(m[:, None], c, N // 32, BLOCKED_OUT), byte.to(tl.uint8),
                 mask=m_ok[:, None] & (c < N // 32))
    if OUT_COL_MX:  # 32x1 blocks along M, stored as Y^T [N, M]
        MB: tl.constexpr = BLOCK_M // 32
        v = tl.reshape(acc, (MB, 32, BLOCK_N))
        byte = scale_byte(tl.max(abs_bits(v), axis=1), RCEIL)  # [MB, BN]
        q = encode(v, byte[:, None, :], HW_CAST)
        mm = pid_m * BLOCK_M + tl.arange(0, MB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        nn = n.to(tl.int64)[None, None, :]
        tl.store(yc_data_ptr + nn * M + mm, q, mask=(mm < M) & (nn < N))
        n_cols = (M + 31) // 32
        c = pid_m * MB + tl.arange(0, MB)[:, None]
        tl.store(yc_scale_ptr + scale_offset(n[None, :], c, n_cols, BLOCKED_OUT), byte.to(tl.uint8),
                 mask=n_ok[None, :] & (c < n_cols))


@triton.jit
def _mx_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, y_ptr, yr_data_ptr, yr_scale_ptr, yc_data_ptr, yc_scale_ptr,
    M, N, Kc, stride_am, stride_ak, stride_bn, stride_bk,
    OPERANDS: tl.constexpr, A_BLOCKED: tl.constexpr, B_BLOCKED: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_PLAIN: tl.constexpr, OUT_ROW_MX: tl.constexpr, OUT_COL_MX: tl.constexpr,
    BLOCKED_OUT: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped program order: GROUP_M row tiles share their B tiles in L2
    pid = tl.program_id(0)
    n_pid_m = tl.cdiv(M, BLOCK_M)
    n_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * n_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(n_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    # rows past M / N wrap onto real rows (loads need no mask); the epilogue never stores them
    m_ld = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    n_ld = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_rows = a_ptr + m_ld.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + n_ld.to(tl.int64)[None, :] * stride_bn
    n_kb = (Kc + 31) // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    nan_m = tl.zeros((BLOCK_M,), tl.int32)
    nan_n = tl.zeros((BLOCK_N,), tl.int32)
    if INTERPRET:  # the interpreter cannot take run-time range bounds; a while loop is the same walk
        k0 = 0
        while k0 < Kc:
            acc, nan_m, nan_n = _k_step(acc, nan_m, nan_n, a_rows, b_cols, a_scale_ptr, b_scale_ptr, m_ld, n_ld,
                                        k0, Kc, n_kb, stride_ak, stride_bk, OPERANDS, A_BLOCKED, B_BLOCKED, EVEN_K,
                                        BLOCK_K, INTERPRET)
            k0 += BLOCK_K
    else:
        for k0 in range(0, Kc, BLOCK_K):
            acc, nan_m, nan_n = _k_step(acc, nan_m, nan_n, a_rows, b_cols, a_scale_ptr, b_scale_ptr, m_ld, n_ld,
                                        k0, Kc, n_kb, stride_ak, stride_bk, OPERANDS, A_BLOCKED, B_BLOCKED, EVEN_K,
                                        BLOCK_K, INTERPRET)
    _epilogue(acc, nan_m, nan_n, pid_m, pid_n, M, N, bias_ptr, y_ptr, yr_data_ptr, yr_scale_ptr,
              yc_data_ptr, yc_scale_ptr, OPERANDS, HAS_BIAS, OUT_PLAIN, OUT_ROW_MX, OUT_COL_MX, BLOCKED_OUT,
              RCEIL, HW_CAST, BLOCK_M, BLOCK_N)


@triton.jit
def _mx_dequantize_kernel(data_ptr, stride_data, scale_ptr, out_ptr, stride_out, R, C, BLOCKED: tl.constexpr,
                          TRANSPOSED: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    # data: [R, C] payload, rows stride_data apart (a padded colwise payload). out: [R, C] with rows stride_out
    # apart, or with TRANSPOSED its transpose [C, R] (element (r, c) at c * stride_out + r).
    NCB: tl.constexpr = BLOCK_C // 32
    n_c_tiles = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    r = (pid // n_c_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None, None]
    cb = (pid % n_c_tiles) * NCB + tl.arange(0, NCB)[None, :, None]
    c = cb * 32 + tl.arange(0, 32)[None, None, :]
    ok = (r < R) & (c < C)
    if TRANSPOSED:
        # the payload is a colwise payload buffer (rows of stride_data bytes, a multiple of 16, all allocated):
        # loads over the whole padded row stay vectors whatever C is; only columns < C are stored
        q = tl.load(data_ptr + r.to(tl.int64) * stride_data + c, mask=(r < R) & (c < stride_data), other=0)
        dst = out_ptr + c.to(tl.int64) * stride_out + r
    else:
        q = tl.load(data_ptr + r.to(tl.int64) * stride_data + c, mask=ok, other=0)
        dst = out_ptr + r.to(tl.int64) * stride_out + c
    n_cb = (C + 31) // 32
    byte = tl.load(scale_ptr + scale_offset(r, cb, n_cb, BLOCKED), mask=(r < R) & (cb < n_cb), other=127)
    store_operand(dst, e4m3_value(q, HW_CAST) * scale_value(byte.to(tl.int32)), ok, HW_CAST)


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class GemmOutput:
    """`mx_gemm`'s outputs (None unless requested): `y [M, N]`, Y rowwise `[M, N]` and Y^T colwise `[N, M]`."""

    y: torch.Tensor | None
    rowwise: MXTensor | None
    colwise: MXTensor | None


def _check_runnable(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not interpreter_enabled():
        raise ValueError(f"the Triton MX GEMM needs CUDA tensors ({name} is on {t.device}); on a CPU machine set "
                         f"TRITON_INTERPRET=1 before importing gem_lp")


def check_mx_operand(mx: MXTensor, name: str) -> None:
    """`mx` must be a 2-D MXFP8 tensor blocked along dim 1, scales plain or 128x4 blocked.

    The payload's last dim must be contiguous; its rows may be padded (row stride >= columns), as the colwise
    payloads of `rms_norm_mx` are (a `[K, M]` view of a buffer with rows a multiple of 16 bytes apart).
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"{name} must be an MXTensor, got {type(mx).__name__}")
    d = mx.data
    if (d.dim() != 2 or d.dtype != PAYLOAD_DTYPE or (d.shape[1] > 1 and d.stride(1) != 1)
            or (d.shape[0] > 1 and d.stride(0) < d.shape[1])):
        raise ValueError(f"{name}.data must be a 2-D float8_e4m3fn tensor with a contiguous last dim and a row "
                         f"stride >= its columns, got {d.dtype} of shape {tuple(d.shape)} strides {d.stride()}")
    if mx.block != "1d" or mx.axis not in (1, -1):
        raise ValueError(f"{name} must be blocked 1x32 along its last dim (block='1d', axis=1), got "
                         f"block={mx.block!r}, axis={mx.axis}")
    rows, cols = d.shape
    n_cb = ceil_div(cols, BLOCK)
    s = mx.scale
    if s.dtype != SCALE_DTYPE or not s.is_contiguous() or s.device != d.device:
        raise ValueError(f"{name}.scale must be a contiguous uint8 tensor on {d.device}, got {s.dtype} on {s.device}")
    if mx.scale_layout == "blocked":
        if s.shape != (blocked_size(rows, n_cb),):
            raise ValueError(f"{name}.scale (blocked) must hold {blocked_size(rows, n_cb)} bytes for a "
                             f"[{rows}, {n_cb}] scale matrix, got shape {tuple(s.shape)}")
    elif s.shape != (rows, n_cb):
        raise ValueError(f"{name}.scale must be [{rows}, {n_cb}] (plain layout), got {tuple(s.shape)}")
    _check_runnable(d, name)


def mx_dequantize_operand(mx: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`deq(mx)` as a `[R, C]` tensor of `dtype` (bfloat16 or float32), by a memory-bound Triton pass.

    `mx`: 2-D, blocked along dim 1, scales plain or blocked, a last partial block allowed.
    Exact in float32; in bfloat16 exact except values below 2^-126 that need more than its subnormal bits.
    """
    check_mx_operand(mx, "mx")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return _dequantize(mx.data, mx.scale, mx.scale_layout == "blocked", dtype)


def _dequantize(data: torch.Tensor, scale: torch.Tensor, blocked: bool, dtype: torch.dtype,
                transposed: bool = False, padded_cols: int | None = None) -> torch.Tensor:
    """`mx_dequantize_operand`'s launch for a checked payload `data [R, C]` (last dim contiguous, rows
    possibly padded) and its scales (no checks). Returns a contiguous `[R, C]` tensor of `dtype`, or with
    `transposed` the transposed view of a contiguous `[padded_cols (default C), R]` tensor whose rows C.. are
    zeros; `transposed` needs a colwise payload buffer (`triton_norm.colwise_payload_buffer`: every byte of its
    padded rows allocated)."""
    R, C = data.shape
    cols = C if padded_cols is None else padded_cols
    out = torch.empty((cols, R) if transposed else (R, C), dtype=dtype, device=data.device)
    if transposed and cols > C:
        out[C:].zero_()
    if R == 0 or C == 0:
        return out.t() if transposed else out
    on_gpu = data.is_cuda and not interpreter_enabled()
    stride = data.stride(0)
    stride_out = R if transposed else C
    _dequantize_launch(R, C, stride, transposed, blocked, on_gpu)(
        (data.view(torch.uint8), stride, scale, out, stride_out, R, C), on_gpu)
    return out.t() if transposed else out


@functools.lru_cache(maxsize=256)
def _dequantize_launch(R: int, C: int, stride: int, transposed: bool, blocked: bool, on_gpu: bool) -> KernelLaunch:
    """`_mx_dequantize_kernel`'s launch for these ints (relaunched directly after the first: `KernelLaunch`).
    Transposed, a tile spans 64 rows: each stored run of the output is 128 bytes."""
    br, bc = ((64, 128) if transposed else (32, 256)) if on_gpu else (32, 64)
    return KernelLaunch(_mx_dequantize_kernel, (ceil_div(R, br) * ceil_div(C, bc),), 7,
                        dict(BLOCKED=blocked, TRANSPOSED=transposed, HW_CAST=on_gpu, BLOCK_R=br, BLOCK_C=bc,
                             num_warps=4 if on_gpu else 1))


def _check_config(cfg: GemmConfig, operands: int) -> None:
    for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")
    if cfg.block_m < 32 or cfg.block_n < 32 or cfg.block_k < 32:
        raise ValueError(f"config tiles must be >= 32 (MX blocks), got {cfg}")
    if cfg.num_stages < 1:
        raise ValueError(f"config.num_stages must be >= 1, got {cfg.num_stages}")


def _launch(a, a_scale, b, b_scale, a_blocked, b_blocked, operands, M, N, Kc, *, bias, out_dtype, row_mx, col_mx,
            scaling, blocked_out, config, hw_cast):
    """Allocate the requested outputs and run `_mx_gemm_kernel` once."""
    dev = a.device
    interpret = interpreter_enabled()
    if config is None:  # the defaults are valid
        cfg = INTERPRETER_CONFIG if interpret else DEFAULT_CONFIGS[operands]
    else:
        cfg = config
        _check_config(cfg, operands)
    if hw_cast is None:
        hw_cast = dev.type == "cuda" and not interpret
    y = torch.empty(M, N, dtype=out_dtype, device=dev) if out_dtype is not None else None
    row = col = None
    if row_mx:
        n_cb = N // BLOCK
        shape = (blocked_size(M, n_cb),) if blocked_out else (M, n_cb)
        row = (torch.empty(M, N, dtype=PAYLOAD_DTYPE, device=dev),
               (torch.zeros if blocked_out else torch.empty)(shape, dtype=SCALE_DTYPE, device=dev))
    if col_mx:
        n_mb = ceil_div(M, BLOCK)
        shape = (blocked_size(N, n_mb),) if blocked_out else (N, n_mb)
        col = (torch.empty(N, M, dtype=PAYLOAD_DTYPE, device=dev),
               (torch.zeros if blocked_out else torch.empty)(shape, dtype=SCALE_DTYPE, device=dev))
    if M > 0 and N > 0:  # Kc == 0 runs no k step: Y = bias (or 0)
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
        _mx_gemm_kernel[grid](
            a, a_scale, b, b_scale, bias, y,
            row[0].view(torch.uint8) if row else None, row[1] if row else None,
            col[0].view(torch.uint8) if col else None, col[1] if col else None,
            M, N, Kc, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            OPERANDS=operands, A_BLOCKED=a_blocked, B_BLOCKED=b_blocked, EVEN_K=Kc % cfg.block_k == 0,
            HAS_BIAS=bias is not None, OUT_PLAIN=y is not None, OUT_ROW_MX=row_mx, OUT_COL_MX=col_mx,
            BLOCKED_OUT=blocked_out, RCEIL=scaling == "rceil", HW_CAST=hw_cast, INTERPRET=interpret,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    layout = "blocked" if blocked_out else "plain"
    orig = out_dtype or torch.float32
    return GemmOutput(
        y,
        None if row is None else MXTensor(row[0], row[1], "1d", 1, scaling, orig, layout),
        None if col is None else MXTensor(col[0], col[1], "1d", 1, scaling, orig, layout),
    )


def _check_outputs(out_dtype, rowwise, colwise, N, bias, dev):
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES} or None, got {out_dtype}")
    if out_dtype is None and not (rowwise or colwise):
        raise ValueError("nothing to write: give out_dtype or ask for rowwise / colwise MX outputs")
    if rowwise and N % BLOCK:
        raise ValueError(f"a rowwise MX output needs N to be a multiple of {BLOCK} (blocks along N), got N={N}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (N,) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous [N={N}] tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype not in OUT_DTYPES or bias.device != dev:
            raise ValueError(f"bias must be float32/bfloat16/float16 on {dev}, got {bias.dtype} on {bias.device}")


def gemm_operands(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = torch.bfloat16, rowwise: bool = False, colwise: bool = False,
                  scaling: str = "rceil", blocked_scales: bool = True, config: GemmConfig | None = None,
                  hw_cast: bool | None = None) -> GemmOutput:
    """Triton `Y = a b^T (+ bias)` on plain operands (exact MX values in bf16/fp32), with the MX epilogue.

    Args:
        a: `[M, Kc]`, b: `[N, Kc]`, same dtype (bfloat16, float16 or float32), any strides (a transposed
            view reads a `[Kc, M]` tensor in place).
        bias: `[N]` or None; out_dtype: dtype of Y, or None for MX outputs only.
        rowwise / colwise: write Y's rowwise MX cast (N a multiple of 32) / Y^T's colwise MX cast.
        scaling, blocked_scales: rule and scale layout of the MX outputs.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in OUT_DTYPES:
            raise ValueError(f"{name} must be a 2-D bfloat16/float16/float32 tensor")
        _check_runnable(t, name)
    if a.dtype != b.dtype or a.shape[1] != b.shape[1] or a.device != b.device:
        raise ValueError(f"a [M, Kc] and b [N, Kc] must share dtype, Kc and device, got {a.dtype} "
                         f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    check_scaling(scaling)
    (M, Kc), N = a.shape, b.shape[0]
    _check_outputs(out_dtype, rowwise, colwise, N, bias, a.device)
    return _launch(a, None, b, None, False, False, _OPERANDS_PLAIN, M, N, Kc, bias=bias, out_dtype=out_dtype,
                   row_mx=rowwise, col_mx=colwise, scaling=scaling, blocked_out=blocked_scales, config=config,
                   hw_cast=hw_cast)


def _mm_dtype_out(a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b_t` (cuBLAS on CUDA) with the product accumulated in FP32 and rounded once to `out_dtype`."""
    if a.dtype == out_dtype:
        return torch.mm(a, b_t)
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b_t, out_dtype=torch.float32).to(out_dtype)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm's out_dtype
            pass
    return torch.mm(a.float(), b_t.float()).to(out_dtype)


def mx_gemm(a: MXTensor, b: MXTensor, *, variant: str = "fp8", bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = torch.bfloat16, rowwise: bool = False, colwise: bool = False,
            scaling: str = "rceil", blocked_scales: bool = True, config: GemmConfig | None = None,
            hw_cast: bool | None = None) -> GemmOutput:
    """MX GEMM `Y = deq(a) deq(b)^T (+ bias)` with FP32 accumulation.

    Args:
        a: MX `[M, Kc]`, b: MX `[N, Kc]`, both blocked along Kc (see `check_mx_operand`); scales plain or
            blocked; Kc need not be a multiple of 32 (the last block is partial).
        variant: one of `GEMM_VARIANTS` (module docstring: the dequantize routes are exact; on sm_90 `"fp8"`'s FP8
            MMA sums each 32-wide chunk with limited alignment, measured on the H200 off the exact sums by up to
            ~0.2%, and `"dot_scaled"` has Triton's byte-0 corner). `"dot_scaled"` does not run in Triton 3.6's
            interpreter.
        bias: `[N]` (added in FP32), or None.
        out_dtype: dtype of Y (bfloat16, float16, float32), or None for MX outputs only.
        rowwise: also write Y's MX cast 1x32 along N (`[M, N]`, N a multiple of 32).
        colwise: also write Y^T's MX cast 1x32 along M (`[N, M]`, partial last block allowed).
        scaling, blocked_scales: rule and scale layout of the MX outputs.
        config: tile configuration (None: the route's default).

    Returns:
        `GemmOutput(y, rowwise, colwise)`.
    """
    check_mx_operand(a, "a")
    check_mx_operand(b, "b")
    if variant not in GEMM_VARIANTS:
        raise ValueError(f"variant must be one of {GEMM_VARIANTS}, got {variant!r}")
    check_scaling(scaling)
    (M, Kc), (N, Kb) = a.shape, b.shape
    if Kc != Kb or a.device != b.device:
        raise ValueError(f"a [M, Kc] and b [N, Kc] must share Kc and device, got {tuple(a.shape)} on {a.device} "
                         f"and {tuple(b.shape)} on {b.device}")
    _check_outputs(out_dtype, rowwise, colwise, N, bias, a.device)
    if variant == "dot_scaled" and interpreter_enabled():
        raise ValueError("variant='dot_scaled' does not run in Triton's interpreter (tl.dot_scaled); use 'fp8' "
                         "or a dequant variant on CPU")
    common = dict(bias=bias, out_dtype=out_dtype, row_mx=rowwise, col_mx=colwise, scaling=scaling,
                  blocked_out=blocked_scales, config=config, hw_cast=hw_cast)
    if variant in ("fp8", "dot_scaled"):
        operands = _OPERANDS_FP8 if variant == "fp8" else _OPERANDS_SCALED
        return _launch(a.data, a.scale, b.data, b.scale, a.scale_layout == "blocked", b.scale_layout == "blocked",
                       operands, M, N, Kc, **common)
    a_op, b_op = mx_dequantize_operand(a), mx_dequantize_operand(b)
    if variant == "dequant_triton":
        return _launch(a_op, None, b_op, None, False, False, _OPERANDS_PLAIN, M, N, Kc, **common)
    # dequant_cublas: cuBLAS BF16 GEMM (FP32 accumulation); an MX output is a separate cast of FP32 Y
    want_mx = rowwise or colwise
    if want_mx and N % BLOCK:
        raise ValueError(f"variant='dequant_cublas' casts Y [M, N] afterwards, which needs N to be a multiple of "
                         f"{BLOCK}, got N={N}; the Triton variants write a colwise output for any N")
    y = _mm_dtype_out(a_op, b_op.t(), torch.float32 if (want_mx or bias is not None) else out_dtype)
    if bias is not None:
        y = y + bias.to(torch.float32)
    row = col = None
    if want_mx:
        from gem_lp.mx.kernels.triton_quantize import mx_cast_2d

        outs = mx_cast_2d(y, rowwise=rowwise, colwise=colwise, scaling=scaling, blocked_scales=blocked_scales,
                          hw_cast=hw_cast)
        layout = "blocked" if blocked_scales else "plain"
        it = iter(outs)
        orig = out_dtype or torch.float32
        row = MXTensor(next(it), next(it), "1d", 1, scaling, orig, layout) if rowwise else None
        col = MXTensor(next(it), next(it), "1d", 1, scaling, orig, layout) if colwise else None
    return GemmOutput(None if out_dtype is None else y.to(out_dtype), row, col)


# ----------------------------------------------------------------------------- MXLinear Triton path
#
# Same recipe as `reference.MXLinearFunction` / `RMSNormMXLinearFunction`: every GEMM contracts operands
# quantized 1x32 along its own contraction dim and accumulates in FP32. What the GEMMs read depends on `gemm`:
#
# * "cublas" / "triton_bf16": the producer passes write MX-exact BF16 (FP32 for FP32 inputs) operands and
#   a BF16 GEMM consumes them (cuBLAS `torch.mm`, or our Triton GEMM);
# * "fp8" / "dot_scaled": the producers write MX payloads + blocked scales and our MX GEMM consumes them.
#
# Saved for the backward: X's colwise MX tensor (payload `[K, M]` + scales, half of a BF16 X). W's two
# quantizations (along K for Y, along N for dX) are cached per weight until `weight._version` (or its
# storage) changes, i.e. once per optimizer step (fused optimizers, which do not bump it, get it bumped by a step
# hook; nothing is cached or read from the cache while a CUDA graph is captured). dY is quantized once, in both
# layouts, by one dual pass.
#
# Host work per call: at small and mid shapes the GPU waits for the host, so a call does little besides its
# launches. The entry points (`mx_linear_triton`, `rms_norm_mx_linear_triton`, and `ops.mx_linear`) check the
# arguments once; the autograd Functions trust them and call the GEMMs and the dequantize pass by their bare
# launches; the cuBLAS route's bias is cast to Y's dtype once per bias version, not per call; nothing reads
# device memory on the host (no synchronization). A fwd+bwd call makes, besides the cuBLAS GEMMs and dY's column
# sums: "cublas" 3 Triton launches (X's producer, dY's dual cast, the saved X's dequantize), "triton_bf16" 6,
# "fp8" / "dot_scaled" 5, and one more (W's quantization) after each weight update; the RMSNorm variant adds
# its backward kernel.

LINEAR_GEMMS = ("cublas", "triton_bf16", "fp8", "dot_scaled")
_MX_GEMMS = ("fp8", "dot_scaled")


def check_linear_gemm(gemm: str) -> None:
    if gemm not in LINEAR_GEMMS:
        raise ValueError(f"gemm must be one of {LINEAR_GEMMS}, got {gemm!r}")
    if gemm == "dot_scaled" and interpreter_enabled():
        raise ValueError("gemm='dot_scaled' does not run in Triton's interpreter (tl.dot_scaled); use 'fp8' or a "
                         "dequantized route on CPU")


def check_linear_args(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      norm_weight: torch.Tensor | None = None) -> None:
    """The MXLinear Triton path's tensors: `x2 [M, K]`, `weight [N, K]`, `bias [N]` or None, `norm_weight [K]`
    or None, float32/bfloat16/float16 on one device (CUDA, or the CPU under TRITON_INTERPRET=1), K and N
    multiples of 32. Any strides (a last dim that is not contiguous is copied). Straight-line: it runs on
    every call."""
    _check_float(x2, "x2", 2)
    _check_float(weight, "weight", 2)
    (M, K), (N, Kw) = x2.shape, weight.shape
    if K != Kw or K % BLOCK or N % BLOCK:
        raise ValueError(f"x2 [M, K] and weight [N, K] must share K, with K and N multiples of {BLOCK}, got "
                         f"{tuple(x2.shape)} and {tuple(weight.shape)}")
    dev = x2.device
    if weight.device != dev:
        raise ValueError(f"weight must be on x2's device {dev}, got {weight.device}")
    if bias is not None:
        _check_float(bias, "bias", 1)
        if bias.shape[0] != N or bias.device != dev:
            raise ValueError(f"bias must be [N={N}] on {dev}, got {tuple(bias.shape)} on {bias.device}")
    if norm_weight is not None:
        _check_float(norm_weight, "norm_weight", 1)
        if norm_weight.shape[0] != K or norm_weight.device != dev:
            raise ValueError(f"norm_weight must be [K={K}] on {dev}, got {tuple(norm_weight.shape)} on "
                             f"{norm_weight.device}")
    if not x2.is_cuda:
        _check_runnable(x2, "x2")


def _check_float(t: torch.Tensor, name: str, dims: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name} must be a {dims}-D float32/bfloat16/float16 tensor, got "
                         + (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                            else type(t).__name__))


def operand_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the MX-exact GEMM operands for activations of `dtype`: FP32 for FP32, else BF16."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


@dataclasses.dataclass
class WeightOperands:
    """W `[N, K]`'s two quantizations: `row` along K (forward), `col` along N (dX); None until made.

    For the dequantized GEMMs both are `[N, K]` tensors of exact MX values; for the MX GEMMs `row` is the MX
    tensor `[N, K]` and `col` the MX tensor of `W^T`, `[K, N]`, both with blocked scales.
    """

    version: int
    data_ptr: int
    row: object
    col: object


class _PerTensorCache:
    """Values keyed by a live tensor's identity: a dict on `id(t)` holding a weak reference to `t` (checked on
    lookup, so a reused id never matches); the entry leaves with the tensor. A lookup costs a dict access, a
    fraction of `WeakIdKeyDictionary`'s."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t: torch.Tensor):
        entry = self._entries.get(id(t))
        return None if entry is None or entry[0]() is not t else entry[1]

    def put(self, t: torch.Tensor, value) -> None:
        key, entries = id(t), self._entries
        entries[key] = (weakref.ref(t, lambda _, key=key: entries.pop(key, None)), value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


_WEIGHT_CACHE = _PerTensorCache()  # weight -> {(scaling, MX GEMM, operand dtype): WeightOperands}
_BIAS_CACHE = _PerTensorCache()  # bias -> (version, data_ptr, the bias in Y's dtype)


def _bump_versions_after_fused_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The caches above trust `_version` to change when a parameter is written. The fused optimizer kernels (AdamW,
    Adam, SGD, Adagrad with `fused=True`) write parameters in place without bumping it, so every later call would
    reuse the quantization of the weights before the step: after such a step, bump the version of its parameters."""
    if any(group.get("fused") for group in optimizer.param_groups):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params:
            torch.autograd.graph.increment_version(params)


register_optimizer_step_post_hook(_bump_versions_after_fused_step)


def clear_weight_cache() -> None:
    """Forget every cached weight quantization and bias cast (needed only after writes through `.data`)."""
    _WEIGHT_CACHE.clear()
    _BIAS_CACHE.clear()


# Which of the MX linears' casts run on the CuTe norm kernel (`gem_lp.norm.cute`), per arch: those with the RMSNorm
# at K >= the entry. Measured on the H200 (docs/PERF.md, the casts table): the norm's casts ran 1.3-2.6x faster on the
# CuTe kernel at K = 1024 and 4096 and slower at K = 256; the casts without the norm, as fast or slower. The CuTe
# kernel writes the same bytes (GPU tests). Other arches: no measurement, the Triton kernels.
CUTE_NORM_CASTS_FROM_K = {"sm_90a": 1024}
# Tests force one kernel: True, every cast the CuTe kernel can write; False, none; None, the table above.
CUTE_CASTS: bool | None = None


def _casts(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, *, scaling: str, rowwise: bool = True,
           colwise: bool = True, row_operand: bool = False, col_operand: bool = False,
           operand_dtype: torch.dtype = torch.bfloat16, operand_rows: int | None = None, column_sums: bool = False,
           activation: str | None = None, activation_input: torch.Tensor | None = None,
           row_operand_out: torch.Tensor | None = None) -> NormMXOutputs:
    """`rms_norm_mx`'s outputs (blocked scales), from the CuTe kernel where `_cute_cast` chooses it (the casts of
    an activation's gradient, `activation_input` given, and those into the caller's row operand buffer are the Triton
    kernel's only)."""
    kw = dict(scaling=scaling, rowwise=rowwise, colwise=colwise, row_operand=row_operand, col_operand=col_operand,
              operand_dtype=operand_dtype, operand_rows=operand_rows, column_sums=column_sums, activation=activation)
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


def _cute_cast(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """The cast of `x` (normalized by `weight` unless None) runs on the CuTe kernel: `CUTE_CASTS` when set, else
    `CUTE_NORM_CASTS_FROM_K` for the device's arch; and only where the kernel can run. The table's cheap tests come
    first: most casts of a training step have no norm or a narrow one."""
    if CUTE_CASTS is None:
        if weight is None:
            return False
        from_k = CUTE_NORM_CASTS_FROM_K.get(_arch(x))
        if from_k is None or x.shape[-1] < from_k:
            return False
    elif not CUTE_CASTS:
        return False
    return _cute_norm_runs(x)


def _arch(x: torch.Tensor) -> str | None:
    """The arch of x's GPU (`sm_90a`, ...), None off a GPU."""
    if not x.is_cuda:
        return None
    from gem_lp.runtime.device import build_arch

    return build_arch(x.device)


def _cute_norm_runs(x: torch.Tensor) -> bool:
    """The CuTe norm kernels can take `x [M, K]` here (a GPU they are built for, the CuTe stack, K within the cast
    kernel's tables)."""
    from gem_lp.runtime.device import cute_unavailable

    if not x.is_cuda or interpreter_enabled() or cute_unavailable(x.device) is not None:
        return False
    from gem_lp.mx.kernels.cute_cast_launch import unsupported

    return unsupported(x) is None


# Where the norm layers' backward runs on the CuTe kernel (quack's, `gem_lp.norm.kernels.cute_backward`) instead of the Triton
# kernel: our build of it ran 1.2x the Triton kernel at its best launch on the H200 (docs/PERF.md, `bench_norm --only
# backward`: 262143 x 256 and 32767 x 1024, FP32 dY, the GEMM's). sm_100a builds are compile-checked only.
CUTE_NORM_BACKWARD_ARCHES: tuple[str, ...] = ("sm_90a",)
# Tests force one kernel: True, the CuTe kernel wherever it can run; False, the Triton kernel; None, the table.
CUTE_NORM_BACKWARD: bool | None = None


def _norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_backward`'s dx and dweight, from the CuTe kernel where `CUTE_NORM_BACKWARD` (or its table) chooses it
    and it can run."""
    if CUTE_NORM_BACKWARD is None:
        wanted = bool(CUTE_NORM_BACKWARD_ARCHES) and _arch(x) in CUTE_NORM_BACKWARD_ARCHES
    else:
        wanted = CUTE_NORM_BACKWARD
    if not (wanted and _cute_norm_runs(x)):
        return rms_norm_backward(x, weight, rstd, dy)
    from gem_lp.norm.kernels.cute_backward import rms_norm_backward_cute

    return rms_norm_backward_cute(x, weight, rstd, dy)


def _capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured: the cache is neither read nor written. A graph that read a cached entry would
    replay that entry's quantization of the weight forever (and read freed memory once the entry is remade); one made
    now belongs to the graph's memory pool."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def weight_operands(weight: torch.Tensor, scaling: str, gemm: str, operand_dtype: torch.dtype,
                    need_col: bool) -> WeightOperands:
    """W's cached quantizations, remade when the weight changed (`_version` or storage) since they were made."""
    key = (scaling, gemm in _MX_GEMMS, operand_dtype)
    capturing = _capturing(weight)
    per_weight = None if capturing else _WEIGHT_CACHE.get(weight)
    entry = None if per_weight is None else per_weight.get(key)
    if (entry is not None and entry.version == weight._version and entry.data_ptr == weight.data_ptr()
            and (entry.col is not None or not need_col)):
        return entry
    w = weight.detach()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if gemm in _MX_GEMMS:
        out = _casts(w, None, scaling=scaling, rowwise=True, colwise=need_col)
        row, col = out.rowwise, out.colwise
    else:
        out = _casts(w, None, scaling=scaling, rowwise=False, colwise=False, row_operand=True,
                     col_operand=need_col, operand_dtype=operand_dtype)
        row, col = out.row_operand, out.col_operand
    entry = WeightOperands(weight._version, weight.data_ptr(), row, col)
    if not capturing:
        if per_weight is None:
            per_weight = {}
            _WEIGHT_CACHE.put(weight, per_weight)
        per_weight[key] = entry
    return entry


def _bias_as(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`bias` in `dtype` (for cuBLAS's addmm), cast once per version of the bias instead of once per call."""
    if bias.dtype == dtype:
        return bias
    if _capturing(bias):
        return bias.detach().to(dtype)
    entry = _BIAS_CACHE.get(bias)
    if entry is not None and entry[0] == bias._version and entry[1] == bias.data_ptr() and entry[2].dtype == dtype:
        return entry[2]
    cast = bias.detach().to(dtype)
    _BIAS_CACHE.put(bias, (bias._version, bias.data_ptr(), cast))
    return cast


def _gemm_nt(a, b, gemm: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`a b^T (+ bias)` for operands of the route: `a [M, Kc]`, `b [N, Kc]` (MX tensors with blocked scales, or
    exact values, any strides); `bias` contiguous. Bare launches: the operands come from this file's producers.
    `out`: a contiguous `[M, N]` tensor to write (cuBLAS route with `a` in `out_dtype` only).

    cuBLAS adds a bias in Y's dtype (the bias is rounded to it first); the Triton routes add it in FP32.
    """
    if out is not None:
        if gemm in _MX_GEMMS or gemm == "triton_bf16" or a.dtype != out_dtype:
            raise ValueError(f"_gemm_nt writes into `out` on the cuBLAS route with operands in {out_dtype} only")
        if bias is None:
            return torch.mm(a, b.t(), out=out)
        return torch.addmm(_bias_as(bias, out_dtype), a, b.t(), out=out)
    if gemm in _MX_GEMMS:
        (M, Kc), N = a.data.shape, b.data.shape[0]
        operands = _OPERANDS_FP8 if gemm == "fp8" else _OPERANDS_SCALED
        return _launch(a.data, a.scale, b.data, b.scale, True, True, operands, M, N, Kc, bias=bias,
                       out_dtype=out_dtype, row_mx=False, col_mx=False, scaling="rceil", blocked_out=True,
                       config=None, hw_cast=None).y
    if gemm == "triton_bf16":
        (M, Kc), N = a.shape, b.shape[0]
        return _launch(a, None, b, None, False, False, _OPERANDS_PLAIN, M, N, Kc, bias=bias, out_dtype=out_dtype,
                       row_mx=False, col_mx=False, scaling="rceil", blocked_out=True, config=None, hw_cast=None).y
    if bias is not None and a.dtype == out_dtype:
        return torch.addmm(_bias_as(bias, out_dtype), a, b.t())
    y = _mm_dtype_out(a, b.t(), out_dtype)
    return y if bias is None else (y.float() + bias.float()).to(out_dtype)


# The bias gradient as column sums of dY made by the pass that casts dY (float32 atomics, so the summation order
# differs from torch's: equal within FP32 rounding) instead of a separate `dy.sum(0)` reading dY again.
BIAS_GRAD_FROM_DY_CAST = True


# cuBLAS picks (and caches) a kernel per GEMM shape: the first call at a new shape costs 0.1-0.3 ms of host time
# on the H200's host (the layer's GEMMs at 32767x1024x3072: 113-272 us at a new M, 21-26 us at a known one;
# benchmarks/profile_linear.py). A jagged batch brings a new token count M every step, so every GEMM of every
# layer paid it every step. The cuBLAS route runs its GEMMs at M rounded up to a bucket (`gemm_rows`, under 1/32
# more rows, zero rows past M) so that the shapes repeat across steps. False: GEMMs at M.
GEMM_ROW_BUCKETS = True


def gemm_rows(M: int) -> int:
    """The M the cuBLAS route's GEMMs run at: M rounded up to a multiple of 2^(bit_length(M) - 6) (at most 32
    buckets per power of two, under 1/32 more rows); M when `GEMM_ROW_BUCKETS` is off."""
    if not GEMM_ROW_BUCKETS:
        return M
    step = 1 << max(0, M.bit_length() - 6)
    return -(-M // step) * step


def _dy_operands(dy: torch.Tensor, scaling: str, gemm: str, column_sums: bool = False, rows: int | None = None,
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
    if gemm in _MX_GEMMS:
        out = _casts(dy, None, scaling=scaling, rowwise=row, colwise=col, column_sums=column_sums, activation=act,
                     activation_input=z)
        return out.rowwise, out.colwise, out.column_sums
    opd = operand_dtype_for(dy.dtype)
    if row_out is not None and not (row and row_out.dtype == opd and row_out.is_contiguous()
                                    and row_out.shape == (dy.shape[0] if rows is None else rows, dy.shape[1])):
        row_out = None
    out = _casts(dy, None, scaling=scaling, rowwise=False, colwise=False, row_operand=row, col_operand=col,
                 operand_dtype=opd, column_sums=column_sums, operand_rows=rows, activation=act, activation_input=z,
                 row_operand_out=row_out)
    return out.row_operand, None if out.col_operand is None else out.col_operand.t(), out.column_sums


def _saved_col_operand(data: torch.Tensor, scale: torch.Tensor, scaling: str, gemm: str, dtype: torch.dtype,
                       rows: int | None = None):
    """The saved colwise MX tensor of X (`X^T [K, M]` along M, blocked scales; the payload a view with rows
    padded to a multiple of 16 bytes, see `triton_norm.colwise_payload_buffer`) as the dW GEMM's B operand.

    Dequantized, it is the `[K, M]` view of a contiguous `[M, K]` tensor: the GEMM reads both operands along
    their non-contracted dim, as for BF16 `nn.Linear`. Contiguous along M instead, cuBLAS runs an M that is not
    a multiple of 8 (most token counts of a jagged batch) on an unvectorized kernel: on the H200 that dW GEMM
    took 1.66 ms at 32767x1024->3072 against 0.26 at M = 32760, and the dequantize pass 0.195 against 0.026 ms.
    `rows`: the padded M of the GEMM (`gemm_rows`), zeros past M.
    """
    if gemm in _MX_GEMMS:
        return MXTensor(data, scale, "1d", 1, scaling, dtype, "blocked")
    return _dequantize(data, scale, True, operand_dtype_for(dtype), transposed=True, padded_cols=rows)


def _col_operand_of(x: torch.Tensor, activation: str | None, scaling: str, gemm: str, rows: int | None):
    """The dW GEMM's B operand made from `x [M, K]` itself (its input activation computed again): the values
    `_saved_col_operand` gives from the colwise cast of `activation(x)` the forward would have saved."""
    if gemm in _MX_GEMMS:
        return _casts(x, None, scaling=scaling, rowwise=False, colwise=True, activation=activation).colwise
    out = _casts(x, None, scaling=scaling, rowwise=False, colwise=False, col_operand=True,
                 operand_dtype=operand_dtype_for(x.dtype), operand_rows=rows, activation=activation)
    return out.col_operand.t()


def _linear_backward(ctx, dy, w_ops, make_x_col, d_in_dtype, dw_dtype, need_in, need_w, need_b, rows=None,
                     dy_activation=None, dy_row_out=None, padded_d_in=False):
    """dIn `[M, K]` (d_in_dtype), dW `[N, K]` (dw_dtype), db `[N]` FP32 of `Y = In W^T + b`. `make_x_col()`: the dW
    GEMM's B operand from what the forward kept (`_saved_col_operand`, `_col_operand_of`), made when dW is computed
    and released before dIn is allocated. `rows`: the GEMMs' padded M (the operand then has `rows` columns, zeros
    past M); dIn is then a view of its first M rows (with `padded_d_in`, the `[rows, K]` tensor itself).
    `dy_activation`: see `_dy_operands` (`dy` is the gradient of an activation whose input is Y). `dy_row_out`: the
    buffer dY's row operand is written into (`_dy_operands`' `row_out`; dy's own buffer, whose memory then serves
    again), unless the bias gradient must read dy afterwards.

    dW comes first, then dIn: the input's operand (as large as the input on the cuBLAS route) and dIn are never live
    together. A dY whose exact-value operands exceed `FORWARD_OPERAND_MAX_BYTES` is cast in two passes (one more read
    of dY), the colwise operand released after dW before the rowwise one is made.
    """
    scaling, gemm = ctx.scaling, ctx.gemm
    sums_in_cast = need_b and BIAS_GRAD_FROM_DY_CAST
    separate = gemm == "cublas" and need_in and need_w and \
        dy.shape[0] * dy.shape[1] * operand_dtype_for(dy.dtype).itemsize > FORWARD_OPERAND_MAX_BYTES
    if need_b and not sums_in_cast:
        dy_row_out = None
    dy_row, dy_col_t, dy_sums = _dy_operands(dy, scaling, gemm, sums_in_cast, rows, row=need_in and not separate,
                                             col=need_w or not need_in, dy_activation=dy_activation,
                                             row_out=None if separate else dy_row_out)
    d_in = d_w = d_b = None
    if need_w:
        d_w = _gemm_nt(dy_col_t, make_x_col(), gemm, dw_dtype)
    del dy_col_t
    if need_in:
        if separate:
            dy_row = _dy_operands(dy, scaling, gemm, False, rows, col=False, dy_activation=dy_activation,
                                  row_out=dy_row_out)[0]
        if gemm in _MX_GEMMS:  # B = W^T quantized along N, [K, N]
            d_in = _gemm_nt(dy_row, w_ops.col, gemm, d_in_dtype)
        else:  # B^T = the colwise values of W, [N, K]: B = their transposed view
            d_in = _gemm_nt(dy_row, w_ops.col.t(), gemm, d_in_dtype)
        if not padded_d_in:
            d_in = _first_rows(d_in, dy.shape[0])
    if need_b:  # FP32 column sums of dY
        if sums_in_cast:
            d_b = dy_sums
        elif dy_activation is None:
            d_b = dy.sum(0, dtype=torch.float32)
        else:
            act, z = dy_activation
            d_b = ACTIVATION_BACKWARDS[act](dy, z, grad_input=torch.empty_like(dy)).sum(0, dtype=torch.float32)
    return d_in, d_w, d_b


def _rows(M: int, gemm: str) -> int | None:
    """The padded M of a layer's GEMMs on the cuBLAS route (`gemm_rows`); None (M) on the others."""
    return gemm_rows(M) if gemm == "cublas" else None


def _first_rows(t: torch.Tensor, M: int) -> torch.Tensor:
    """The first M rows of a GEMM result computed at a padded M (a view), or the result itself."""
    return t if t.shape[0] == M else t[:M]


def _as_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias_for(bias: torch.Tensor | None, gemm: str) -> torch.Tensor | None:
    """The Triton GEMM epilogue reads the bias as a contiguous `[N]` vector; cuBLAS takes any strides."""
    return bias if bias is None or gemm == "cublas" or bias.stride(0) == 1 else bias.contiguous()


# The cuBLAS route casts the whole input into a BF16 operand as large as the input before the forward GEMM. At a long
# history that transient set the step's peak (the MLP down-projection: 2.02 GB at 0.97M tokens, on top of its 1.98 GB
# input; docs/PERF.md). An operand above FORWARD_OPERAND_MAX_BYTES is cast and multiplied in row chunks of at most
# FORWARD_OPERAND_CHUNK_BYTES (powers of two: the full chunks' GEMMs share one shape and write Y in place), the
# colwise cast for dW and the norm's rstd made by a pass of their own: one more read of X, the same values.
FORWARD_OPERAND_MAX_BYTES = 1 << 30
FORWARD_OPERAND_CHUNK_BYTES = 1 << 28


def _cast_and_gemm(x: torch.Tensor, g: torch.Tensor | None, eps: float, w_row, bias: torch.Tensor | None,
                   scaling: str, gemm: str, opd: torch.dtype, colwise: bool, out_dtype: torch.dtype,
                   activation: str | None = None):
    """`(Y [M, N], the cast's outputs)` of a forward: `(RMSNorm(x) if g else activation(x))` cast for the route,
    times `w_row^T` (+ bias). The outputs hold the colwise cast when `colwise`, and rstd with `g`; in row chunks (see
    `FORWARD_OPERAND_MAX_BYTES`) they hold no row operand, and are None when neither was asked for."""
    M, K = x.shape
    mx_ops = gemm in _MX_GEMMS
    row_bytes = K * opd.itemsize
    if gemm != "cublas" or M * row_bytes <= FORWARD_OPERAND_MAX_BYTES or x.dtype != out_dtype:
        out = _casts(x, g, eps, scaling=scaling, rowwise=mx_ops, colwise=colwise, row_operand=not mx_ops,
                     operand_dtype=opd, operand_rows=_rows(M, gemm), activation=activation)
        y = _gemm_nt(out.rowwise if mx_ops else out.row_operand, w_row, gemm, out_dtype, _bias_for(bias, gemm))
        return _first_rows(y, M), out
    out = None  # the colwise cast (and with the norm rstd, which the pass makes as well) by a pass of their own
    if colwise or g is not None:
        out = _casts(x, g, eps, scaling=scaling, rowwise=False, colwise=True, activation=activation)
    chunk = 1 << max(5, (FORWARD_OPERAND_CHUNK_BYTES // row_bytes).bit_length() - 1)
    y = torch.empty(M, w_row.shape[0], dtype=out_dtype, device=x.device)
    for m0 in range(0, M, chunk):
        rows = min(chunk, M - m0)
        op = _casts(x[m0:m0 + rows], g, eps, scaling=scaling, rowwise=False, colwise=False, row_operand=True,
                    operand_dtype=opd, operand_rows=_rows(rows, gemm), activation=activation).row_operand
        if op.shape[0] == rows:  # a full chunk (or a partial one the buckets left unpadded): Y's rows in place
            _gemm_nt(op, w_row, gemm, out_dtype, bias, out=y[m0:m0 + rows])
        else:
            y[m0:m0 + rows] = _gemm_nt(op, w_row, gemm, out_dtype, bias)[:rows]
        del op  # freed before the next chunk's operand is allocated: one chunk live at a time
    return y, out


# The backward of each input activation the MX linear computes inside its casts (`reference.INPUT_ACTIVATIONS`), from
# the saved input and the gradient of the activation's output, as torch's autograd computes it.
ACTIVATION_BACKWARDS = {"silu": torch.ops.aten.silu_backward.grad_input}
assert ACTIVATION_BACKWARDS.keys() == INPUT_ACTIVATIONS.keys()


class MXLinearTritonFunction(torch.autograd.Function):
    """`Y [M, N] = act(X [M, K]) W^T + b` by the MXLinear recipe on the Triton path (see the section comment).

    `activation` None (act the identity) or a key of `reference.INPUT_ACTIVATIONS`: the casts compute act(X) on the fly
    (it is never stored) and X is kept for the activation's backward. With X kept, the colwise cast of act(X) that dW
    needs is not: the backward makes it again from X (`_col_operand_of`), the same bytes, so that the layer keeps X
    alone (2 bytes per element for BF16, where X and the colwise cast were 3). Arguments as `mx_linear_triton`'s,
    checked by the caller (`mx_linear_triton`, `ops.mx_linear`)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, scaling: str, gemm: str, activation: str | None = None):
        check_linear_gemm(gemm)
        opd = operand_dtype_for(x2.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # only dW reads X's colwise cast
        w_ops = weight_operands(weight, scaling, gemm, opd, need_col=need_x)
        x = _contiguous_last(x2)
        keep_x = activation is not None and need_x
        colwise = need_w and not keep_x
        y, out = _cast_and_gemm(x, None, 0.0, w_ops.row, bias, scaling, gemm, opd, colwise, x2.dtype, activation)
        col = out.colwise if colwise else None
        ctx.save_for_backward(col.data if colwise else None, col.scale if colwise else None, weight,
                              x if keep_x else None)
        ctx.w_ops, ctx.scaling, ctx.gemm, ctx.activation = w_ops, scaling, gemm, activation
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _mx_linear_backward(ctx, dy)
        return dx, dw, db, None, None, None


def _mx_linear_backward(ctx, dy, activation_backward: bool = True):
    """`MXLinearTritonFunction`'s dX, dW, db. With an input activation and `activation_backward=False`, dX is the
    gradient of act(X) (its backward left to the caller, `RMSNormMXMLPTritonFunction`), as the GEMM wrote it: with
    its padded rows (`_linear_backward`'s `padded_d_in`)."""
    x_data, x_scale, weight, x = ctx.saved_tensors
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    w_ops = weight_operands(weight, ctx.scaling, ctx.gemm, operand_dtype_for(x_dtype), need_col=True) \
        if need_x and ctx.w_ops.col is None else ctx.w_ops
    rows = _rows(dy.shape[0], ctx.gemm)

    def x_col():
        if x_data is None:  # X kept instead: the cast of its activation again
            return _col_operand_of(x, ctx.activation, ctx.scaling, ctx.gemm, rows)
        return _saved_col_operand(x_data, x_scale, ctx.scaling, ctx.gemm, x_dtype, rows)

    dx, dw, db = _linear_backward(ctx, dy, w_ops, x_col, x_dtype, w_dtype, need_x, need_w, need_b, rows,
                                  padded_d_in=not activation_backward)
    if dx is not None and ctx.activation is not None and activation_backward:  # dX is act(X)'s gradient: in place
        dx = ACTIVATION_BACKWARDS[ctx.activation](dx, x, grad_input=dx)
    return dx, dw, _as_dtype(db, b_dtype)


class RMSNormMXLinearTritonFunction(torch.autograd.Function):
    """`Y = RMSNorm(X) W^T + b` on the Triton path: the fused norm kernel produces the forward operand and
    the saved colwise MX tensor; the backward runs the MXLinear GEMMs (dYn in X's dtype, as the reference's) and the
    norm backward kernel.

    Arguments as `rms_norm_mx_linear_triton`'s, checked by the caller.
    """

    @staticmethod
    def forward(ctx, x2, norm_weight, weight, bias, eps: float, scaling: str, gemm: str):
        check_linear_gemm(gemm)
        opd = operand_dtype_for(x2.dtype)
        x = _contiguous_last(x2)
        g = _contiguous_last(norm_weight)
        need_w = ctx.needs_input_grad[2]  # only dW reads the colwise cast of the normalized activation
        need_dyn = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w_ops = weight_operands(weight, scaling, gemm, opd, need_col=need_dyn)
        y, out = _cast_and_gemm(x, g, eps, w_ops.row, bias, scaling, gemm, opd, need_w, x2.dtype)
        col = out.colwise
        ctx.save_for_backward(x, g, out.rstd, col.data if need_w else None, col.scale if need_w else None, weight)
        ctx.w_ops, ctx.scaling, ctx.gemm = w_ops, scaling, gemm
        ctx.dtypes = (x2.dtype, norm_weight.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_norm_linear_backward(ctx, dy), None, None, None)


def _norm_linear_backward(ctx, dy, dy_activation=None, dy_row_out=None):
    """`RMSNormMXLinearTritonFunction`'s dX, dnorm_weight, dW, db; `dy_activation`, `dy_row_out` as
    `_linear_backward`'s."""
    x, norm_weight, rstd, yn_data, yn_scale, weight = ctx.saved_tensors
    x_dtype, g_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_g, need_w, need_b = ctx.needs_input_grad[:4]
    need_dyn = need_x or need_g
    w_ops = weight_operands(weight, ctx.scaling, ctx.gemm, operand_dtype_for(x_dtype), need_col=True) \
        if need_dyn and ctx.w_ops.col is None else ctx.w_ops
    rows = _rows(dy.shape[0], ctx.gemm)
    dyn, dw, db = _linear_backward(
        ctx, dy, w_ops, lambda: _saved_col_operand(yn_data, yn_scale, ctx.scaling, ctx.gemm, x_dtype, rows),
        x_dtype, w_dtype, need_dyn, need_w, need_b, rows, dy_activation, dy_row_out)
    dx = dg = None
    if need_dyn:  # RMSNorm backward in FP32 from the saved rstd
        dx, dg = _norm_backward(x, norm_weight, rstd, dyn)
        dg = _as_dtype(dg, g_dtype)
    return dx, dg, dw, _as_dtype(db, b_dtype)


class _LayerContext:
    """The autograd context one layer's Function (`RMSNormMXLinearTritonFunction`, `MXLinearTritonFunction`) sees
    when a fused Function runs it: its `needs_input_grad`, the tensors it saves (the fused Function saves them
    through its own context) and its attributes."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


class RMSNormMXMLPTritonFunction(torch.autograd.Function):
    """`down(act(up(X)))`: `RMSNormMXLinearTritonFunction` (up) then `MXLinearTritonFunction` with the input activation
    (down), whose backward hands the up-projection the gradient of act's output: the up-projection's dY casts compute
    act's backward on the fly (`_dy_operands`' `dy_activation`), so that gradient is never stored and its own pass
    (read the gradient and the pre-activation, write their product) is gone. The same values as the two Functions
    composed (the activation's backward rounded to X's dtype either way). Arguments checked by the caller
    (`ops.rms_norm_mx_mlp`).
    """

    @staticmethod
    def forward(ctx, x2, norm_weight, w_up, b_up, w_down, b_down, eps: float, scaling: str, gemm: str,
                activation: str):
        need = ctx.needs_input_grad
        up = _LayerContext((need[0], need[1], need[2], need[3]))
        h = RMSNormMXLinearTritonFunction.forward(up, x2, norm_weight, w_up, b_up, eps, scaling, gemm)
        down = _LayerContext((any(need[:4]), need[4], need[5]))
        y = MXLinearTritonFunction.forward(down, h, w_down, b_down, scaling, gemm, activation)
        ctx.save_for_backward(*up.saved_tensors, *down.saved_tensors)
        ctx.layers, ctx.n_up = (up, down), len(up.saved_tensors)
        up.saved_tensors = down.saved_tensors = ()  # held by ctx alone
        return y

    @staticmethod
    def backward(ctx, dy):
        up, down = ctx.layers
        saved = ctx.saved_tensors
        up.saved_tensors, down.saved_tensors = saved[:ctx.n_up], saved[ctx.n_up:]
        d_act, dw_down, db_down = _mx_linear_backward(down, dy, activation_backward=False)
        dx = dg = dw_up = db_up = None
        if d_act is not None:
            h = down.saved_tensors[3]  # the pre-activation, which the down-projection keeps
            # act's gradient (rows padded for the GEMMs) is read once, by the up-projection's dY cast, which writes
            # its row operand over it: the memory of the composed layers' backward (there, act's backward ran in
            # place on this buffer before the pre-activation was freed)
            dx, dg, dw_up, db_up = _norm_linear_backward(up, _first_rows(d_act, dy.shape[0]), (down.activation, h),
                                                         dy_row_out=d_act)
        up.saved_tensors = down.saved_tensors = ()
        return dx, dg, dw_up, db_up, dw_down, db_down, None, None, None, None


def mx_linear_triton(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     scaling: str = "rceil", gemm: str = "cublas", activation: str | None = None) -> torch.Tensor:
    """`activation(x2) [M, K] @ weight [N, K]^T + bias` by the MXLinear recipe on the Triton path (differentiable).

    K and N multiples of 32; x2 on CUDA (or CPU under TRITON_INTERPRET=1), see `check_linear_args`. Output
    `[M, N]` in x2's dtype. `gemm`: one of `LINEAR_GEMMS`. `activation`: None or a key of `reference.INPUT_ACTIVATIONS`
    (computed inside the casts, as torch computes it in x2's dtype).
    """
    check_linear_args(x2, weight, bias)
    check_scaling(scaling)
    check_linear_gemm(gemm)
    check_input_activation(activation, "activation")
    return MXLinearTritonFunction.apply(x2, weight, bias, scaling, gemm, activation)


def rms_norm_mx_linear_triton(x2: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None, eps: float = 1e-6, scaling: str = "rceil",
                              gemm: str = "cublas") -> torch.Tensor:
    """`RMSNorm(x2) @ weight^T + bias` with the fused norm+quantize kernel (differentiable), `[M, N]`."""
    check_linear_args(x2, weight, bias, norm_weight)
    check_scaling(scaling)
    check_linear_gemm(gemm)
    return RMSNormMXLinearTritonFunction.apply(x2, norm_weight, weight, bias, float(eps), scaling, gemm)

