"""Triton MXFP8 cast of a 2-D tensor: rowwise (1x32), colwise (32x1, stored transposed) and square (32x32).

One kernel reads `x [M, K]` once, tile by tile, and writes any combination of:

* rowwise: payload `[M, K]` and scales of the `[M, K/32]` matrix (blocks of 32 along K);
* colwise: payload of `x^T`, `[K, M]` contiguous, and scales of the `[K, ceil(M/32)]` matrix (blocks of
  32 along M; a last partial block takes its max over the real rows only, exactly
  `quantize_reference(x.t(), axis=1, allow_partial=True)`);
* square: payload `[M, K]` and scales `[M/32, K/32]`, one per 32x32 tile (M, K multiples of 32).

Rowwise and colwise scales are plain or written straight into the 128x4 blocked layout of `layout.py`
(padding bytes are 0); square scales are always plain. Every numeric step comes from `triton_numerics`,
so the bytes equal `reference.py`'s on the GPU and under `TRITON_INTERPRET=1`.

`mx_cast_2d` is registered as the custom op `gem_lp::mx_cast_2d` (with a fake implementation), so
`torch.compile(fullgraph=True)` traces callers without graph breaks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreter_enabled
from .formats import BLOCK, INPUT_DTYPES, PAYLOAD_DTYPE, SCALE_DTYPE, ceil_div, check_scaling
from .layout import blocked_size
from .triton_numerics import abs_bits, encode, scale_byte

# (BLOCK_M, BLOCK_K, num_warps) per set of outputs, chosen for register use (sm_90 builds: 56, 88, 123
# and 53 registers a thread); `benchmarks/bench_quantize.py` measures these against alternatives.
DEFAULT_CONFIGS = {
    "rowwise": (64, 128, 4),
    "colwise": (128, 64, 8),
    "dual": (128, 64, 8),
    "square": (64, 64, 4),
}
# Under the interpreter the cost is per program and per op, not per byte: larger tiles run faster.
INTERPRETER_CONFIG = (64, 64, 1)
# Offsets inside a tile at or above this need int64 arithmetic.
_INT32_SPAN = 2**31


@triton.jit
def _scale_offset(r, c, n_cols, BLOCKED: tl.constexpr):
    """Byte offset of scale (r, c) of a matrix with `n_cols` columns: row-major, or 128x4 blocked."""
    if BLOCKED:
        n_col_tiles = (n_cols + 3) // 4
        tile = (r // 128) * n_col_tiles + c // 4
        return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    else:
        return r * n_cols + c


@triton.jit
def _mx_cast_2d_kernel(
    x_ptr, stride_xm, stride_xk, M, K,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, sq_data_ptr, sq_scale_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, SQUARE: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
):
    # The tile is held as [BLOCK_M/32, 32, BLOCK_K/32, 32] = (row block, row in block, col block,
    # col in block), so every block max is a plain reduction over one or two axes, without reshapes.
    NMB: tl.constexpr = BLOCK_M // 32
    NKB: tl.constexpr = BLOCK_K // 32
    # A 1-D grid, tiles in row-major order (a 2-D grid's second dimension is capped at 65535).
    n_k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    m0 = (pid // n_k_tiles) * BLOCK_M
    k0 = (pid % n_k_tiles) * BLOCK_K
    mb = tl.arange(0, NMB)[:, None, None, None]
    kb = tl.arange(0, NKB)[None, None, :, None]
    m = mb * 32 + tl.arange(0, 32)[None, :, None, None]  # row within the tile
    k = kb * 32 + tl.arange(0, 32)[None, None, None, :]  # column within the tile
    in_bounds = (m < M - m0) & (k < K - k0)
    if LARGE_OFFSETS:  # some offset inside a tile (e.g. BLOCK_K * M) reaches 2^31
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    # Tile origins in int64 (tensors may exceed 2^31 elements); offsets inside a tile are int32
    # unless LARGE_OFFSETS.
    x_tile = x_ptr + m0.to(tl.int64) * stride_xm + k0.to(tl.int64) * stride_xk
    # Out-of-range rows read as 0, which leaves every block max unchanged (partial colwise blocks).
    raw = tl.load(x_tile + m * stride_xm + k * stride_xk, mask=in_bounds, other=0.0)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 -> fp32 as a 16-bit shift of the bits: exact (the interpreter's bf16 cast mangles
        # subnormals), and what the hardware conversion does anyway.
        x = (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    a = abs_bits(x)  # int32, NaN-proof max

    if ROWWISE or SQUARE:
        row_amax = tl.max(a, axis=3)  # [NMB, 32, NKB]
    if ROWWISE:
        byte = scale_byte(row_amax, RCEIL)
        q = encode(x, byte[:, :, :, None], HW_CAST)
        out = row_data_ptr + m0.to(tl.int64) * K + k0
        tl.store(out + m * K + k, q, mask=in_bounds)
        r = m0 + tl.arange(0, NMB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        c = k0 // 32 + tl.arange(0, NKB)[None, None, :]
        n_cols = K // 32
        tl.store(row_scale_ptr + _scale_offset(r, c, n_cols, BLOCKED_SCALES), byte.to(tl.uint8),
                 mask=(r < M) & (c < n_cols))
    if COLWISE:
        col_amax = tl.max(a, axis=1)  # [NMB, NKB, 32]
        byte = scale_byte(col_amax, RCEIL)
        q = encode(x, byte[:, None, :, :], HW_CAST)
        out = col_data_ptr + k0.to(tl.int64) * M + m0  # payload of x^T: [K, M] contiguous
        tl.store(out + k * M + m, q, mask=in_bounds)
        r = k0 + tl.arange(0, NKB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        c = m0 // 32 + tl.arange(0, NMB)[:, None, None]
        n_cols = (M + 31) // 32
        tl.store(col_scale_ptr + _scale_offset(r, c, n_cols, BLOCKED_SCALES), byte.to(tl.uint8),
                 mask=(r < K) & (c < n_cols))
    if SQUARE:
        sq_amax = tl.max(row_amax, axis=1)  # [NMB, NKB]
        byte = scale_byte(sq_amax, RCEIL)
        q = encode(x, byte[:, None, :, None], HW_CAST)
        out = sq_data_ptr + m0.to(tl.int64) * K + k0
        tl.store(out + m * K + k, q, mask=in_bounds)
        r = m0 // 32 + tl.arange(0, NMB)[:, None]
        c = k0 // 32 + tl.arange(0, NKB)[None, :]
        n_cols = K // 32
        tl.store(sq_scale_ptr + r * n_cols + c, byte.to(tl.uint8), mask=(r < M // 32) & (c < n_cols))


def output_specs(M: int, K: int, rowwise: bool, colwise: bool, square: bool,
                 blocked_scales: bool) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """(shape, dtype, zeroed) of `mx_cast_2d`'s outputs, in order (payload, scale) per requested cast.

    `zeroed` marks a blocked scale layout with padding bytes, which the kernel never writes.
    """
    specs = []
    if rowwise:
        n_kb = K // BLOCK
        scale = (blocked_size(M, n_kb),) if blocked_scales else (M, n_kb)
        pad = blocked_scales and (M % 128 != 0 or n_kb % 4 != 0)
        specs += [((M, K), PAYLOAD_DTYPE, False), (scale, SCALE_DTYPE, pad)]
    if colwise:
        n_mb = ceil_div(M, BLOCK)
        scale = (blocked_size(K, n_mb),) if blocked_scales else (K, n_mb)
        pad = blocked_scales and (K % 128 != 0 or n_mb % 4 != 0)
        specs += [((K, M), PAYLOAD_DTYPE, False), (scale, SCALE_DTYPE, pad)]
    if square:
        specs += [((M, K), PAYLOAD_DTYPE, False), ((M // BLOCK, K // BLOCK), SCALE_DTYPE, False)]
    return specs


@torch.library.custom_op("gem_lp::mx_cast_2d", mutates_args=())
def _mx_cast_2d_op(
    x: torch.Tensor, rowwise: bool, colwise: bool, square: bool, blocked_scales: bool, rceil: bool,
    block_m: int, block_k: int, num_warps: int, hw_cast: bool,
) -> list[torch.Tensor]:
    M, K = x.shape
    outs = [(torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=x.device)
            for shape, dtype, zeroed in output_specs(M, K, rowwise, colwise, square, blocked_scales)]
    if M == 0 or K == 0:
        return outs
    it = iter(outs)
    row = (next(it), next(it)) if rowwise else (None, None)
    col = (next(it), next(it)) if colwise else (None, None)
    sq = (next(it), next(it)) if square else (None, None)
    # Payloads are written as bytes; the kernel never sees an fp8 pointer.
    ptrs = [t.view(torch.uint8) if t is not None and t.dtype == PAYLOAD_DTYPE else t for t in (*row, *col, *sq)]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(K, block_k),)
    # Largest offset inside one tile: input strides, rowwise rows (x K), colwise columns (x M).
    span = max(block_m * abs(x.stride(0)) + block_k * abs(x.stride(1)), block_m * K, block_k * M)
    _mx_cast_2d_kernel[grid](
        x, x.stride(0), x.stride(1), M, K, *ptrs,
        BLOCK_M=block_m, BLOCK_K=block_k, ROWWISE=rowwise, COLWISE=colwise, SQUARE=square,
        BLOCKED_SCALES=blocked_scales, RCEIL=rceil, HW_CAST=hw_cast, LARGE_OFFSETS=span >= _INT32_SPAN,
        num_warps=num_warps,
    )
    return outs


@_mx_cast_2d_op.register_fake
def _(x, rowwise, colwise, square, blocked_scales, rceil, block_m, block_k, num_warps, hw_cast):
    M, K = x.shape
    return [x.new_empty(shape, dtype=dtype) for shape, dtype, _ in
            output_specs(M, K, rowwise, colwise, square, blocked_scales)]


def _check_tile(block_m: int, block_k: int, num_warps: int) -> None:
    for name, v in (("block_m", block_m), ("block_k", block_k)):
        if v < BLOCK or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {BLOCK}, got {v}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")


def default_config(rowwise: bool, colwise: bool, square: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) used when the caller gives none."""
    if interpreter_enabled():
        return INTERPRETER_CONFIG
    if rowwise and colwise:
        return DEFAULT_CONFIGS["dual"]
    if colwise:
        return DEFAULT_CONFIGS["colwise"]
    if rowwise:
        return DEFAULT_CONFIGS["rowwise"]
    return DEFAULT_CONFIGS["square"]


def mx_cast_2d(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    colwise: bool = False,
    square: bool = False,
    scaling: str = "rceil",
    blocked_scales: bool = False,
    block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    hw_cast: bool | None = None,
) -> list[torch.Tensor]:
    """MXFP8 casts of a 2-D tensor in one pass over it.

    Args:
        x: `[M, K]` float32/bfloat16/float16, any strides, on CUDA (or CPU under TRITON_INTERPRET=1).
            K must be a multiple of 32; M too when `square`.
        rowwise, colwise, square: which casts to write (at least one).
        scaling: `"rceil"` or `"floor"`.
        blocked_scales: write rowwise/colwise scales in the 128x4 blocked layout (flat uint8, padding
            bytes 0) instead of row-major matrices. Square scales are always plain.
        block_m, block_k, num_warps: tile shape (powers of two >= 32) and warps per program;
            `None` takes `default_config`.
        hw_cast: E4M3 rounding by the hardware conversion (`None`: on CUDA outside the interpreter).

    Returns:
        A list, per requested cast in the order rowwise, colwise, square, of (payload, scale):
        rowwise `float8_e4m3fn [M, K]` and uint8 `[M, K/32]` (or blocked);
        colwise `float8_e4m3fn [K, M]` (x^T, contiguous) and uint8 `[K, ceil(M/32)]` (or blocked);
        square `float8_e4m3fn [M, K]` and uint8 `[M/32, K/32]`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    check_scaling(scaling)
    if not (rowwise or colwise or square):
        raise ValueError("at least one of rowwise, colwise, square must be True")
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"x.shape[1] (K) must be a multiple of {BLOCK}, got {K}")
    if square and M % BLOCK:
        raise ValueError(f"square blocks need x.shape[0] (M) to be a multiple of {BLOCK}, got {M}")
    if not x.is_cuda and not interpreter_enabled():
        raise ValueError(f"the Triton MX cast needs a CUDA tensor (got device {x.device}); on a CPU "
                         f"machine set TRITON_INTERPRET=1 before importing gem_lp")
    if hw_cast is None:
        hw_cast = x.is_cuda and not interpreter_enabled()
    cfg = default_config(rowwise, colwise, square)
    block_m = cfg[0] if block_m is None else block_m
    block_k = cfg[1] if block_k is None else block_k
    num_warps = cfg[2] if num_warps is None else num_warps
    _check_tile(block_m, block_k, num_warps)
    # Quantization is not differentiable: the op's outputs must not join the autograd graph.
    return _mx_cast_2d_op(x.detach(), rowwise, colwise, square, blocked_scales, scaling == "rceil",
                          block_m, block_k, num_warps, hw_cast)
