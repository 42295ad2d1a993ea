"""Triton MXFP8 cast of a 2-D tensor: rowwise (1x32), colwise (32x1, stored transposed) and square (32x32).

One kernel reads `x [M, K]` once, tile by tile, and writes any combination of:

* rowwise: payload `[M, K]` and scales of the `[M, K/32]` matrix (blocks of 32 along K);
* colwise: payload of `x^T`, `[K, M]` contiguous, and scales of the `[K, ceil(M/32)]` matrix (blocks of
  32 along M; a last partial block takes its max over the real rows only, exactly
  `quantize_reference(x.t(), axis=1, allow_partial=True)`);
* square: payload `[M, K]` and scales `[M/32, K/32]`, one per 32x32 tile (M, K multiples of 32).

Rowwise and colwise scales are plain or written straight into the 128x4 blocked layout of `layout.py`
(padding bytes are 0); square scales are always plain. The bytes equal `reference.py`'s on the GPU and
under `TRITON_INTERPRET=1`.

Where the work goes. The cast is memory-bound only if it spends few instructions per element, so each
thread owns a strip of `thread_rows` consecutive rows x 8 consecutive columns of the tile (16 input
bytes per row, one vector load): the 32x1 block max is then mostly a max inside the thread, the
transposed payload leaves as `thread_rows` consecutive bytes of x^T per column (a vector store, no
shared-memory transpose), and each scale byte is computed by few threads. The tile is held as a 6-D
tensor with axes (8-column group of a 32-column block, strip of a 32-row block, column block, row
block, row in strip, column in group); Triton gives lanes and warps to the leading axes in order and
leaves the trailing ones in registers, which is what places the strips (see `tile_axes`). On sm_90
this takes about 7 instructions per element for one cast and 12 for rowwise + colwise (the 4-D tile
of 32x32 blocks it replaces took 14-23 and 43).

With the hardware E4M3 conversion (`HW_CAST`) a payload costs one multiply and half a conversion: the
conversion saturates at +-448 itself, and a NaN/Inf block multiplies by a NaN scale so that every one of
its payloads converts to NaN (0x7F). The integer rounding of `triton_numerics` (interpreter, or
`hw_cast=False`) keeps the explicit clamp and NaN select.

`mx_cast_2d` is registered as the custom op `gem_lp::mx_cast_2d` (with a fake implementation), so
`torch.compile(fullgraph=True)` traces callers without graph breaks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_lp.runtime.device import interpreter_enabled
from gem_lp.mx.formats import BLOCK, INPUT_DTYPES, PAYLOAD_DTYPE, SCALE_DTYPE, ceil_div, check_scaling
from gem_lp.mx.layout import blocked_size
from gem_lp.mx.kernels.triton_numerics import abs_bits, encode, exact_f32


class CastConfig(tuple):
    """Launch configuration `(block_m, block_k, num_warps, thread_rows, row_blocks_in_thread)`.

    `thread_rows` (1..32, a power of two): consecutive rows of a 32-row block held by one thread.
    `row_blocks_in_thread`: a thread holds whole 32-column row blocks (4 vector loads per row) instead of
    one 8-column group; helps the rowwise-only cast, hurts when rows must also be reduced.
    Both only steer the layout: every configuration writes the same bytes.
    """

    def __new__(cls, block_m: int, block_k: int, num_warps: int, thread_rows: int = 1,
                row_blocks_in_thread: bool = False):
        return super().__new__(cls, (block_m, block_k, num_warps, thread_rows, bool(row_blocks_in_thread)))

    def __repr__(self) -> str:
        bm, bk, nw, tr, rb = self
        return f"{bm}x{bk} w{nw} r{tr}" + (" rowblk" if rb else "")


# Per set of outputs: the fastest of the tuning space `benchmarks/cast_candidates.py` holds (all spill-free on sm_90;
# `python -m benchmarks.bench_quantize` times them).
DEFAULT_CONFIGS = {
    "rowwise": CastConfig(64, 128, 4, 8),
    "colwise": CastConfig(256, 64, 4, 16),
    "dual": CastConfig(64, 128, 4, 8),
    "square": CastConfig(64, 128, 4, 8),
    # colwise with another cast, other than dual with the hardware cast: thread_rows 16 would spill
    "dual_heavy": CastConfig(128, 64, 4, 8),
}
# Under the interpreter the cost is per program and per op, not per byte: larger tiles run faster.
INTERPRETER_CONFIG = CastConfig(64, 64, 1, 4)
# Offsets inside a tile at or above this need int64 arithmetic.
_INT32_SPAN = 2**31


# ----------------------------------------------------------------------------- shared device functions


@triton.jit
def block_scale(amax_bits, RCEIL: tl.constexpr):
    """E8M0 byte (int32) of blocks from their amax bits (int32 >= 0), the rules of `reference.scale_bytes`.

    Fewer instructions than `triton_numerics.scale_byte`, same bytes: rceil rounds the exponent of
    d = amax * fp32(1/448) up by adding the mantissa mask (d <= 2^-127 gives 0; Inf gives 255, NaN's
    carry out of bit 31 is clamped to 255); floor is exponent - 8 (finite exponents never reach 254).
    """
    if RCEIL:
        d = (amax_bits.to(tl.float32, bitcast=True) * 0.0022321429569274187).to(tl.uint32, bitcast=True)
        byte = tl.where(d > 0x400000, tl.minimum((d + 0x7FFFFF) >> 23, 255), 0).to(tl.int32)
    else:
        exp = amax_bits >> 23
        byte = tl.where(exp == 255, 255, tl.maximum(exp - 8, 0))
    return byte


@triton.jit
def block_payload(x, byte, HW_CAST: tl.constexpr):
    """E4M3 payload bytes (uint8) of FP32 `x` under scale bytes `byte` (broadcastable, from `block_scale`).

    A byte of 0..253 scales by the normal 2^(127 - byte) (254 never comes out of `block_scale`); 255 (a
    NaN/Inf block) gives 0x7F everywhere.
    """
    if HW_CAST:
        # NaN scale for 255: the product is NaN and the saturating conversion writes 0x7F; finite
        # products beyond 448 (floor only) saturate in the conversion.
        inv = tl.where(byte == 255, 0x7FC00000, (254 - byte) << 23).to(tl.float32, bitcast=True)
        return (x * inv).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return encode(x, byte, False)


@triton.jit
def _scale_offset(r, c, n_cols, BLOCKED: tl.constexpr):
    """Byte offset of scale (r, c) of a matrix with `n_cols` columns: row-major, or 128x4 blocked."""
    if BLOCKED:
        n_col_tiles = (n_cols + 3) // 4
        tile = (r // 128) * n_col_tiles + c // 4
        return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    else:
        return r * n_cols + c


# ----------------------------------------------------------------------------- the 2-D kernel


@triton.jit
def store_scales(ptr, byte, r, c, n_rows, n_cols, BLOCKED: tl.constexpr, EVEN: tl.constexpr):
    """Store scale bytes `byte` at (r, c) of an `[n_rows, n_cols]` scale matrix (plain or blocked)."""
    if EVEN:
        tl.store(ptr + _scale_offset(r, c, n_cols, BLOCKED), byte.to(tl.uint8))
    else:
        tl.store(ptr + _scale_offset(r, c, n_cols, BLOCKED), byte.to(tl.uint8), mask=(r < n_rows) & (c < n_cols))


@triton.jit
def tile_axes(NMB: tl.constexpr, NKB: tl.constexpr, THREAD_ROWS: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr):
    """The six index axes of the tile, each a 6-D arange along its own axis: (g, c, kb, mb, r, e).

    Row within the tile: mb * 32 + c * THREAD_ROWS + r; column: kb * 32 + g * 8 + e.
    e (8 consecutive columns, one vector) is the last axis and r (THREAD_ROWS consecutive rows) the
    second to last; lanes and warps go to the leading axes in order, so r and e stay in registers
    whenever the leading axes cover all threads. g (4 groups of 8 columns of a 32-column block) leads,
    so that the row max only crosses lanes - or, with ROW_BLOCKS_IN_THREAD, sits just before r so that
    it stays in registers too. c (32 / THREAD_ROWS strips of a 32-row block) follows.
    """
    NC: tl.constexpr = 32 // THREAD_ROWS
    e = tl.arange(0, 8)[None, None, None, None, None, :]
    r = tl.arange(0, THREAD_ROWS)[None, None, None, None, :, None]
    if ROW_BLOCKS_IN_THREAD:  # axis order (c, kb, mb, g, r, e)
        c = tl.arange(0, NC)[:, None, None, None, None, None]
        kb = tl.arange(0, NKB)[None, :, None, None, None, None]
        mb = tl.arange(0, NMB)[None, None, :, None, None, None]
        g = tl.arange(0, 4)[None, None, None, :, None, None]
    else:  # axis order (g, c, kb, mb, r, e)
        g = tl.arange(0, 4)[:, None, None, None, None, None]
        c = tl.arange(0, NC)[None, :, None, None, None, None]
        kb = tl.arange(0, NKB)[None, None, :, None, None, None]
        mb = tl.arange(0, NMB)[None, None, None, :, None, None]
    return g, c, kb, mb, r, e


@triton.jit
def strip_coordinates(NMB: tl.constexpr, NKB: tl.constexpr, THREAD_ROWS: tl.constexpr,
                      ROW_BLOCKS_IN_THREAD: tl.constexpr):
    """Row and column of every element of the strip tile (`tile_axes`), with the first row of its 32-row block,
    of its 32-column block and of its thread's strip: `(m, k, m_block, k_block, m_strip)`, tile-relative."""
    g, c, kb, mb, r, e = tile_axes(NMB, NKB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
    m_block = mb * 32
    k_block = kb * 32
    m_strip = m_block + c * THREAD_ROWS
    return m_strip + r, k_block + g * 8 + e, m_block, k_block, m_strip


@triton.jit
def nan_max(a, b):
    """max propagating NaN (`max.NaN.f32`): the combine of the FP32 block maxima below."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_over(a, INNER: tl.constexpr, OUTER: tl.constexpr, FLOAT: tl.constexpr):
    """Max of `a` over axis INNER, then OUTER, dims kept: integer maxima, or (FLOAT) NaN-propagating FP32 maxima
    returned as int32 bits."""
    if FLOAT:
        return tl.reduce(tl.reduce(a, INNER, nan_max, keep_dims=True), OUTER, nan_max, keep_dims=True).to(
            tl.int32, bitcast=True)
    else:
        return tl.max(tl.max(a, axis=INNER, keep_dims=True), axis=OUTER, keep_dims=True)


@triton.jit
def max_rows_of_blocks(a, ROW_BLOCKS_IN_THREAD: tl.constexpr, FLOAT: tl.constexpr):
    """Max over each 1x32 block (axes e and g; g sits at axis 3 or 0, see `tile_axes`), dims kept: the integer max
    of `a` (`abs_bits(x)`), or with FLOAT the NaN-propagating max of FP32 `a` (`|x|`) as int32 bits, the same bits
    (NaN and Inf blocks included: canonical NaN's bits, like Inf's, reach 0x7F800000) in fewer instructions where
    compiled (|x| is an operand modifier of the max). The interpreter lacks `max.NaN`: FLOAT on compiled kernels."""
    if ROW_BLOCKS_IN_THREAD:
        return _max_over(a, 5, 3, FLOAT)
    else:
        return _max_over(a, 5, 0, FLOAT)


@triton.jit
def max_cols_of_blocks(a, ROW_BLOCKS_IN_THREAD: tl.constexpr, FLOAT: tl.constexpr):
    """Max over each 32x1 block (axes r and c; c sits at axis 0 or 1, see `tile_axes`), dims kept; FLOAT: see
    `max_rows_of_blocks`."""
    if ROW_BLOCKS_IN_THREAD:
        return _max_over(a, 4, 0, FLOAT)
    else:
        return _max_over(a, 4, 1, FLOAT)


@triton.jit
def store_colwise_pairs(ptr, row_stride, m0, k0, m_strip, k, x, byte, PAIR_LIMIT, K_LIMIT, EVEN: tl.constexpr,
                        HW_CAST: tl.constexpr):
    """Colwise payload of the tile stored two rows at a time, into x^T `[K, M]` with rows `row_stride`
    elements apart (`row_stride` even).

    The hardware conversion packs two values into 16 bits; fed with rows 2i and 2i+1 of a column, its
    result is already two consecutive bytes of x^T and goes out as one 16-bit element, a thread's
    THREAD_ROWS / 2 pairs of a column forming one vector. (`block_payload` pairs neighbouring columns,
    which then have to be unpacked and repacked byte by byte.) An even row stride keeps every pair inside
    one row of x^T; the vectors are aligned when Triton sees `row_stride` as a multiple of 16. The integer
    rounding (interpreter) takes the same path, pairing bytes.

    Masks (unless EVEN): pair p of the tile (rows m0 + 2p, m0 + 2p + 1) is stored when p < PAIR_LIMIT,
    column k0 + k when k < K_LIMIT. The caller makes sure that a stored pair lies inside a row of x^T.
    """
    # rows last, split in pairs: [.., 8, THREAD_ROWS / 2] each
    xt = tl.permute(x, (0, 1, 2, 3, 5, 4))
    x_even, x_odd = tl.split(tl.reshape(xt, [xt.shape[0], xt.shape[1], xt.shape[2], xt.shape[3], xt.shape[4],
                                             xt.shape[5] // 2, 2]))
    byte = tl.permute(byte, (0, 1, 2, 3, 5, 4))  # [.., 8, 1]
    if HW_CAST:
        inv = tl.where(byte == 255, 0x7FC00000, (254 - byte) << 23).to(tl.float32, bitcast=True)
        pairs = tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r",
                                          [x_even * inv, x_odd * inv], dtype=tl.uint16, is_pure=True,
                                          pack=1)  # low byte: the even row
    else:
        pairs = (block_payload(x_even, byte, False).to(tl.uint16)
                 | (block_payload(x_odd, byte, False).to(tl.uint16) << 8))
    # 16-bit offsets of the pairs in x^T, from the axes, so that contiguity and alignment stay visible
    half_r = tl.arange(0, x_even.shape[5])[None, None, None, None, None, :]
    k_t = tl.permute(k, (0, 1, 2, 3, 5, 4))
    m_t = tl.permute(m_strip, (0, 1, 2, 3, 5, 4))
    pair = m_t // 2 + half_r  # contiguous along the last axis, so that the mask is seen constant along it
    offset = (k0.to(tl.int64) * row_stride + m0) // 2 + k_t * (row_stride // 2) + pair
    ptr16 = ptr.to(tl.pointer_type(tl.uint16))
    if EVEN:
        tl.store(ptr16 + offset, pairs)
    else:
        tl.store(ptr16 + offset, pairs, mask=(pair < PAIR_LIMIT) & (k_t < K_LIMIT))


@triton.jit
def _mx_cast_2d_kernel(
    x_ptr, stride_xm, stride_xk, M, K,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, sq_data_ptr, sq_scale_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, THREAD_ROWS: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, SQUARE: tl.constexpr,
    BLOCKED_SCALES: tl.constexpr, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
    EVEN: tl.constexpr, PAIRED_COLWISE: tl.constexpr,
):
    NMB: tl.constexpr = BLOCK_M // 32
    NKB: tl.constexpr = BLOCK_K // 32
    # A 1-D grid, tiles in row-major order (a 2-D grid's second dimension is capped at 65535).
    n_k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    m0 = (pid // n_k_tiles) * BLOCK_M
    k0 = (pid % n_k_tiles) * BLOCK_K
    m, k, m_block, k_block, m_strip = strip_coordinates(NMB, NKB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
    if not EVEN:  # a partial tile at the M or K edge
        in_bounds = (m < M - m0) & (k < K - k0)
    if LARGE_OFFSETS:  # some offset inside a tile (e.g. BLOCK_K * M) reaches 2^31
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    # Tile origins in int64 (tensors may exceed 2^31 elements); offsets inside a tile are int32
    # unless LARGE_OFFSETS.
    x_tile = x_ptr + m0.to(tl.int64) * stride_xm + k0.to(tl.int64) * stride_xk
    if EVEN:
        raw = tl.load(x_tile + m * stride_xm + k * stride_xk)
    else:
        # Out-of-range rows read as 0, which leaves every block max unchanged (partial colwise blocks).
        raw = tl.load(x_tile + m * stride_xm + k * stride_xk, mask=in_bounds, other=0.0)
    x = exact_f32(raw)
    a = abs_bits(x)  # int32, NaN-proof max

    if ROWWISE or SQUARE:
        row_amax = max_rows_of_blocks(a, ROW_BLOCKS_IN_THREAD, False)
    if ROWWISE:
        byte = block_scale(row_amax, RCEIL)
        q = block_payload(x, byte, HW_CAST)
        out = row_data_ptr + m0.to(tl.int64) * K + k0 + m * K + k
        if EVEN:
            tl.store(out, q)
        else:
            tl.store(out, q, mask=in_bounds)
        # one scale per row and 32-column block: indices constant along the block's axes
        store_scales(row_scale_ptr, byte, m0 + m, (k0 + k_block) // 32, M, K // 32, BLOCKED_SCALES, EVEN)
    if COLWISE:
        byte = block_scale(max_cols_of_blocks(a, ROW_BLOCKS_IN_THREAD, False), RCEIL)
        # Payload of x^T ([K, M] contiguous): each thread's THREAD_ROWS rows of a column are consecutive
        # bytes there. Storing the tile with its last two axes swapped makes that run the vector
        # (Triton vectorizes along the last axis), and the swap is a renaming of registers.
        if PAIRED_COLWISE:
            store_colwise_pairs(col_data_ptr, M, m0, k0, m_strip, k, x, byte, (M - m0) // 2, K - k0, EVEN, HW_CAST)
        else:
            q = tl.permute(block_payload(x, byte, HW_CAST), (0, 1, 2, 3, 5, 4))
            out = k0.to(tl.int64) * M + m0 + k * M + m
            if EVEN:
                tl.store(col_data_ptr + tl.permute(out, (0, 1, 2, 3, 5, 4)), q)
            else:
                tl.store(col_data_ptr + tl.permute(out, (0, 1, 2, 3, 5, 4)), q,
                         mask=tl.permute(in_bounds, (0, 1, 2, 3, 5, 4)))
        store_scales(col_scale_ptr, byte, k0 + k, (m0 + m_block) // 32, K, (M + 31) // 32, BLOCKED_SCALES, EVEN)
    if SQUARE:
        byte = block_scale(max_cols_of_blocks(row_amax, ROW_BLOCKS_IN_THREAD, False), RCEIL)
        q = block_payload(x, byte, HW_CAST)
        out = sq_data_ptr + m0.to(tl.int64) * K + k0 + m * K + k
        if EVEN:
            tl.store(out, q)
        else:
            tl.store(out, q, mask=in_bounds)
        store_scales(sq_scale_ptr, byte, (m0 + m_block) // 32, (k0 + k_block) // 32, M // 32, K // 32, False, EVEN)


# ----------------------------------------------------------------------------- host side


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


def cast_2d_launch(x: torch.Tensor, outs: list[torch.Tensor], rowwise: bool, colwise: bool, square: bool,
                   blocked_scales: bool, rceil: bool, config: CastConfig, hw_cast: bool):
    """(grid, args, kwargs) of the kernel launch writing `outs` (`output_specs`' order) from `x [M, K]`."""
    M, K = x.shape
    block_m, block_k, num_warps, thread_rows, row_blocks_in_thread = config
    it = iter(outs)
    row = (next(it), next(it)) if rowwise else (None, None)
    col = (next(it), next(it)) if colwise else (None, None)
    sq = (next(it), next(it)) if square else (None, None)
    # Payloads are written as bytes; the kernel never sees an fp8 pointer.
    ptrs = [t.view(torch.uint8) if t is not None and t.dtype == PAYLOAD_DTYPE else t for t in (*row, *col, *sq)]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(K, block_k),)
    # Largest offset inside one tile: input strides, rowwise rows (x K), colwise columns (x M).
    span = max(block_m * abs(x.stride(0)) + block_k * abs(x.stride(1)), block_m * K, block_k * M)
    args = (x, x.stride(0), x.stride(1), M, K, *ptrs)
    kwargs = dict(
        BLOCK_M=block_m, BLOCK_K=block_k, THREAD_ROWS=thread_rows, ROW_BLOCKS_IN_THREAD=bool(row_blocks_in_thread),
        ROWWISE=rowwise, COLWISE=colwise, SQUARE=square,
        BLOCKED_SCALES=blocked_scales, RCEIL=rceil, HW_CAST=hw_cast, LARGE_OFFSETS=span >= _INT32_SPAN,
        EVEN=M % block_m == 0 and K % block_k == 0,
        PAIRED_COLWISE=colwise and M % 2 == 0 and thread_rows > 1,
        num_warps=num_warps,
    )
    return grid, args, kwargs


def compile_for_target(kernel, args, kwargs, capability: int = 90):
    """Build `kernel` for CUDA sm_<capability> exactly as a launch with these arguments would specialize it,
    without a GPU (tensors may live on the CPU; only dtypes, strides, integer values and pointer
    alignment matter). Returns Triton's compiled kernel (`.asm["ptx"]`, `.asm["ttgir"]`, ...).

    Needs `TRITON_INTERPRET` unset when the kernel's module was imported, and Triton 3.6's JIT internals
    (the argument binder and `_pack_args`).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str, capability: int = 90) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that Triton's bundled ptxas reports for `ptx`."""
    import os
    import re
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability in (90, 100) else f"sm_{capability}"
    log = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", "-", "-o", os.devnull],
                         input=ptx, capture_output=True, text=True, check=True).stderr
    regs = max(int(n) for n in re.findall(r"Used (\d+) registers", log))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))
    return regs, spills


@torch.library.custom_op("gem_lp::mx_cast_2d", mutates_args=())
def _mx_cast_2d_op(
    x: torch.Tensor, rowwise: bool, colwise: bool, square: bool, blocked_scales: bool, rceil: bool,
    block_m: int, block_k: int, num_warps: int, thread_rows: int, row_blocks_in_thread: bool, hw_cast: bool,
) -> list[torch.Tensor]:
    M, K = x.shape
    outs = [(torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=x.device)
            for shape, dtype, zeroed in output_specs(M, K, rowwise, colwise, square, blocked_scales)]
    if M == 0 or K == 0:
        return outs
    config = CastConfig(block_m, block_k, num_warps, thread_rows, row_blocks_in_thread)
    grid, args, kwargs = cast_2d_launch(x, outs, rowwise, colwise, square, blocked_scales, rceil, config, hw_cast)
    _mx_cast_2d_kernel[grid](*args, **kwargs)
    return outs


@_mx_cast_2d_op.register_fake
def _(x, rowwise, colwise, square, blocked_scales, rceil, block_m, block_k, num_warps, thread_rows,
      row_blocks_in_thread, hw_cast):
    M, K = x.shape
    return [x.new_empty(shape, dtype=dtype) for shape, dtype, _ in
            output_specs(M, K, rowwise, colwise, square, blocked_scales)]


def check_strip_launch(rows: int, thread_rows: int, num_warps: int, prefix: str = "") -> None:
    """The launch of a kernel that walks `rows`-token chunks in thread strips (`tile_axes`): the jagged quantize
    kernel and the attention producer. `prefix` names the option group in the errors."""
    if rows not in (32, 64, 128):
        raise ValueError(f"{prefix}rows must be 32, 64 or 128, got {rows}")
    if thread_rows not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{prefix}thread_rows must be 1, 2, 4, 8, 16 or 32, got {thread_rows}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"{prefix}num_warps must be a power of two >= 1, got {num_warps}")


def _check_config(block_m: int, block_k: int, num_warps: int, thread_rows: int) -> None:
    for name, v in (("block_m", block_m), ("block_k", block_k)):
        if v < BLOCK or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {BLOCK}, got {v}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")
    if thread_rows < 1 or thread_rows > BLOCK or thread_rows & (thread_rows - 1):
        raise ValueError(f"thread_rows must be a power of two in 1..{BLOCK}, got {thread_rows}")


def default_config(rowwise: bool, colwise: bool, square: bool, hw_cast: bool = True) -> CastConfig:
    """Launch configuration used when the caller gives none."""
    if interpreter_enabled():
        return INTERPRETER_CONFIG
    if rowwise and colwise and not square and hw_cast:
        return DEFAULT_CONFIGS["dual"]
    if colwise and (rowwise or square):
        return DEFAULT_CONFIGS["dual_heavy"]
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
    thread_rows: int | None = None,
    row_blocks_in_thread: bool | None = None,
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
        block_m, block_k, num_warps, thread_rows, row_blocks_in_thread: launch configuration (see
            `CastConfig`; tile sides are powers of two >= 32); each `None` takes `default_config`'s value.
            The bytes written do not depend on it.
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
    cfg = default_config(rowwise, colwise, square, hw_cast)
    given = (block_m, block_k, num_warps, thread_rows, row_blocks_in_thread)
    block_m, block_k, num_warps, thread_rows, row_blocks_in_thread = (
        d if v is None else v for v, d in zip(given, cfg))
    _check_config(block_m, block_k, num_warps, thread_rows)
    # Quantization is not differentiable: the op's outputs must not join the autograd graph.
    return _mx_cast_2d_op(x.detach(), rowwise, colwise, square, blocked_scales, scaling == "rceil",
                          block_m, block_k, num_warps, thread_rows, bool(row_blocks_in_thread), hw_cast)
