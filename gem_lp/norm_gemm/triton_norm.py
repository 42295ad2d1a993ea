"""Fused RMSNorm + MXFP8 quantize in one Triton kernel, its backward, and the same pass without the norm.

Forward (`rms_norm_mx`), per program a block of 32 (or 64) rows of `x [M, K]`:

1. sweep over K in chunks: sum of squares per row (FP32), then `rstd = 1 / sqrt(sum / K + eps)` with
   correctly rounded division and square root (as the reference computes on CPU);
2. sweep again (the chunks come back from L2; with one chunk covering K the tile stays in registers):
   `y = (fp32(x) * rstd) * fp32(w)` in the reference's operation order, then from the FP32 `y`:
   the rowwise MX cast (1x32 along K, payload `[M, K]`), the colwise MX cast (32x1 along M, payload of
   `y^T`, `[K, M]`; a last partial block takes its max over the real rows), scales plain or straight in
   the 128x4 blocked layout, and optionally the MX-exact dequantized operands for a BF16/FP32 GEMM:
   `deq(rowwise)` and `deq(colwise)`, both in `x`'s `[M, K]` layout.

With `weight=None` the kernel skips the norm (`y = x`): a dual MX cast that also writes the dequantized
operands, the producer pass of the MX GEMMs.

Every MX step is `gem_lp.mx.triton_numerics`, so the bytes equal `quantize_reference`'s for the same FP32
`y`. The sum of squares is accumulated in the kernel's own order, which can differ from torch's in the
last bit of `rstd`; whenever that FP32 sum is exact (order-free), `rstd` and every byte equal the reference.

Backward (`rms_norm_backward`): `dx = rstd * (dxhat - xhat * mean(dxhat * xhat))` with
`xhat = x * rstd`, `dxhat = dy * w`, and per-program partial `dw = sum_rows(dy * xhat)` (FP32) reduced
by one `sum` over programs.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..backend import interpreter_enabled
from ..mx.formats import BLOCK, INPUT_DTYPES, PAYLOAD_DTYPE, SCALE_DTYPE, MXTensor, ceil_div, check_scaling
from ..mx.layout import blocked_size
from ..mx.triton_numerics import abs_bits, encode, scale_byte
from .reference import RMSNormQuantized

OPERAND_DTYPES = (torch.bfloat16, torch.float32)
# Largest K whose rows a program keeps whole in registers (one sweep over HBM); beyond it, chunks of
# `MULTI_PASS_BLOCK_K` are read twice, the second time mostly from L2. Chosen from sm_90 builds (ptxas):
# 32x512 with 16 warps and 32x256 with 8 warps need no spills; 32x1024 with 16 warps spills ~800 bytes.
ONE_PASS_MAX_K = 512
MULTI_PASS_BLOCK_K = 256
_INT32_SPAN = 2**31


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def load_f32(ptrs, mask):
    """Load as FP32; bf16 is widened by a 16-bit shift of its bits (exact also in the interpreter)."""
    raw = tl.load(ptrs, mask=mask, other=0.0)
    if ptrs.dtype.element_ty == tl.bfloat16:
        return (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def scale_value(byte):
    """2^(byte - 127) as FP32 (byte 0 -> the subnormal 2^-127, byte 255 -> NaN)."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    return tl.where(byte == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_value(q, HW_CAST: tl.constexpr):
    """FP32 value of E4M3 bytes `q` (uint8 / int32 0..255), NaN for 0x7F / 0xFF."""
    if HW_CAST:
        return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = q.to(tl.int32)
        e = (b >> 3) & 0xF
        m = b & 0x7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2^-9
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
        return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def store_operand(ptrs, v, mask, HW_CAST: tl.constexpr):
    """Store FP32 `v` in the pointer's dtype (bf16: round to nearest even, NaN kept)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        if HW_CAST:
            tl.store(ptrs, v.to(tl.bfloat16), mask=mask)
        else:  # the interpreter's fp32 -> bf16 cast truncates: round by integer arithmetic
            bits = v.to(tl.int32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            tl.store(ptrs, r.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def scale_offset(r, c, n_cols, BLOCKED: tl.constexpr):
    """Byte offset of scale (r, c) of a matrix with `n_cols` columns: row-major, or 128x4 blocked."""
    if BLOCKED:
        tile = (r // 128) * ((n_cols + 3) // 4) + c // 4
        return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    else:
        return r * n_cols + c


# ----------------------------------------------------------------------------- forward kernel


@triton.jit
def _quantize_chunk(
    x, m, k, m0, k0, M, K, in_bounds, rstd, w_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, row_op_ptr, col_op_ptr,
    NMB: tl.constexpr, NKB: tl.constexpr, NORMALIZE: tl.constexpr,
    ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr,
):
    """Normalize one [NMB, 32, NKB, 32] chunk (rows m0 + m, columns k0 + k) and write its casts."""
    if NORMALIZE:
        w = load_f32(w_ptr + k0 + k, k < K - k0)
        y = (x * rstd[:, :, None, None]) * w  # the reference's order: (x * rstd) * w
        # rows past M (and columns past K) are 0 for the block maxima, whatever rstd is there
        y = tl.where(in_bounds, y, 0.0)
    else:
        y = x
    a = abs_bits(y)
    row_off = m0.to(tl.int64) * K + k0  # element (m0, k0) of an [M, K] output
    if ROW_MX or ROW_OP:
        byte = scale_byte(tl.max(a, axis=3), RCEIL)  # [NMB, 32, NKB]
        q = encode(y, byte[:, :, :, None], HW_CAST)
        if ROW_MX:
            tl.store(row_data_ptr + row_off + m * K + k, q, mask=in_bounds)
            r = m0 + tl.arange(0, NMB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
            c = k0 // 32 + tl.arange(0, NKB)[None, None, :]
            tl.store(row_scale_ptr + scale_offset(r, c, K // 32, BLOCKED_SCALES), byte.to(tl.uint8),
                     mask=(r < M) & (c < K // 32))
        if ROW_OP:
            deq = e4m3_value(q, HW_CAST) * scale_value(byte)[:, :, :, None]
            store_operand(row_op_ptr + row_off + m * K + k, deq, in_bounds, HW_CAST)
    if COL_MX or COL_OP:
        byte = scale_byte(tl.max(a, axis=1), RCEIL)  # [NMB, NKB, 32]; rows past M hold 0
        q = encode(y, byte[:, None, :, :], HW_CAST)
        if COL_MX:  # payload of y^T, [K, M] contiguous
            col_off = tl.cast(k0, tl.int64) * M + m0
            tl.store(col_data_ptr + col_off + k * M + m, q, mask=in_bounds)
            r = k0 + tl.arange(0, NKB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
            c = m0 // 32 + tl.arange(0, NMB)[:, None, None]
            n_cols = (M + 31) // 32
            tl.store(col_scale_ptr + scale_offset(r, c, n_cols, BLOCKED_SCALES), byte.to(tl.uint8),
                     mask=(r < K) & (c < n_cols))
        if COL_OP:
            deq = e4m3_value(q, HW_CAST) * scale_value(byte)[:, None, :, :]
            store_operand(col_op_ptr + row_off + m * K + k, deq, in_bounds, HW_CAST)


@triton.jit
def _rms_norm_mx_kernel(
    x_ptr, stride_xm, w_ptr, M, K: tl.constexpr, eps, rstd_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, row_op_ptr, col_op_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, NORMALIZE: tl.constexpr,
    ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
):
    # Tiles are [BLOCK_M/32, 32, BLOCK_K/32, 32] = (row block, row, column block, column): every MX block
    # max is a plain reduction over one axis. x's last dim is contiguous (checked by the wrapper).
    NMB: tl.constexpr = BLOCK_M // 32
    NKB: tl.constexpr = BLOCK_K // 32
    m0 = tl.program_id(0) * BLOCK_M
    m = tl.arange(0, NMB)[:, None, None, None] * 32 + tl.arange(0, 32)[None, :, None, None]
    k = tl.arange(0, NKB)[None, None, :, None] * 32 + tl.arange(0, 32)[None, None, None, :]
    if LARGE_OFFSETS:  # k * M or m * stride inside one chunk reaches 2^31
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    row_ok = m < M - m0
    x_rows = x_ptr + m0.to(tl.int64) * stride_xm + m * stride_xm
    rstd = tl.zeros((NMB, 32), tl.float32)
    if ONE_PASS:  # BLOCK_K covers K: one read of x
        in_bounds = row_ok & (k < K)
        x = load_f32(x_rows + k, in_bounds)
        if NORMALIZE:
            sum_sq = tl.sum(tl.sum(x * x, axis=3), axis=2)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, tl.full((), K, tl.float32)) + eps))
        _quantize_chunk(x, m, k, m0, 0, M, K, in_bounds, rstd, w_ptr,
                        row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, row_op_ptr, col_op_ptr,
                        NMB, NKB, NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL, HW_CAST)
    else:
        if NORMALIZE:
            acc = tl.zeros((NMB, 32, NKB, 32), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = load_f32(x_rows + k0 + k, row_ok & (k < K - k0))
                acc += x * x
            sum_sq = tl.sum(tl.sum(acc, axis=3), axis=2)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, tl.full((), K, tl.float32)) + eps))
        for k0 in range(0, K, BLOCK_K):
            in_bounds = row_ok & (k < K - k0)
            x = load_f32(x_rows + k0 + k, in_bounds)
            _quantize_chunk(x, m, k, m0, k0, M, K, in_bounds, rstd, w_ptr,
                            row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, row_op_ptr, col_op_ptr,
                            NMB, NKB, NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL,
                            HW_CAST)
    if NORMALIZE:
        rows = m0 + tl.arange(0, NMB)[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)


# ----------------------------------------------------------------------------- backward kernel


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, stride_xm, dy_ptr, stride_dym, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)[:, None]
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if ONE_PASS:
        ok = row_ok[:, None] & (cols < K)[None, :]
        xhat = load_f32(x_ptr + rows64 * stride_xm + cols[None, :], ok) * rstd
        dy = load_f32(dy_ptr + rows64 * stride_dym + cols[None, :], ok)
        dxhat = dy * load_f32(w_ptr + cols, cols < K)[None, :]
        mean = tl.div_rn(tl.sum(dxhat * xhat, axis=1), tl.full((), K, tl.float32))[:, None]
        store_operand(dx_ptr + rows64 * K + cols[None, :], rstd * (dxhat - xhat * mean), ok, HW_CAST)
        tl.store(dw_part_ptr + pid.to(tl.int64) * K + cols, tl.sum(dy * xhat, axis=0), mask=cols < K)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            ok = row_ok[:, None] & (c < K)[None, :]
            xhat = load_f32(x_ptr + rows64 * stride_xm + c[None, :], ok) * rstd
            dxhat = load_f32(dy_ptr + rows64 * stride_dym + c[None, :], ok) * load_f32(w_ptr + c, c < K)[None, :]
            acc += dxhat * xhat
        mean = tl.div_rn(tl.sum(acc, axis=1), tl.full((), K, tl.float32))[:, None]
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            ok = row_ok[:, None] & (c < K)[None, :]
            xhat = load_f32(x_ptr + rows64 * stride_xm + c[None, :], ok) * rstd
            dy = load_f32(dy_ptr + rows64 * stride_dym + c[None, :], ok)
            dxhat = dy * load_f32(w_ptr + c, c < K)[None, :]
            store_operand(dx_ptr + rows64 * K + c[None, :], rstd * (dxhat - xhat * mean), ok, HW_CAST)
            tl.store(dw_part_ptr + pid.to(tl.int64) * K + c, tl.sum(dy * xhat, axis=0), mask=c < K)


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class NormMXOutputs:
    """Outputs of `rms_norm_mx` (each None unless requested).

    Attributes:
        rowwise: `y [M, K]` in MXFP8, 1x32 blocks along K (scales `[M, K/32]`, plain or blocked).
        colwise: `y^T [K, M]` in MXFP8, 1x32 blocks along M (scales `[K, ceil(M/32)]`, plain or blocked).
        rstd: `[M]` float32 (None without the norm).
        row_operand: `deq(rowwise)`, `[M, K]` in `operand_dtype`: the forward GEMM operand.
        col_operand: `deq(colwise)` laid out as `y`, `[M, K]` in `operand_dtype`: the operand of a GEMM
            contracting over M (read transposed).
    """

    rowwise: MXTensor | None
    colwise: MXTensor | None
    rstd: torch.Tensor | None
    row_operand: torch.Tensor | None
    col_operand: torch.Tensor | None


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def default_config(K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) of the forward kernel for rows of K elements."""
    if interpreter_enabled():  # cost is per program and per op: one chunk when it fits
        return 32, min(_pow2_at_least(K, BLOCK), 128), 1
    if K <= ONE_PASS_MAX_K:
        bk = _pow2_at_least(K, BLOCK)
        return 32, bk, max(4, bk // 32)
    return 32, MULTI_PASS_BLOCK_K, 8


def _check_2d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {x.stride()}")
    if not x.is_cuda and not interpreter_enabled():
        raise ValueError(f"the Triton RMSNorm kernels need CUDA tensors ({name} is on {x.device}); on a CPU "
                         f"machine set TRITON_INTERPRET=1 before importing gem_lp")


def _check_weight(weight: torch.Tensor, K: int, x: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.shape != (K,) or weight.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous [K={K}] tensor, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {weight.device}")


def _check_config(block_m: int, block_k: int, num_warps: int) -> None:
    if block_m not in (32, 64):
        raise ValueError(f"block_m must be 32 or 64, got {block_m}")
    if block_k < BLOCK or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= {BLOCK}, got {block_k}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")


def rms_norm_mx(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    scaling: str = "rceil",
    rowwise: bool = True,
    colwise: bool = True,
    row_operand: bool = False,
    col_operand: bool = False,
    operand_dtype: torch.dtype = torch.bfloat16,
    blocked_scales: bool = True,
    block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    hw_cast: bool | None = None,
) -> NormMXOutputs:
    """RMSNorm of `x` (or `x` itself when `weight` is None) in MXFP8, from one kernel launch.

    Args:
        x: `[M, K]` float32/bfloat16/float16 with a contiguous last dim; K a multiple of 32, M >= 0.
        weight: `[K]` RMSNorm weight (any float dtype), or None for no norm (`y = x`).
        eps: added to the mean of squares (as FP32).
        scaling: `"rceil"` or `"floor"`.
        rowwise, colwise: write the MX casts (payload + scales) of `y` along K / of `y^T` along M.
        row_operand, col_operand: write `deq(rowwise)` / `deq(colwise)` as `[M, K]` tensors of
            `operand_dtype` (bfloat16 or float32): exact MX values a BF16/FP32 GEMM consumes (bfloat16
            rounds only values below 2^-126 that need more than its subnormal precision).
        blocked_scales: scales in the 128x4 blocked layout (padding bytes 0) instead of row-major.
        block_m (32 or 64), block_k (power of two >= 32), num_warps: kernel configuration;
            None takes `default_config(K)`.
        hw_cast: hardware E4M3/BF16 conversions (default: on CUDA outside the interpreter).
    """
    _check_2d(x, "x")
    check_scaling(scaling)
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"x's last dim K must be a multiple of {BLOCK}, got K={K}")
    if weight is not None:
        _check_weight(weight, K, x)
    if not (rowwise or colwise or row_operand or col_operand):
        raise ValueError("at least one of rowwise, colwise, row_operand, col_operand must be True")
    if operand_dtype not in OPERAND_DTYPES:
        raise ValueError(f"operand_dtype must be one of {OPERAND_DTYPES}, got {operand_dtype}")
    cfg = default_config(K)
    block_m = cfg[0] if block_m is None else block_m
    block_k = cfg[1] if block_k is None else block_k
    num_warps = cfg[2] if num_warps is None else num_warps
    _check_config(block_m, block_k, num_warps)
    if hw_cast is None:
        hw_cast = x.is_cuda and not interpreter_enabled()

    dev = x.device
    n_kb, n_mb = K // BLOCK, ceil_div(M, BLOCK)
    row = col = None
    if rowwise:
        shape = (blocked_size(M, n_kb),) if blocked_scales else (M, n_kb)
        row = (torch.empty(M, K, dtype=PAYLOAD_DTYPE, device=dev),
               (torch.zeros if blocked_scales else torch.empty)(shape, dtype=SCALE_DTYPE, device=dev))
    if colwise:
        shape = (blocked_size(K, n_mb),) if blocked_scales else (K, n_mb)
        col = (torch.empty(K, M, dtype=PAYLOAD_DTYPE, device=dev),
               (torch.zeros if blocked_scales else torch.empty)(shape, dtype=SCALE_DTYPE, device=dev))
    rstd = torch.empty(M, dtype=torch.float32, device=dev) if weight is not None else None
    row_op = torch.empty(M, K, dtype=operand_dtype, device=dev) if row_operand else None
    col_op = torch.empty(M, K, dtype=operand_dtype, device=dev) if col_operand else None

    if M > 0:
        x = x.detach()
        span = max(block_m * max(x.stride(0), K), block_k * M)
        ptrs = [None if t is None else t.view(torch.uint8) for t in
                (row[0] if row else None, row[1] if row else None, col[0] if col else None, col[1] if col else None)]
        _rms_norm_mx_kernel[(triton.cdiv(M, block_m),)](
            x, x.stride(0), None if weight is None else weight.detach(), M, K, float(eps), rstd,
            *ptrs, row_op, col_op,
            BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=block_k >= K, NORMALIZE=weight is not None,
            ROW_MX=rowwise, COL_MX=colwise, ROW_OP=row_operand, COL_OP=col_operand,
            BLOCKED_SCALES=blocked_scales, RCEIL=scaling == "rceil", HW_CAST=hw_cast,
            LARGE_OFFSETS=span >= _INT32_SPAN, num_warps=num_warps,
        )
    layout = "blocked" if blocked_scales else "plain"
    orig = x.dtype if weight is None else torch.float32  # the normalized y is FP32, as in the reference
    return NormMXOutputs(
        rowwise=None if row is None else MXTensor(row[0], row[1], "1d", 1, scaling, orig, layout),
        colwise=None if col is None else MXTensor(col[0], col[1], "1d", 1, scaling, orig, layout),
        rstd=rstd, row_operand=row_op, col_operand=col_op,
    )


def rms_norm_quantize_triton(x2: torch.Tensor, weight: torch.Tensor, eps: float, scaling: str = "rceil", *,
                             blocked_scales: bool = False) -> RMSNormQuantized:
    """`rms_norm_quantize_reference`'s result from the fused kernel: rowwise, colwise and rstd.

    `x2 [M, K]` and `weight [K]` in any layout (copied to a contiguous last dim when needed). With
    `blocked_scales=False` the scales are plain `[M, K/32]` / `[K, ceil(M/32)]` matrices, as the reference
    returns them; with True they are in the 128x4 blocked layout (`scale_layout="blocked"`).
    """
    x2 = x2 if x2.dim() != 2 or x2.shape[1] <= 1 or x2.stride(1) == 1 else x2.contiguous()
    weight = weight if weight.dim() != 1 or weight.stride(0) == 1 else weight.contiguous()
    out = rms_norm_mx(x2, weight, eps, scaling=scaling, blocked_scales=blocked_scales)
    return RMSNormQuantized(out.rowwise, out.colwise, out.rstd)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *,
                      block_m: int | None = None, block_k: int | None = None,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `y = x * rstd * weight` (rstd from x, as RMSNorm) with respect to x and weight.

    Args:
        x: `[M, K]` the forward input; weight: `[K]`; rstd: `[M]` float32 from the forward.
        dy: `[M, K]` gradient of y (any float dtype, contiguous last dim; FP32 keeps the reference's math).

    Returns:
        `dx [M, K]` in x's dtype and `dweight [K]` float32 (FP32 math throughout).
    """
    _check_2d(x, "x")
    _check_2d(dy, "dy")
    M, K = x.shape
    _check_weight(weight, K, x)
    if dy.shape != x.shape or dy.device != x.device:
        raise ValueError(f"dy must be [M={M}, K={K}] on {x.device}, got {tuple(dy.shape)} on {dy.device}")
    if rstd.dtype != torch.float32 or rstd.shape != (M,) or rstd.device != x.device or not rstd.is_contiguous():
        raise ValueError(f"rstd must be a contiguous float32 [M={M}] tensor on {x.device}, got "
                         f"{rstd.dtype} {tuple(rstd.shape)} on {rstd.device}")
    if interpreter_enabled():
        bm, bk, nw = 16, min(_pow2_at_least(K, 16), 128), 1
    elif K <= 2048:
        bm, bk, nw = 16, _pow2_at_least(K, 16), 8
    else:
        bm, bk, nw = 16, 1024, 8
    block_m = bm if block_m is None else block_m
    block_k = bk if block_k is None else block_k
    num_warps = nw if num_warps is None else num_warps
    for name, v in (("block_m", block_m), ("block_k", block_k), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    dx = torch.empty(M, K, dtype=x.dtype, device=x.device)
    n_prog = triton.cdiv(M, block_m)
    if n_prog == 0:
        return dx, torch.zeros(K, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(n_prog, K, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_prog,)](
        x.detach(), x.stride(0), dy.detach(), dy.stride(0), weight.detach(), rstd, dx, dw_part, M, K,
        BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=block_k >= K, HW_CAST=x.is_cuda and not interpreter_enabled(),
        num_warps=num_warps,
    )
    return dx, dw_part.sum(0)
