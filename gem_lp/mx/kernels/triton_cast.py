"""The MX cast kernel in Triton: `x [M, K]` (optionally through a prologue: RMSNorm by a weight, or an input
activation) to its MX casts in one pass, the producer of the MX linears' operands and of `rms_norm_quantize`.

Per program `block_m` rows of `x` (`rms_norm_mx`):

1. with the RMSNorm prologue, a sweep over K in chunks: the sum of squares per row (FP32), then
   `rstd = 1 / sqrt(sum / K + eps)` with correctly rounded division and square root (as the reference computes on
   the CPU), once per row;
2. a sweep over K (the chunks come back from L2; with one chunk covering K the tile stays in registers):
   `y = (fp32(x) * rstd) * fp32(w)` in the reference's operation order (or `y = act(x)`, or `y = x`), then from
   the FP32 `y` any of: the rowwise MX cast (1x32 along K, payload `[M, K]`), the colwise MX cast (32x1 along M,
   payload of `y^T`, `[K, M]` with rows padded to a multiple of 32 bytes, see `colwise_payload_buffer`; a last
   partial block takes its max over the real rows), scales plain or in the 128x4 blocked layout (its padding bytes
   written too), the MX-exact dequantized operands for a BF16/FP32 GEMM (`deq(rowwise)`, `deq(colwise)`, both in
   x's `[M, K]` layout), and x's FP32 column sums (the bias gradient of a linear layer, from the pass that casts
   its dY; atomic adds into a zero-filled `[K]` buffer).

Threads hold strips of `thread_rows` consecutive rows x 8 consecutive columns, so the 32-row maxima are mostly
inside a thread and the `y^T` payload leaves as vector stores (the hardware conversion takes two rows of a column
and writes two consecutive bytes of `y^T`). Rows of more than `block_k` elements are swept twice;
`programs_per_sm` bounds the row blocks in flight so that the second sweep finds them in L2; `max_registers` caps
a launch's registers so that more programs fit on an SM; `prefetch` double-buffers the chunk loads; without the
norm, `tile_programs` launches one program per tile instead of one per row block.

The MX steps are `gem_lp.mx.kernels.triton_quantize` / `triton_numerics` device functions, so the bytes equal
`quantize_reference`'s for the same FP32 `y`. The sum of squares is accumulated in the kernel's own order, which can
differ from torch's in the last bit of `rstd`; whenever that FP32 sum is exact (order-free), `rstd` and every byte
equal the reference.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gem_lp.runtime.device import interpreter_enabled, sm_count
from gem_lp.runtime.triton_launch import KernelLaunch
from gem_lp.mx.formats import (BLOCK, COLWISE_ROW_ALIGN, INPUT_DTYPES, PAYLOAD_DTYPE, SCALE_DTYPE, MXTensor, ceil_div,
                               check_scaling, colwise_row_stride)
from gem_lp.mx.layout import blocked_size
from gem_lp.mx.kernels.triton_numerics import abs_bits, exact_f32
from gem_lp.mx.kernels.triton_quantize import (block_payload, block_scale, max_cols_of_blocks, max_rows_of_blocks,
                                  store_colwise_pairs, store_scales, strip_coordinates)
from gem_lp.mx.casts import NormMXOutputs  # noqa: F401  (the kernel's outputs)
from gem_lp.mx.reference import check_input_activation

OPERAND_DTYPES = (torch.bfloat16, torch.float32)


class NormConfig(tuple):
    """Launch configuration `(block_m, block_k, num_warps, thread_rows, row_blocks_in_thread, programs_per_sm,
    max_registers, prefetch, tile_programs)` of `rms_norm_mx`.

    `block_m` rows x `block_k` columns per tile (powers of two >= 32); a program owns `block_m` rows and
    sweeps K in chunks of `block_k` (`block_k >= K`: x is read once and kept in registers).
    `thread_rows` (1..32, a power of two): the strip kernel, each thread holding `thread_rows` consecutive
    rows x 8 columns; `row_blocks_in_thread`: a thread holds whole 32-column blocks of its rows (see
    `triton_quantize.CastConfig`). `programs_per_sm` (strips only): 0 launches one program per row block; n > 0 launches n programs per
    SM that walk the row blocks, which bounds the bytes in flight between the two sweeps (L2 reuse).
    `max_registers`: 0 leaves the register count to the compiler; n > 0 caps it at n per thread (Triton's
    `maxnreg`, 16..255), so that more programs fit on an SM (the compiler spills what does not fit).
    `prefetch` (strips only; matters when `block_k < K`): each sweep over K loads the next chunk, kept in x's
    dtype, before it works on the current one, so that a load is in flight during the work (more registers).
    `tile_programs` (strips without the norm, `weight=None`, only): one program per `block_m x block_k` tile, a
    2-D grid flattened as in `triton_quantize`'s dual cast, instead of one per row block sweeping K: no loop,
    no loop-carried addresses, and the GPU overlaps the tiles of its resident programs.
    The configuration only steers the layout and schedule: every one writes the same bytes.
    """

    def __new__(cls, block_m: int, block_k: int, num_warps: int, thread_rows: int = 8,
                row_blocks_in_thread: bool = False, programs_per_sm: int = 0, max_registers: int = 0,
                prefetch: bool = False, tile_programs: bool = False):
        return super().__new__(cls, (block_m, block_k, num_warps, thread_rows, bool(row_blocks_in_thread),
                                     programs_per_sm, max_registers, bool(prefetch), bool(tile_programs)))

    def __repr__(self) -> str:
        bm, bk, nw, tr, rb, per_sm, max_regs, prefetch, tiles = self
        return (f"{bm}x{bk} w{nw} r{tr}" + (" rowblk" if rb else "")
                + (f" {per_sm}/SM" if per_sm else "") + (f" maxreg{max_regs}" if max_regs else "")
                + (" prefetch" if prefetch else "") + (" tiles" if tiles else ""))


CONFIG_FIELDS = ("block_m", "block_k", "num_warps", "thread_rows", "row_blocks_in_thread", "programs_per_sm",
                 "max_registers", "prefetch", "tile_programs")


# `strip_config` gives the thread-strip launch chosen by sm_90 instruction count (per K, the fewest SASS instructions
# per element among builds without register spills, also with a masked last row block, that an SM holds at least
# twice; `benchmarks/tune_casts.py` prints the builds and times the alternatives). Up to ONE_PASS_MAX_K one tile
# covers K and x is read once; beyond it, 64x128 tiles re-read x chunk by chunk from L2.
ONE_PASS_MAX_K = 512
ONE_PASS_CONFIGS = {  # K rounded up to a power of two -> configuration
    32: NormConfig(64, 32, 1, 8), 64: NormConfig(32, 64, 1, 8), 128: NormConfig(32, 128, 2, 8),
    256: NormConfig(32, 256, 2, 16), 512: NormConfig(32, 512, 4, 16),
}
MULTI_PASS_CONFIG = NormConfig(64, 128, 4, 8)
# The GPU default at K = 1024 and 4096 (RMSNorm, hardware conversion, no dequantized operands), chosen by time: 32x256
# tiles in 4 warps, 8-row strips, registers capped so that 3 programs fit an SM at any M.
MEASURED_CONFIG = NormConfig(32, 256, 4, 8, False, 0, 168)
MEASURED_KS = (1024, 4096)
# Where MEASURED_CONFIG is also the default for M not a multiple of 32 (elsewhere the lighter launch was faster).
MEASURED_UNALIGNED_KS = (4096,)
# M not a multiple of 32 (see `strip_config`), dequantized operands or the integer E4M3 rounding need more
# registers than those tiles leave: 32 rows (64 for K = 32) x at most 64 columns a program, in one warp.
HEAVY_BLOCK_K = 64
# The dual operand cast without the norm (MXLinear's dY): one program per 32x128 tile.
OPERAND_CAST_CONFIG = NormConfig(32, 128, 4, 4, tile_programs=True)
# Under the interpreter the cost is per program and per op: one chunk when it fits.
INTERPRETER_MAX_BLOCK_K = 128
_INT32_SPAN = 2**31


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def load_f32(ptrs, mask):
    """Load as FP32; bf16 is widened by a 16-bit shift of its bits (exact also in the interpreter)."""
    return exact_f32(tl.load(ptrs, mask=mask, other=0.0))


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


# The input activation gives the bytes of torch's `act(x)` (CUDA: `x / (1 + expf(-x))` in FP32 with libdevice's expf
# and an IEEE division). Rounded to FP32 or FP16 it is computed that way. Rounded to BF16 it is computed with the
# hardware's approximate exp2 and division (`ex2.approx.ftz`, `div.full`): about half the instructions an element (the
# MLP's SiLU casts are compute-bound). On sm_90 `x / (1 + exp(-x))` with `tl.exp` (`ex2.approx` of `-x * log2 e`)
# rounds to torch's BF16 on all 65536 BF16 inputs (FP32 results up to 54 ulp apart); the form here gives the same
# FP32 results: the negation moves into the constant exactly, and flushing ex2's subnormal inputs or outputs only
# changes what 1 + ex2 absorbs (GPU test: `test_silu_bf16_equals_torch_on_every_input`). `tl.exp2` rather than
# `tl.exp` because its build of the colwise strip cast does not spill. The interpreter (CPU tests) has numpy's exp
# and division.
_TORCH_CUDA_MATH = tl.constexpr(not interpreter_enabled())
ACT_NONE, ACT_SILU_F32, ACT_SILU_BF16, ACT_SILU_F16 = 0, 1, 2, 3  # the kernels' ACT values
# x is the gradient of SiLU's output at the activation input z (a second tensor): the casts are of torch's
# `silu_backward(x, z)`, rounded to x's dtype
ACT_SILU_GRAD_F32, ACT_SILU_GRAD_BF16, ACT_SILU_GRAD_F16 = 4, 5, 6


@triton.jit
def _round_to_storage(y, STORAGE: tl.constexpr):
    """FP32 `y` rounded to the storage dtype (1 FP32, 2 BF16, 3 FP16); BF16 round-to-nearest-even by integer
    arithmetic in the interpreter, whose cast truncates."""
    if STORAGE == 2:
        if _TORCH_CUDA_MATH:
            y = y.to(tl.bfloat16).to(tl.float32)
        else:
            bits = y.to(tl.int32, bitcast=True)
            r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            y = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, y, r.to(tl.float32, bitcast=True))
    elif STORAGE == 3:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def input_activation(x, ACT: tl.constexpr):
    """The input activation of FP32 `x` (see ACT_*, codes up to 3): x itself, or SiLU rounded to x's storage
    dtype."""
    if ACT == 0:
        return x
    else:
        if not _TORCH_CUDA_MATH:
            y = x / (1.0 + tl.exp(-x))
        elif ACT == 2:  # ACT_SILU_BF16
            y = x / (1.0 + tl.exp2(x * -1.4426950408889634))
        else:
            y = tl.div_rn(x, 1.0 + libdevice.exp(-x))
        return _round_to_storage(y, ACT)


@triton.jit
def _silu_grad(dy, z, STORAGE: tl.constexpr):
    """torch's `silu_backward(dy, z)`: `dy * s * (1 + z * (1 - s))`, `s = 1 / (1 + exp(-z))`, in FP32, rounded to
    the storage dtype."""
    if _TORCH_CUDA_MATH:
        s = tl.div_rn(1.0, 1.0 + libdevice.exp(-z))
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
    return _round_to_storage(dy * s * (1.0 + z * (1.0 - s)), STORAGE)


@triton.jit
def _activated(x, a_ptrs, mask, ACT: tl.constexpr, EVEN: tl.constexpr):
    """What the casts quantize from FP32 `x` (see ACT_*): its input activation, or (ACT >= 4) the gradient at the
    activation input read at `a_ptrs` (rows outside the tile read as 0)."""
    if ACT >= 4:
        if EVEN:
            z = exact_f32(tl.load(a_ptrs))
        else:
            z = load_f32(a_ptrs, mask)
        return _silu_grad(x, z, ACT - 3)
    else:
        return input_activation(x, ACT)


@triton.jit
def scale_offset(r, c, n_cols, BLOCKED: tl.constexpr):
    """Byte offset of scale (r, c) of a matrix with `n_cols` columns: row-major, or 128x4 blocked."""
    if BLOCKED:
        tile = (r // 128) * ((n_cols + 3) // 4) + c // 4
        return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    else:
        return r * n_cols + c


# The 128x4 blocked scale layouts are written whole by the forward kernel, padding bytes (0) included, so that
# the buffers need no zero-fill launch. Rows 128t .. 128t + 127 of x (group t) have one row of rowwise scale
# tiles and one column of colwise scale tiles (their four 32-row blocks). K not a multiple of 128 pads the
# last rowwise tile of every group (columns past K/32) and the colwise tile of every group in the last row of
# tiles (rows past K): the row block holding row 128t zeroes those of group t, inside the main work (the
# branch exists only in builds for such K). M not a multiple of 128 pads the last group's rowwise tiles (rows
# past M) and, with ceil(M/32) not a multiple of 4, its colwise tiles (columns past it): one extra program
# zeroes those (`M_PADDING`), so that the build of the row blocks stays that of an aligned M. A corner byte
# may be zeroed twice; every other byte is written once.


@triton.jit
def _zero_padding_of_tile(ptr, tile, n_rows, n_cols):
    """Zero the padding bytes (row >= n_rows or column >= n_cols) of 128x4 tile `tile` (a scalar tensor) of
    the blocked layout of an `[n_rows, n_cols]` scale matrix: 512 contiguous bytes (see `gem_lp.mx.layout`)."""
    w = tl.arange(0, 512)  # byte (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4 of the tile
    n_col_tiles = (n_cols + 3) // 4
    r = (tile // n_col_tiles) * 128 + ((w % 16) // 4) * 32 + w // 16
    c = (tile % n_col_tiles) * 4 + w % 4
    tl.store(ptr + tile.to(tl.int64) * 512 + w, tl.zeros((512,), tl.uint8), mask=(r >= n_rows) | (c >= n_cols))


@triton.jit
def _zero_k_padding(m0, M, K: tl.constexpr, row_scale_ptr, col_scale_ptr, BLOCK_M: tl.constexpr,
                    ROW_MX: tl.constexpr, COL_MX: tl.constexpr):
    """K % 128 != 0: zero the padding of the scale tiles of the groups that row block m0 owns (see above)."""
    N_KB: tl.constexpr = K // 32  # columns of the rowwise scale matrix
    N_ROW_COL_TILES: tl.constexpr = (N_KB + 3) // 4  # its tiles per row of tiles
    N_COL_ROW_TILES: tl.constexpr = (K + 127) // 128  # rows of tiles of the colwise scale matrix
    n_groups = (M + 127) // 128  # rows of rowwise tiles = columns of colwise tiles
    for j in tl.static_range(max(BLOCK_M // 128, 1)):
        t = m0 // 128 + j
        if (m0 % 128 == 0) & (t < n_groups):
            if ROW_MX:
                _zero_padding_of_tile(row_scale_ptr, t * N_ROW_COL_TILES + N_ROW_COL_TILES - 1, M, N_KB)
            if COL_MX:
                _zero_padding_of_tile(col_scale_ptr, (N_COL_ROW_TILES - 1) * n_groups + t, K, (M + 31) // 32)


@triton.jit
def _zero_m_padding(M, K: tl.constexpr, row_scale_ptr, col_scale_ptr, ROW_MX: tl.constexpr, COL_MX: tl.constexpr):
    """M % 128 != 0: zero the padding of the last group's scale tiles, each of them (see above)."""
    N_KB: tl.constexpr = K // 32
    N_ROW_COL_TILES: tl.constexpr = (N_KB + 3) // 4
    N_COL_ROW_TILES: tl.constexpr = (K + 127) // 128
    n_groups = (M + 127) // 128
    t = n_groups - 1
    if ROW_MX:
        for ct in range(N_ROW_COL_TILES):
            _zero_padding_of_tile(row_scale_ptr, t * N_ROW_COL_TILES + ct, M, N_KB)
    if COL_MX:
        for kt in range(N_COL_ROW_TILES):
            _zero_padding_of_tile(col_scale_ptr, kt * n_groups + t, K, (M + 31) // 32)


# ----------------------------------------------------------------------------- forward kernel: thread strips


@triton.jit
def _sum_rows(v, ROW_BLOCKS_IN_THREAD: tl.constexpr):
    """Sum over the column axes (g, kb, e) of a strip tile, dims kept: one value per row."""
    if ROW_BLOCKS_IN_THREAD:  # axes (c, kb, mb, g, r, e)
        return tl.sum(tl.sum(tl.sum(v, axis=5, keep_dims=True), axis=3, keep_dims=True), axis=1, keep_dims=True)
    else:  # axes (g, c, kb, mb, r, e)
        return tl.sum(tl.sum(tl.sum(v, axis=5, keep_dims=True), axis=0, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _load_strips(x_rows, k0, k, in_bounds, EVEN: tl.constexpr):
    """FP32 of the chunk of x at columns k0 + k (rows outside the tile read as 0)."""
    if EVEN:
        return exact_f32(tl.load(x_rows + k0 + k))
    else:
        return exact_f32(tl.load(x_rows + k0 + k, mask=in_bounds, other=0.0))


# Block maxima of |y| as FP32 maxima that propagate NaN (`max.NaN.f32`, the absolute value folded into the
# instruction as an operand modifier), returned as int32 bits for `block_scale`. The same scale bytes as the
# integer maximum of `abs_bits(y)` that `triton_quantize` takes (|y| orders like its bits, NaN beats Inf and
# gives 255), without a second array of the tile's bits: on sm_90, 5-100 fewer registers a thread (the tile's
# `|y|` is never materialized) and ~0.5 fewer instructions per element. Compiled kernels only: the interpreter
# runs a custom reduction element by element in Python, so there the integer maxima stay;
# the GPU tests check the float maxima against the reference, NaN and Inf in x included.
_FLOAT_BLOCK_MAXIMA = tl.constexpr(not interpreter_enabled())


@triton.jit
def _abs_for_maxima(y):
    """|y| in the form the block maxima take: FP32 (compiled) or its int32 bits (interpreter)."""
    if _FLOAT_BLOCK_MAXIMA:
        return tl.abs(y)
    else:
        return abs_bits(y)


@triton.jit
def _cast_strips(
    y, m, k, m_strip, m_block, k_block, m0, k0, M, K: tl.constexpr, in_bounds,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr, ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr,
    COL_OP: tl.constexpr, BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr,
    EVEN: tl.constexpr, PAIRED_COLWISE: tl.constexpr,
):
    """Write the requested casts of the FP32 chunk `y` (rows m0 + m, columns k0 + k of `[M, K]`)."""
    a = _abs_for_maxima(y)
    mask = None if EVEN else in_bounds
    row_off = m0.to(tl.int64) * K + k0 + m * K + k  # element offsets in an [M, K] output
    if ROW_MX or ROW_OP:
        byte = block_scale(max_rows_of_blocks(a, ROW_BLOCKS_IN_THREAD, _FLOAT_BLOCK_MAXIMA), RCEIL)
        q = block_payload(y, byte, HW_CAST)
        if ROW_MX:
            tl.store(row_data_ptr + row_off, q, mask=mask)
            store_scales(row_scale_ptr, byte, m0 + m, (k0 + k_block) // 32, M, K // 32, BLOCKED_SCALES, EVEN)
        if ROW_OP:
            store_operand(row_op_ptr + row_off, e4m3_value(q, HW_CAST) * scale_value(byte), mask, HW_CAST)
    if COL_MX or COL_OP:
        byte = block_scale(max_cols_of_blocks(a, ROW_BLOCKS_IN_THREAD, _FLOAT_BLOCK_MAXIMA), RCEIL)
        if COL_MX:  # payload of y^T, rows col_stride apart: a thread's rows of a column are consecutive bytes
            if PAIRED_COLWISE:
                # Masked by the padded row length col_stride, not by M: a multiple of 16 (the mask is then
                # constant over a thread's pairs and the stores stay vectors for any M); the pairs past M land
                # in the padding columns, which hold no data.
                store_colwise_pairs(col_data_ptr, col_stride, m0, k0, m_strip, k, y, byte,
                                    (col_stride - m0) // 2, K - k0, EVEN, HW_CAST)
            else:
                q = tl.permute(block_payload(y, byte, HW_CAST), (0, 1, 2, 3, 5, 4))
                out = (col_data_ptr + k0.to(tl.int64) * col_stride + m0
                       + tl.permute(k * col_stride + m, (0, 1, 2, 3, 5, 4)))
                tl.store(out, q, mask=None if EVEN else tl.permute(in_bounds, (0, 1, 2, 3, 5, 4)))
            store_scales(col_scale_ptr, byte, k0 + k, (m0 + m_block) // 32, K, (M + 31) // 32, BLOCKED_SCALES,
                          EVEN)
        if COL_OP:
            q = block_payload(y, byte, HW_CAST)
            store_operand(col_op_ptr + row_off, e4m3_value(q, HW_CAST) * scale_value(byte), mask, HW_CAST)


@triton.jit
def _rstd(sum_sq, K: tl.constexpr, eps):
    """1 / sqrt(sum_sq / K + eps), each step correctly rounded as the reference's FP32 ops on the CPU."""
    if K & (K - 1) == 0:  # dividing by a power of two is the exact multiplication by its inverse
        mean_sq = sum_sq * (1.0 / K)
    else:
        mean_sq = tl.div_rn(sum_sq, tl.full((), K, tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))


@triton.jit
def _rstd_of_rows(sum_sq, rows, rstd_ptr, m0, M, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr):
    """rstd of the program's rows, stored to `rstd_ptr` and returned in the layout of `sum_sq` (one per row of
    `rows`, which holds copies: the lanes and warps along a row share its sum).

    Computed in place the division and square root would run once per copy; instead the sums go through
    rstd's output, one thread per row computes rstd there, and the tile reads it back. Race-free: each
    `tl.debug_barrier()` is `bar.sync 0` (`__syncthreads`), which every thread of the program reaches (the
    conditions around it, the walk over row blocks included, are the same for the whole program) and which
    orders the global memory accesses before it, at CTA scope, before those after it (PTX memory model: a
    barrier arrival synchronizes with the other threads' waits on it). So the sums are stored before any
    thread loads them, every copy of a sum is loaded before its row's rstd overwrites it, and rstd is stored
    before the tile loads it. The loads are plain `ld.global` (the buffer is written in the kernel, so the
    read-only `ld.global.nc` path is not used), copies store equal values, and the next row block of a
    persistent walk uses other addresses. The interpreter runs a program's steps in order.
    """
    own = m0 + tl.arange(0, BLOCK_M)
    if EVEN_M:
        tl.store(rstd_ptr + rows, sum_sq)
        tl.debug_barrier()
        rstd = _rstd(tl.load(rstd_ptr + own), K, eps)
        tl.debug_barrier()  # every sum read before any is overwritten
        tl.store(rstd_ptr + own, rstd)
        tl.debug_barrier()
        return tl.load(rstd_ptr + rows)
    else:
        tl.store(rstd_ptr + rows, sum_sq, mask=rows < M)
        tl.debug_barrier()
        rstd = _rstd(tl.load(rstd_ptr + own, mask=own < M, other=0.0), K, eps)
        tl.debug_barrier()
        tl.store(rstd_ptr + own, rstd, mask=own < M)
        tl.debug_barrier()
        return tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)


@triton.jit
def _norm_cast_strips(
    x, rstd, w_ptr, m, k, m_strip, m_block, k_block, m0, k0, M, K: tl.constexpr, in_bounds,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
    BLOCK_K: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr, NORMALIZE: tl.constexpr, ROW_MX: tl.constexpr,
    COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr, BLOCKED_SCALES: tl.constexpr,
    RCEIL: tl.constexpr, HW_CAST: tl.constexpr, EVEN_M: tl.constexpr, EVEN: tl.constexpr,
    PAIRED_COLWISE: tl.constexpr,
):
    """y = (x * rstd) * w of one chunk (columns k0 + k), or y = x without the norm, and its casts."""
    if NORMALIZE:
        # w loaded in the tile's shape: a [.., 8] load gets its own layout, and Triton would then convert
        # the whole tile to it. The loads repeated over a thread's rows are the same instruction.
        w_ptrs = tl.broadcast_to(w_ptr + k0 + k, x.shape)
        if K % BLOCK_K == 0:
            w = exact_f32(tl.load(w_ptrs))
        else:
            w = exact_f32(tl.load(w_ptrs, mask=tl.broadcast_to(k < K - k0, x.shape), other=0.0))
        y = (x * rstd) * w  # the reference's order
        if not EVEN_M:  # rows past M are 0 for the column maxima, whatever their rstd
            y = tl.where(m < M - m0, y, 0.0)
    else:
        y = x
    _cast_strips(y, m, k, m_strip, m_block, k_block, m0, k0, M, K, in_bounds,
                 row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
                 ROW_BLOCKS_IN_THREAD, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL, HW_CAST, EVEN,
                 PAIRED_COLWISE)


@triton.jit
def _add_column_sums(colsum_ptr, x, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROW_BLOCKS_IN_THREAD: tl.constexpr):
    """colsum[k0 + k] += the sum over the rows of the FP32 strip chunk `x` (rows past M hold 0).

    One float32 atomic add per column and row block (relaxed: only the final sums are read, after the kernel),
    so the order of the additions differs from torch's `sum(0)`: the result agrees with it within FP32 rounding,
    not bit for bit. Triton's lowering hands each column's sum to one thread (a layout conversion through shared
    memory) before the add, so copies of it held by other threads are not added (sm_90 PTX: one predicated
    `atom.add` a thread and chunk).
    """
    if ROW_BLOCKS_IN_THREAD:  # axes (c, kb, mb, g, r, e): rows are c, mb, r
        s = tl.sum(tl.sum(tl.sum(x, axis=4, keep_dims=True), axis=2, keep_dims=True), axis=0, keep_dims=True)
    else:  # axes (g, c, kb, mb, r, e)
        s = tl.sum(tl.sum(tl.sum(x, axis=4, keep_dims=True), axis=3, keep_dims=True), axis=1, keep_dims=True)
    if K % BLOCK_K == 0:
        tl.atomic_add(colsum_ptr + k0 + k, s, sem="relaxed")
    else:
        tl.atomic_add(colsum_ptr + k0 + k, s, mask=k < K - k0, sem="relaxed")


@triton.jit
def _load_chunk(x_rows, k0, k, row_ok, K: tl.constexpr, EVEN: tl.constexpr, MAY_START_AT_K: tl.constexpr):
    """Chunk k0 of x in x's dtype (columns k0 + k); rows outside the tile and columns past K read as 0.
    `MAY_START_AT_K`: k0 may be K (the prefetch after the last chunk), a chunk of zeros without memory access
    (on full tiles by a uniform predicate)."""
    if not EVEN:
        return tl.load(x_rows + k0 + k, mask=row_ok & (k < K - k0), other=0.0)
    elif MAY_START_AT_K:
        return tl.load(x_rows + k0 + k, mask=k0 < K, other=0.0)
    else:
        return tl.load(x_rows + k0 + k)


@triton.jit
def _norm_row_block(
    m0, x_ptr, stride_xm, w_ptr, M, K: tl.constexpr, eps, rstd_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr, colsum_ptr,
    a_ptr, stride_am, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr,
    NORMALIZE: tl.constexpr, ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
    EVEN_M: tl.constexpr, PAIRED_COLWISE: tl.constexpr, COL_SUMS: tl.constexpr, PREFETCH: tl.constexpr,
    ACT: tl.constexpr,
):
    """Rows m0 .. m0 + BLOCK_M - 1: rstd, then every requested output (of the input activation of x, ACT, without
    the norm)."""
    # The tile is `triton_quantize`'s 6-D strip tile (see `tile_axes`): row mb * 32 + c * THREAD_ROWS + r,
    # column kb * 32 + g * 8 + e; r and e stay in each thread's registers.
    NMB: tl.constexpr = BLOCK_M // 32
    NKB: tl.constexpr = BLOCK_K // 32
    EVEN: tl.constexpr = EVEN_M and K % BLOCK_K == 0  # no masks anywhere
    if BLOCKED_SCALES and K % 128 != 0:
        _zero_k_padding(m0, M, K, row_scale_ptr, col_scale_ptr, BLOCK_M, ROW_MX, COL_MX)
    m, k, m_block, k_block, m_strip = strip_coordinates(NMB, NKB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
    rows = m0 + m  # [.., THREAD_ROWS, 1]: one per row, for rstd
    if LARGE_OFFSETS:  # k * M or m * stride inside one tile reaches 2^31
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    x_rows = x_ptr + m0.to(tl.int64) * stride_xm + m * stride_xm
    if ACT >= 4:  # the activation input of a gradient cast
        a_rows = a_ptr + m0.to(tl.int64) * stride_am + m * stride_am
    else:
        a_rows = x_rows  # never read
    row_ok = m < M - m0
    rstd = 0.0
    if BLOCK_K >= K:  # one chunk covers K: x is read once and stays in registers
        in_bounds = row_ok & (k < K)
        x = _activated(_load_strips(x_rows, 0, k, in_bounds, EVEN), a_rows + k, in_bounds, ACT, EVEN)
        if COL_SUMS:
            _add_column_sums(colsum_ptr, x, k, 0, K, BLOCK_K, ROW_BLOCKS_IN_THREAD)
        if NORMALIZE:
            sum_sq = _sum_rows(x * x, ROW_BLOCKS_IN_THREAD)
            rstd = _rstd_of_rows(sum_sq, rows, rstd_ptr, m0, M, K, eps, BLOCK_M, EVEN_M)
        k0 = tl.cast(0, tl.int32)  # a tensor, as in the chunk loop
        _norm_cast_strips(x, rstd, w_ptr, m, k, m_strip, m_block, k_block, m0, k0, M, K, in_bounds,
                          row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
                          BLOCK_K, ROW_BLOCKS_IN_THREAD, NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES,
                          RCEIL, HW_CAST, EVEN_M, EVEN, PAIRED_COLWISE)
    else:
        # PREFETCH: each sweep loads chunk k0 + BLOCK_K (kept in x's dtype) before it works on chunk k0, so that
        # a load is in flight while the chunk before it is reduced or cast; the first chunk of the cast sweep is
        # loaded before rstd is computed.
        if PREFETCH:
            nxt = _load_chunk(x_rows, 0, k, row_ok, K, EVEN, False)
        if NORMALIZE:
            acc = tl.zeros((m + k).shape, tl.float32)
            for k_start in range(0, K, BLOCK_K):
                if PREFETCH:
                    cur = nxt
                    nxt = _load_chunk(x_rows, k_start + BLOCK_K, k, row_ok, K, EVEN, True)
                else:
                    cur = _load_chunk(x_rows, k_start, k, row_ok, K, EVEN, False)
                xs = exact_f32(cur)
                acc += xs * xs
            sum_sq = _sum_rows(acc, ROW_BLOCKS_IN_THREAD)
            if PREFETCH:
                nxt = _load_chunk(x_rows, 0, k, row_ok, K, EVEN, False)
            rstd = _rstd_of_rows(sum_sq, rows, rstd_ptr, m0, M, K, eps, BLOCK_M, EVEN_M)
        for k_start in range(0, K, BLOCK_K):
            k0 = tl.cast(k_start, tl.int32)  # a tensor also in the interpreter (the stores call k0.to)
            chunk_in_bounds = row_ok & (k < K - k0)
            if PREFETCH:
                cur = nxt
                nxt = _load_chunk(x_rows, k0 + BLOCK_K, k, row_ok, K, EVEN, True)
            else:
                cur = _load_chunk(x_rows, k0, k, row_ok, K, EVEN, False)
            xc = _activated(exact_f32(cur), a_rows + k0 + k, chunk_in_bounds, ACT, EVEN)
            if COL_SUMS:
                _add_column_sums(colsum_ptr, xc, k, k0, K, BLOCK_K, ROW_BLOCKS_IN_THREAD)
            _norm_cast_strips(xc, rstd, w_ptr, m, k, m_strip, m_block, k_block, m0, k0, M, K, chunk_in_bounds,
                              row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr,
                              col_op_ptr, BLOCK_K, ROW_BLOCKS_IN_THREAD, NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP,
                              BLOCKED_SCALES, RCEIL, HW_CAST, EVEN_M, EVEN, PAIRED_COLWISE)


@triton.jit
def _cast_tile(
    m0, k0, x_ptr, stride_xm, M, K: tl.constexpr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr, colsum_ptr,
    a_ptr, stride_am, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr,
    ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
    EVEN_M: tl.constexpr, PAIRED_COLWISE: tl.constexpr, COL_SUMS: tl.constexpr, ACT: tl.constexpr,
):
    """Without the norm: the casts of the input activation (ACT) of the one tile at rows m0 + [0, BLOCK_M),
    columns k0 + [0, BLOCK_K)."""
    NMB: tl.constexpr = BLOCK_M // 32
    NKB: tl.constexpr = BLOCK_K // 32
    EVEN: tl.constexpr = EVEN_M and K % BLOCK_K == 0
    if BLOCKED_SCALES and K % 128 != 0:
        if k0 == 0:  # once per row block
            _zero_k_padding(m0, M, K, row_scale_ptr, col_scale_ptr, BLOCK_M, ROW_MX, COL_MX)
    m, k, m_block, k_block, m_strip = strip_coordinates(NMB, NKB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
    if LARGE_OFFSETS:
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    x_rows = x_ptr + m0.to(tl.int64) * stride_xm + m * stride_xm
    if ACT >= 4:  # the activation input of a gradient cast
        a_rows = a_ptr + m0.to(tl.int64) * stride_am + m * stride_am
    else:
        a_rows = x_rows  # never read
    in_bounds = (m < M - m0) & (k < K - k0)
    x = _activated(_load_strips(x_rows, k0, k, in_bounds, EVEN), a_rows + k0 + k, in_bounds, ACT, EVEN)
    if COL_SUMS:
        _add_column_sums(colsum_ptr, x, k, k0, K, BLOCK_K, ROW_BLOCKS_IN_THREAD)
    _cast_strips(x, m, k, m_strip, m_block, k_block, m0, k0, M, K, in_bounds,
                 row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
                 ROW_BLOCKS_IN_THREAD, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL, HW_CAST, EVEN,
                 PAIRED_COLWISE)


@triton.jit
def _rms_norm_mx_strips_kernel(
    x_ptr, stride_xm, w_ptr, M, K: tl.constexpr, eps, rstd_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr, colsum_ptr,
    a_ptr, stride_am, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr,
    NORMALIZE: tl.constexpr, ROW_MX: tl.constexpr, COL_MX: tl.constexpr, ROW_OP: tl.constexpr, COL_OP: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
    EVEN_M: tl.constexpr, PAIRED_COLWISE: tl.constexpr, COL_SUMS: tl.constexpr, PREFETCH: tl.constexpr,
    PERSISTENT: tl.constexpr, TILE_PROGRAMS: tl.constexpr, M_PADDING: tl.constexpr, ACT: tl.constexpr,
):
    # M_PADDING: the last program zeroes the M padding of the blocked scales, the others take the row blocks.
    # PERSISTENT: a fixed number of programs walk the row blocks (program p takes p, p + n_walkers, ...), so
    # that few row blocks are in flight and the second sweep finds its chunks in L2 (one row block of 32 x 4096
    # bf16 is 256 KiB).
    # TILE_PROGRAMS (no norm): program p takes tile (p // n_k_tiles, p % n_k_tiles).
    n_walkers = tl.num_programs(0) - 1 if M_PADDING else tl.num_programs(0)
    if M_PADDING and tl.program_id(0) == n_walkers:
        _zero_m_padding(M, K, row_scale_ptr, col_scale_ptr, ROW_MX, COL_MX)
    elif TILE_PROGRAMS:
        N_K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        pid = tl.program_id(0)
        _cast_tile((pid // N_K_TILES) * BLOCK_M, (pid % N_K_TILES) * BLOCK_K, x_ptr, stride_xm, M, K,
                   row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
                   colsum_ptr, a_ptr, stride_am, BLOCK_M, BLOCK_K, THREAD_ROWS, ROW_BLOCKS_IN_THREAD, ROW_MX, COL_MX,
                   ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL, HW_CAST, LARGE_OFFSETS, EVEN_M, PAIRED_COLWISE, COL_SUMS, ACT)
    elif PERSISTENT:
        m0 = tl.program_id(0) * BLOCK_M
        while m0 < M:
            _norm_row_block(m0, x_ptr, stride_xm, w_ptr, M, K, eps, rstd_ptr,
                            row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr,
                            col_op_ptr, colsum_ptr, a_ptr, stride_am, BLOCK_M, BLOCK_K, THREAD_ROWS,
                            ROW_BLOCKS_IN_THREAD, NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL,
                            HW_CAST, LARGE_OFFSETS, EVEN_M, PAIRED_COLWISE, COL_SUMS, PREFETCH, ACT)
            m0 += n_walkers * BLOCK_M
    else:
        _norm_row_block(tl.program_id(0) * BLOCK_M, x_ptr, stride_xm, w_ptr, M, K, eps, rstd_ptr,
                        row_data_ptr, row_scale_ptr, col_data_ptr, col_stride, col_scale_ptr, row_op_ptr, col_op_ptr,
                        colsum_ptr, a_ptr, stride_am, BLOCK_M, BLOCK_K, THREAD_ROWS, ROW_BLOCKS_IN_THREAD,
                        NORMALIZE, ROW_MX, COL_MX, ROW_OP, COL_OP, BLOCKED_SCALES, RCEIL, HW_CAST, LARGE_OFFSETS,
                        EVEN_M, PAIRED_COLWISE, COL_SUMS, PREFETCH, ACT)


# ----------------------------------------------------------------------------- host side


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def default_config(K: int, aligned_m: bool = True, operands: bool = False, hw_cast: bool = True,
                   normalize: bool = True) -> NormConfig:
    """Launch configuration of the forward kernel when the caller gives none.

    On the GPU: `MEASURED_CONFIG` for the RMSNorm (`normalize`) at the K it was timed at (`MEASURED_KS`), M a
    multiple of 32 (`aligned_m`; any M at `MEASURED_UNALIGNED_KS`), with the hardware conversion and no
    dequantized operands; `OPERAND_CAST_CONFIG` (one program per tile, measured) for the operand cast without the
    norm; otherwise `strip_config`'s choice (the other arguments are its own). Without the norm (a dual cast) the
    measured launch's register cap would spill.
    """
    if (K in MEASURED_KS and (aligned_m or K in MEASURED_UNALIGNED_KS) and normalize and not operands and hw_cast
            and not interpreter_enabled()):
        return MEASURED_CONFIG
    if not normalize and operands and hw_cast and not interpreter_enabled():
        return OPERAND_CAST_CONFIG
    return strip_config(K, aligned_m, operands, hw_cast)


def strip_config(K: int, aligned_m: bool = True, operands: bool = False, hw_cast: bool = True) -> NormConfig:
    """The thread-strip launch for rows of K elements with the fewest sm_90 instructions per element.

    `aligned_m`: M is a multiple of 32 (whole row blocks); for other M the light 1-warp launch, as fast there as
    the aligned launch is at aligned M. With the padded colwise rows (`colwise_payload_buffer`) the unaligned
    builds keep their vector stores, and at K = 4096 the tuned launch is faster there (`MEASURED_UNALIGNED_KS`).
    `operands`: dequantized operands are written; `hw_cast=False`: the integer E4M3 rounding.
    """
    if interpreter_enabled():
        return NormConfig(32, min(_pow2_at_least(K, BLOCK), INTERPRETER_MAX_BLOCK_K), 1, 8)
    if operands or not hw_cast or not aligned_m:
        block_k = min(_pow2_at_least(K, BLOCK), HEAVY_BLOCK_K)
        return NormConfig(64 if block_k == BLOCK else 32, block_k, 1, 8)
    if K <= ONE_PASS_MAX_K:
        return ONE_PASS_CONFIGS[_pow2_at_least(K, BLOCK)]
    return MULTI_PASS_CONFIG



def _forward_args(x, x_stride: int, weight, M: int, K: int, eps: float, rstd, row, col, col_stride: int, row_op,
                  col_op, column_sums, act_input, act_input_stride: int) -> tuple:
    """The forward kernels' positional arguments (positions of M and the operands: _M_ARG, _ROW_OP_ARG,
    _COL_OP_ARG). Payloads are written as bytes: the kernel never sees an fp8 pointer. `act_input` None (x in
    its place: never read) or the activation input of a gradient cast."""
    row_data, row_scale = (None, None) if row is None else (row[0].view(torch.uint8), row[1])
    col_data, col_scale = (None, None) if col is None else (col[0].view(torch.uint8), col[1])
    if act_input is None:
        act_input, act_input_stride = x, x_stride
    return (x, x_stride, weight, M, K, eps, rstd, row_data, row_scale, col_data, col_stride, col_scale, row_op,
            col_op, column_sums, act_input, act_input_stride)


def forward_launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, rstd: torch.Tensor | None,
                   row: tuple[torch.Tensor, torch.Tensor] | None, col: tuple[torch.Tensor, torch.Tensor] | None,
                   row_op: torch.Tensor | None, col_op: torch.Tensor | None, *, blocked_scales: bool, rceil: bool,
                   hw_cast: bool, config: NormConfig, column_sums: torch.Tensor | None = None,
                   act: int = ACT_NONE, act_input: torch.Tensor | None = None):
    """(kernel, grid, args, kwargs) of the forward launch writing the given outputs from `x [M, K]` (M > 0).

    `row` / `col`: (payload, scale) of the rowwise / colwise cast or None; `rstd [M]` float32 when `weight`
    is given; `column_sums`: float32 `[K]` of zeros, to which the kernel adds `x`'s column sums (weight None).
    The colwise payload `[K, M]` has a contiguous last dim and a row stride that is a multiple of 16 (at least
    M): `colwise_payload_buffer`'s view; the kernel may write the padding columns past M (they hold no data).
    Scale buffers in the blocked layout need no zero-fill: the kernel writes their padding bytes.
    `act`: the input activation (ACT_*; weight None): the outputs are those of `act(x)`; for the gradient codes
    (ACT_SILU_GRAD_*) those of the activation's backward at `act_input` (`[M, K]`, contiguous last dim).
    Also builds the launch for `triton_quantize.compile_for_target` (tensors may be on the CPU or meta).
    """
    M, K = x.shape
    (block_m, block_k, num_warps, thread_rows, row_blocks_in_thread, programs_per_sm, max_registers, prefetch,
     tile_programs) = config
    if tile_programs and (weight is not None or programs_per_sm):
        raise ValueError("tile_programs needs weight=None and programs_per_sm=0, got weight "
                         f"{'given' if weight is not None else 'None'} and config {config!r}")
    col_stride = colwise_row_stride(M) if col is None else _checked_colwise_stride(col[0], K, M)
    a_stride = 0 if act_input is None else act_input.stride(0)
    span = max(block_m * max(x.stride(0), a_stride, K), block_k * col_stride)  # largest offset inside one tile
    args = _forward_args(x, x.stride(0), weight, M, K, float(eps), rstd, row, col, col_stride, row_op, col_op,
                         column_sums, act_input, a_stride)
    kwargs = dict(BLOCK_M=block_m, BLOCK_K=block_k, NORMALIZE=weight is not None, ROW_MX=row is not None,
                  COL_MX=col is not None, ROW_OP=row_op is not None, COL_OP=col_op is not None,
                  BLOCKED_SCALES=blocked_scales, RCEIL=rceil, HW_CAST=hw_cast, LARGE_OFFSETS=span >= _INT32_SPAN,
                  COL_SUMS=column_sums is not None, ACT=act, num_warps=num_warps)
    if max_registers:
        kwargs.update(maxnreg=max_registers)
    # the blocked scales' padding past M, written by one more program (see `_zero_m_padding`)
    m_padding = blocked_scales and ((row is not None and M % 128 != 0)
                                    or (col is not None and ceil_div(M, BLOCK) % 4 != 0))
    kwargs.update(M_PADDING=m_padding)
    n_blocks = n_programs = ceil_div(M, block_m)  # (triton.cdiv costs microseconds on the host)
    kernel = _rms_norm_mx_strips_kernel
    if programs_per_sm:
        n_programs = min(n_blocks, programs_per_sm * sm_count(x.device, off_gpu=2))
    elif tile_programs:
        n_programs = n_blocks * ceil_div(K, block_k)
    kwargs.update(THREAD_ROWS=thread_rows, ROW_BLOCKS_IN_THREAD=bool(row_blocks_in_thread),
                  EVEN_M=M % block_m == 0, PAIRED_COLWISE=col is not None and thread_rows > 1,
                  PREFETCH=bool(prefetch) and block_k < K, PERSISTENT=programs_per_sm > 0,
                  TILE_PROGRAMS=bool(tile_programs))
    return kernel, (n_programs + m_padding,), args, kwargs


# Token counts that reach every build an M of the same class (a multiple of 32 or not, as `default_config`
# chooses launches) can select (`_compile_token_count_variants`): whole row blocks or not (EVEN_M, block_m 64 or
# 128), divisible by 16 or not (Triton's integer specialization), blocked-scale padding past M or not
# (M_PADDING). M's parity selects none: the colwise payload's padded rows take pairs for any M.
_VARIANT_TOKEN_COUNTS = ((4112, 4098, 4080, 4082, 4097, 4065), (4096, 4128, 4160))
_M_ARG, _ROW_OP_ARG, _COL_OP_ARG = 3, 12, 13  # in `forward_launch`'s args
_VARIANTS_COMPILED: set = set()
_CLASS_REPRESENTATIVE = {True: 4096, False: 4097}  # a token count of each class (M % 32 == 0 or not)


def _compile_token_count_variants(kernel, args, kwargs, config: NormConfig) -> bool:
    """Compile, at a launch configuration's first use, the builds that other M of the same class select; True when
    this call did (the first use).

    The build depends on M through Triton's integer specialization (M % 16) and through EVEN_M and M_PADDING
    (the colwise payload's row stride is a multiple of 16 for every M, so its specialization never changes). In
    training M changes every batch, so without this a new build compiles in the middle of a run whenever a batch
    first falls in another class (measured: 4-9 compiles of ~0.8 s at steps 2, 4, 9 and 12 of a 30-step run).
    Costs a few more compiles at the first step instead.
    """
    if kernel is not _rms_norm_mx_strips_kernel:
        return False
    aligned = args[_M_ARG] % 32 == 0
    # what else picks the build: the flags and the tensors' dtypes (a tuple cheap to build: this runs per call)
    x, stride, weight, row_op, col_op = args[0], args[1], args[2], args[_ROW_OP_ARG], args[_COL_OP_ARG]
    key = (aligned, x.shape[1], config, stride, args[-1], x.dtype, weight is None or weight.dtype,
           row_op is None or row_op.dtype, col_op is None or col_op.dtype, kwargs["NORMALIZE"], kwargs["ROW_MX"],
           kwargs["COL_MX"], kwargs["ROW_OP"], kwargs["COL_OP"], kwargs["COL_SUMS"], kwargs["BLOCKED_SCALES"],
           kwargs["RCEIL"], kwargs["HW_CAST"], kwargs["LARGE_OFFSETS"], kwargs["ACT"])
    if key in _VARIANTS_COMPILED:
        return False
    _VARIANTS_COMPILED.add(key)
    block_m = config[0]
    blocked, row_mx, col_mx = kwargs["BLOCKED_SCALES"], kwargs["ROW_MX"], kwargs["COL_MX"]
    seen = set()
    for m in _VARIANT_TOKEN_COUNTS[aligned]:
        flags = (m % 16 == 0, m % block_m == 0,
                 blocked and ((row_mx and m % 128 != 0) or (col_mx and ceil_div(m, BLOCK) % 4 != 0)))
        if flags in seen:
            continue
        seen.add(flags)
        kernel.warmup(*args[:_M_ARG], m, *args[_M_ARG + 1:], grid=(1,),
                      **dict(kwargs, EVEN_M=flags[1], M_PADDING=flags[2]))
    return True


def _check_2d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.stride(1) != 1 and x.shape[1] > 1:
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


def _check_config(config: NormConfig) -> None:
    block_m, block_k, num_warps, thread_rows, _, programs_per_sm, max_registers, prefetch, tile_programs = config
    if thread_rows < 1 or thread_rows > BLOCK or thread_rows & (thread_rows - 1):
        raise ValueError(f"thread_rows must be a power of two in 1..{BLOCK}, got {thread_rows}")
    if programs_per_sm < 0:
        raise ValueError(f"programs_per_sm must be >= 0, got {programs_per_sm}")
    if tile_programs and programs_per_sm:
        raise ValueError(f"tile_programs needs programs_per_sm=0, got programs_per_sm={programs_per_sm}")
    for name, v in (("block_m", block_m), ("block_k", block_k)):
        if v < BLOCK or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {BLOCK}, got {v}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")
    if max_registers and not 16 <= max_registers <= 255:
        raise ValueError(f"max_registers must be 0 (no cap) or in 16..255, got {max_registers}")


def _new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized output buffer: the kernel writes every byte of it (padding included)."""
    return torch.empty(shape, dtype=dtype, device=device)


# The colwise payload `y^T [K, M]`: see `formats.colwise_row_stride`. Triton specializes an integer argument on
# divisibility by 16, so the kernel sees the stride aligned and stores each thread's run of consecutive bytes of a
# column (THREAD_ROWS of them, or their 16-bit pairs) as one vector; with rows M apart, an M that is not a multiple of
# 16 (most token counts of a jagged batch) turned them into single-byte stores. The kernel may write zeros into the
# padding columns or leave them unwritten. For M a multiple of COLWISE_ROW_PAD the view is the whole, contiguous
# buffer.


def colwise_payload_buffer(K: int, M: int, device: torch.device) -> torch.Tensor:
    """Uninitialized float8_e4m3fn `[K, M]` view (row stride `colwise_row_stride(M)`) for the colwise payload."""
    stride = colwise_row_stride(M)
    # the whole [K, stride] storage (padding of the last row included: the kernel may write it); as_strided is
    # a free view, where indexing would add a slice op to every call
    return _new_buffer((K * stride,), PAYLOAD_DTYPE, device).as_strided((K, M), (stride, 1))


def _checked_colwise_stride(data: torch.Tensor, K: int, M: int) -> int:
    """The row stride of a colwise payload `data [K, M]`, checked: last dim contiguous, stride a multiple of 16."""
    stride = data.stride(0)
    if (data.shape != (K, M) or (M > 1 and data.stride(1) != 1) or stride % COLWISE_ROW_ALIGN
            or stride < M or stride < COLWISE_ROW_ALIGN):
        raise ValueError(f"the colwise payload must be [K={K}, M={M}] with a contiguous last dim and a row stride "
                         f"that is a multiple of {COLWISE_ROW_ALIGN} and >= M (colwise_payload_buffer), got shape "
                         f"{tuple(data.shape)} strides {data.stride()}")
    return stride


_NO_CONFIG = (None,) * len(CONFIG_FIELDS)


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
    thread_rows: int | None = None,
    row_blocks_in_thread: bool | None = None,
    programs_per_sm: int | None = None,
    max_registers: int | None = None,
    prefetch: bool | None = None,
    tile_programs: bool | None = None,
    hw_cast: bool | None = None,
    column_sums: bool = False,
    operand_rows: int | None = None,
    activation: str | None = None,
    activation_input: torch.Tensor | None = None,
    row_operand_out: torch.Tensor | None = None,
) -> NormMXOutputs:
    """RMSNorm of `x` (or `x` itself when `weight` is None) in MXFP8, from one kernel launch (no other launch:
    every output is allocated uninitialized and written whole by the kernel; `column_sums` adds a zero fill).

    Args:
        x: `[M, K]` float32/bfloat16/float16 with a contiguous last dim; K a multiple of 32, M >= 0.
        weight: `[K]` RMSNorm weight (any float dtype), or None for no norm (`y = x`).
        eps: added to the mean of squares (as FP32).
        scaling: `"rceil"` or `"floor"`.
        rowwise, colwise: write the MX casts (payload + scales) of `y` along K / of `y^T` along M (the colwise
            payload is a `[K, M]` view with rows padded to a multiple of 16 bytes: see `NormMXOutputs`).
        row_operand, col_operand: write `deq(rowwise)` / `deq(colwise)` as `[M, K]` tensors of
            `operand_dtype` (bfloat16 or float32): exact MX values a BF16/FP32 GEMM consumes (bfloat16
            rounds only values below 2^-126 that need more than its subnormal precision).
        blocked_scales: scales in the 128x4 blocked layout (padding bytes 0) instead of row-major.
        block_m, block_k, num_warps, thread_rows, row_blocks_in_thread, programs_per_sm, max_registers,
            prefetch, tile_programs (weight None only): launch configuration (see `NormConfig`); each None takes the
            value of `default_config` for K, M's parity, the operands, `hw_cast` and the norm. The bytes written do
            not depend on it.
        hw_cast: hardware E4M3/BF16 conversions (default: on CUDA outside the interpreter).
        column_sums: also return `x.float().sum(0)` as float32 `[K]` (`weight` must be None: the bias
            gradient of a linear layer from the pass that casts its dY). Each row block's partial sums are
            added atomically into a zero-filled buffer, so the summation order differs from torch's (and
            between runs): equal to it within FP32 rounding, not bit for bit.
        operand_rows: rows of `row_operand` / `col_operand` (>= M; default M). Rows M and beyond are zeros:
            a GEMM then runs at this padded M (cuBLAS plans once per shape; see `triton_gemm.gemm_rows`).
        activation: None, or `"silu"` (weight None, no column sums): the outputs are those of `y = silu(x)` as
            torch computes it in x's dtype (FP32 math, rounded to x's dtype), made on the fly: `y` is never stored.
        activation_input: with `activation`, None or the activation's input z `[M, K]` (x's dtype and device,
            contiguous last dim): x is then the gradient of `activation(z)` and the outputs (column sums allowed)
            are those of z's gradient as torch's backward computes it (`silu_backward(x, z)`, FP32 math rounded to
            x's dtype), made on the fly: that gradient is never stored.
        row_operand_out: with `row_operand`, None or the `[operand_rows, K]` contiguous `operand_dtype` tensor to
            write the row operand into (rows M and beyond are zeroed). It may be the storage x is the first M rows
            of (x contiguous, of that dtype): every tile of x is read before its operand is written over it, and no
            other output is computed from x afterwards, so x's memory serves again.
    """
    given = (block_m, block_k, num_warps, thread_rows, row_blocks_in_thread, programs_per_sm, max_registers,
             prefetch, tile_programs)
    key = None
    if given == _NO_CONFIG and hw_cast is None and isinstance(x, torch.Tensor):
        # every argument that the checks and the launch depend on (a hit has passed the checks before)
        try:
            key = (x.shape, x.stride(), x.dtype, x.device, weight is None or (
                weight.shape, weight.stride(), weight.dtype, weight.device), eps, scaling, rowwise, colwise,
                row_operand, col_operand, operand_dtype, blocked_scales, column_sums, operand_rows, activation,
                activation_input is None or (activation_input.shape, activation_input.stride(),
                                             activation_input.dtype, activation_input.device),
                row_operand_out is None or (row_operand_out.shape, row_operand_out.stride(), row_operand_out.dtype,
                                            row_operand_out.device), interpreter_enabled())
            plan = _NORM_PLANS.get(key)
        except (TypeError, AttributeError):  # an argument of the wrong kind: the checks below name it
            key = plan = None
        if plan is not None:
            return _run_plan(plan, x, weight, activation_input, row_operand_out)

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
    if column_sums and weight is not None:
        raise ValueError("column_sums=True needs weight=None (the sums are of x, for a dual cast without the norm)")
    act = _activation_code(activation, x.dtype, activation_input is not None)
    if activation_input is not None:
        if activation is None:
            raise ValueError("activation_input needs an activation (whose gradient is cast)")
        if not isinstance(activation_input, torch.Tensor) or activation_input.shape != x.shape or \
                activation_input.dtype != x.dtype or activation_input.device != x.device or \
                (activation_input.stride(1) != 1 and K > 1):
            raise ValueError(f"activation_input must be [M={M}, K={K}] {x.dtype} on {x.device} with a contiguous "
                             f"last dim, got {getattr(activation_input, 'dtype', type(activation_input).__name__)} "
                             f"{tuple(getattr(activation_input, 'shape', ()))}")
    if act != ACT_NONE and (weight is not None or (column_sums and activation_input is None)):
        raise ValueError(f"activation={activation!r} needs weight=None and, without activation_input, "
                         "column_sums=False (an input activation is applied to x before the casts, without the norm)")
    if operand_rows is None:
        operand_rows = M
    elif not isinstance(operand_rows, int) or operand_rows < M:
        raise ValueError(f"operand_rows must be an int >= M={M}, got {operand_rows!r}")
    if row_operand_out is not None and (
            not row_operand or not isinstance(row_operand_out, torch.Tensor)
            or row_operand_out.shape != (operand_rows, K) or row_operand_out.dtype != operand_dtype
            or row_operand_out.device != x.device or not row_operand_out.is_contiguous()):
        raise ValueError(f"row_operand_out needs row_operand=True and must be a contiguous [{operand_rows}, {K}] "
                         f"{operand_dtype} tensor on {x.device}, got "
                         f"{getattr(row_operand_out, 'dtype', type(row_operand_out).__name__)} "
                         f"{tuple(getattr(row_operand_out, 'shape', ()))}")
    if hw_cast is None:
        hw_cast = x.is_cuda and not interpreter_enabled()
    config = default_config(K, M % 32 == 0, row_operand or col_operand, hw_cast, weight is not None)
    if given != _NO_CONFIG:  # the defaults are valid; what the caller gives is checked
        config = NormConfig(*(d if v is None else v for v, d in zip(given, config)))
        _check_config(config)
        if config[8] and weight is not None:
            raise ValueError("tile_programs=True needs weight=None (a row's norm needs the whole row in one program)")

    n_kb, n_mb = K // BLOCK, ceil_div(M, BLOCK)
    plan = _NormPlan(
        M=M, K=K, x_stride=x.stride(0), a_stride=None if activation_input is None else activation_input.stride(0),
        eps=float(eps), normalize=weight is not None,
        row_scale=None if not rowwise else (blocked_size(M, n_kb),) if blocked_scales else (M, n_kb),
        col_scale=None if not colwise else (blocked_size(K, n_mb),) if blocked_scales else (K, n_mb),
        col_stride=colwise_row_stride(M), row_op=row_operand, col_op=col_operand, operand_rows=operand_rows,
        operand_dtype=operand_dtype,
        column_sums=column_sums, scaling=scaling, layout="blocked" if blocked_scales else "plain",
        orig_dtype=x.dtype if weight is None else torch.float32,  # the normalized y is FP32, as the reference's
        on_gpu=x.is_cuda and not interpreter_enabled(), launch=None)
    bufs = _allocate(plan, x.device, row_operand_out)
    if M > 0:
        kernel, grid, args, kwargs = forward_launch(
            x, weight, eps, bufs[2], bufs[0], bufs[1], bufs[3], bufs[4], blocked_scales=blocked_scales,
            rceil=scaling == "rceil", hw_cast=hw_cast, config=config, column_sums=bufs[5], act=act,
            act_input=activation_input)
        if not interpreter_enabled() and _compile_token_count_variants(kernel, args, kwargs, config) \
                and given == _NO_CONFIG:
            # the other class of M (a multiple of 32 or not) launches with its own default config: build it now
            # too, or the first batch of that class builds in the middle of training
            other = default_config(K, M % 32 != 0, row_operand or col_operand, hw_cast, weight is not None)
            o_kernel, _, o_args, o_kwargs = forward_launch(
                x, weight, eps, bufs[2], bufs[0], bufs[1], bufs[3], bufs[4], blocked_scales=blocked_scales,
                rceil=scaling == "rceil", hw_cast=hw_cast, config=other, column_sums=bufs[5], act=act,
                act_input=activation_input)
            o_args = (*o_args[:_M_ARG], _CLASS_REPRESENTATIVE[M % 32 != 0], *o_args[_M_ARG + 1:])
            _compile_token_count_variants(o_kernel, o_args, o_kwargs, other)
        plan = plan._replace(launch=KernelLaunch(kernel, grid, len(args), kwargs))
        plan.launch(args, plan.on_gpu)
    if key is not None:
        if len(_NORM_PLANS) >= _MAX_NORM_PLANS:  # token counts change every batch: keep the recent ones
            _NORM_PLANS.clear()
        _NORM_PLANS[key] = plan
    return _outputs(plan, bufs)


# The kernels' ACT for each input activation (`reference.INPUT_ACTIVATIONS`) of x in each dtype (the activation
# rounded to x's dtype, as torch's), and for its gradient (x the gradient of the activation's output).
_ACT_CODES = {"silu": {torch.float32: ACT_SILU_F32, torch.bfloat16: ACT_SILU_BF16, torch.float16: ACT_SILU_F16}}
_ACT_GRAD_CODES = {"silu": {torch.float32: ACT_SILU_GRAD_F32, torch.bfloat16: ACT_SILU_GRAD_BF16,
                            torch.float16: ACT_SILU_GRAD_F16}}


def _activation_code(activation: str | None, dtype: torch.dtype, gradient: bool = False) -> int:
    check_input_activation(activation, "activation")
    if activation is None:
        return ACT_NONE
    return (_ACT_GRAD_CODES if gradient else _ACT_CODES)[activation][dtype]


class _NormPlan(NamedTuple):
    """What a `rms_norm_mx` call with given shapes, strides, dtypes and options allocates and launches:
    everything but the tensors (`launch` None when M = 0). Scale shapes None when not requested."""

    M: int
    K: int
    x_stride: int
    a_stride: int | None  # the activation input's row stride (None: no activation input)
    eps: float
    normalize: bool
    row_scale: tuple | None
    col_scale: tuple | None
    col_stride: int
    row_op: bool
    col_op: bool
    operand_rows: int
    operand_dtype: torch.dtype
    column_sums: bool
    scaling: str
    layout: str
    orig_dtype: torch.dtype
    on_gpu: bool
    launch: KernelLaunch | None


# Plans of recent `rms_norm_mx` calls with the default launch (`_NormPlan`): a call whose shapes, strides, dtypes
# and options were met before skips the checks, the choice of launch and Triton's JIT (`KernelLaunch`). A
# training step calls it with one token count from every layer, and a small layer's time is mostly the call's
# host time.
_NORM_PLANS: dict = {}
_MAX_NORM_PLANS = 256


def _allocate(plan: _NormPlan, dev: torch.device, row_op_out: torch.Tensor | None = None) -> tuple:
    """(row, col, rstd, row_op, col_op, column_sums) buffers of a plan: (payload, scale) pairs for the casts;
    uninitialized (the kernel writes every byte) except the column sums, which it adds to. `row_op_out`: the
    caller's row operand buffer (its rows past M zeroed here)."""
    M, K = plan.M, plan.K
    row = None if plan.row_scale is None else (_new_buffer((M, K), PAYLOAD_DTYPE, dev),
                                                _new_buffer(plan.row_scale, SCALE_DTYPE, dev))
    col = None if plan.col_scale is None else (colwise_payload_buffer(K, M, dev),
                                                _new_buffer(plan.col_scale, SCALE_DTYPE, dev))
    rstd = _new_buffer((M,), torch.float32, dev) if plan.normalize else None
    row_op = _operand_buffer(M, plan.operand_rows, K, plan.operand_dtype, dev, row_op_out) if plan.row_op else None
    col_op = _operand_buffer(M, plan.operand_rows, K, plan.operand_dtype, dev) if plan.col_op else None
    sums = torch.zeros(K, dtype=torch.float32, device=dev) if plan.column_sums else None
    return row, col, rstd, row_op, col_op, sums


def _operand_buffer(M: int, rows: int, K: int, dtype: torch.dtype, dev: torch.device,
                    buf: torch.Tensor | None = None) -> torch.Tensor:
    """A `[rows, K]` operand buffer (new, or the caller's `buf`) whose rows M.. are zeros (the kernel writes the first
    M rows)."""
    if buf is None:
        buf = _new_buffer((rows, K), dtype, dev)
    if rows > M:
        buf[M:].zero_()
    return buf


def _run_plan(plan: _NormPlan, x: torch.Tensor, weight: torch.Tensor | None, act_input: torch.Tensor | None,
              row_op_out: torch.Tensor | None) -> NormMXOutputs:
    bufs = _allocate(plan, x.device, row_op_out)
    if plan.launch is not None:
        row, col, rstd, row_op, col_op, sums = bufs
        plan.launch(_forward_args(x, plan.x_stride, weight, plan.M, plan.K, plan.eps, rstd, row, col,
                                  plan.col_stride, row_op, col_op, sums, act_input, plan.a_stride), plan.on_gpu)
    return _outputs(plan, bufs)


def _outputs(plan: _NormPlan, bufs: tuple) -> NormMXOutputs:
    row, col, rstd, row_op, col_op, sums = bufs
    return NormMXOutputs(
        rowwise=None if row is None else MXTensor(row[0], row[1], "1d", 1, plan.scaling, plan.orig_dtype,
                                                  plan.layout),
        colwise=None if col is None else MXTensor(col[0], col[1], "1d", 1, plan.scaling, plan.orig_dtype,
                                                  plan.layout),
        rstd=rstd, row_operand=row_op, col_operand=col_op, column_sums=sums,
    )
