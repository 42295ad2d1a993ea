"""One-launch Triton kernel for jagged MX quantization, registered as the custom op `gem_lp::jagged_mx_quantize`.

Grid: Tp/ROWS chunks of ROWS padded rows (32, 64 or 128) x H heads, flattened with heads fastest, so that
programs running together read the neighbouring bytes of the same tokens. A chunk lies inside one 128-row
tile, which belongs to one sequence (each sequence's scale rows are padded to a multiple of 128); the
layout finds it on device (`torch.searchsorted` on `scale_offsets`). Each program reads its chunk's
`[ROWS, D]` values of one head once (rows past the sequence's end masked to 0, so their blocks get scale
byte 0 under both rules), CHUNK_D features at a time, and for every requested orientation stores the
payload at the packed token positions and every scale byte of its rows (hdim form) and of its 32-token
blocks (seq form), padding bytes included: the scale buffers need no zero-fill. A chunk wholly past its
sequence's end (the padding of the last tile) only writes its zero scale bytes. With `programs_per_sm` the
grid is persistent: fewer programs walk the same work items in the same order, each loading its next chunk's
values before it quantizes and stores the current one.

The seq payload sits at the same `[T, H, D]` positions as the input: only the direction of the block max
differs from hdim. Each thread owns THREAD_ROWS consecutive tokens x 8 consecutive features (the strip
layout of `gem_lp.mx.kernels.triton_quantize`), so the 32-token max is mostly a max inside the thread, and both
payloads leave as 8-byte rows with no layout change. With `row_blocks_in_thread` a thread holds whole
32-feature blocks instead (the hdim-only cast).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gem_lp.runtime.device import interpreter_enabled, skips_dispatch, sm_count
from gem_lp.runtime.triton_launch import KernelLaunch
from gem_lp.mx.formats import PAYLOAD_DTYPE
from gem_lp.mx.kernels.triton_numerics import abs_bits, exact_f32
from gem_lp.mx.kernels.triton_quantize import (block_payload, block_scale, check_strip_launch, max_cols_of_blocks,
                                  max_rows_of_blocks, tile_axes)
from gem_lp.jagged.tensor import JaggedMXTensor, scale_sizes



class LaunchOptions(NamedTuple):
    """How the kernel is launched; the bytes written never depend on it.

    rows: padded rows per program (32, 64 or 128). thread_rows: consecutive tokens per thread strip (1..32,
    a power of two). row_blocks_in_thread: a thread holds whole 32-feature blocks instead of one 8-feature
    group. num_warps: warps per program. max_registers: registers per thread that ptxas may use (Triton's
    `maxnreg`; 0: no limit); a limit below what the kernel needs spills to local memory. programs_per_sm: 0,
    one program per chunk and head; else a persistent grid of programs_per_sm x SMs programs (at most one per
    chunk and head), each walking the chunks and loading the next one's values before storing the current one.
    direct_inverse: each payload's inverse scale straight from its block's amax (`_payload`: 7 instead of 9
    instructions per block; rceil with the hardware cast, else no effect). tile_table: a program finds its
    tokens with one lookup (`JaggedLayout.tile_tokens`: first token of its 128-row tile and end of the tile's
    sequence) instead of two dependent ones (`tile_seq`, then `offsets` and `scale_offsets`): one memory
    latency less before its values can be requested. unmasked_full: a chunk whose rows are all tokens (all but
    the last real chunk of each sequence) takes a copy of the code without token masks. const_strides:
    contiguous values are addressed with compile-time strides (H * D, D, 1) instead of the runtime ones.
    shift_offsets: the blocked scale offsets by shifts and masks instead of signed // and %. float_max: block
    maxima as NaN-propagating FP32 maxima of |x| (|x| an operand modifier, no abs instruction per element);
    compiled kernels with the hardware cast only (the interpreter keeps the integer maxima).
    """

    rows: int
    thread_rows: int
    row_blocks_in_thread: bool
    num_warps: int
    max_registers: int = 0
    programs_per_sm: int = 0
    direct_inverse: bool = False
    tile_table: bool = False
    unmasked_full: bool = False
    const_strides: bool = False
    shift_offsets: bool = False
    float_max: bool = False


# Launch options by the orientations requested (chunk_d = chunk_width(D)), chosen from the sm_90 builds
# (instructions per element, registers without spills); `benchmarks/bench_jagged.py` times them against
# alternatives on the GPU.
# Defaults: the fastest of the candidates for both workloads of `benchmarks/bench_jagged.py` (docs/PERF.md).
DEFAULT_LAUNCH = {
    "hdim": LaunchOptions(32, 8, False, 2),
    # square: 8-token strips with direct_inverse, tile_table, const_strides, shift_offsets and float_max at 96
    # registers
    "square": LaunchOptions(32, 8, False, 2, 96, 0, True, True, False, True, True, True),
    # any set with seq: 4-token strips, 56 registers (9 programs per SM), with the byte-neutral options
    # direct_inverse, tile_table, const_strides, shift_offsets and float_max (fewer sm_90 instructions per element)
    "seq": LaunchOptions(32, 4, False, 4, 56, 0, True, True, False, True, True, True),
}
# The orientation set of each launch group of the tuning space (`benchmarks/launch_candidates.py`).
LAUNCH_SETS = {"hdim+seq": ("hdim", "seq"), "hdim": ("hdim",), "square": ("square",)}
# Under the interpreter the cost is per program and per op: few, large programs.
INTERPRETER_LAUNCH = LaunchOptions(128, 4, False, 1)
# Offsets inside a chunk at or above this need int64 arithmetic.
_INT32_SPAN = 2**31


@triton.jit
def _hdim_scale_offset(row, col, N_COL_BLOCKS: tl.constexpr, SHIFTS: tl.constexpr):
    """Blocked-layout byte of scale (row, col) of an hdim-form matrix [Tp, D/32] (see mx.layout). SHIFTS: by
    shifts and masks, which row, col >= 0 allow (signed // and % add the rounding of negative numbers)."""
    if SHIFTS:
        return (((row >> 7) * N_COL_BLOCKS + (col >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4
                + (col & 3))
    return ((row // 128) * N_COL_BLOCKS + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


@triton.jit
def _seq_scale_offset(feature, tile, j, num_tiles, SHIFTS: tl.constexpr):
    """Blocked-layout byte of scale (feature, 4*tile + j) of a seq-form matrix [D, Tp/32]; Tp/128 column blocks.
    SHIFTS: by shifts and masks (feature >= 0)."""
    if SHIFTS:
        return ((feature >> 7) * num_tiles + tile) * 512 + (feature & 31) * 16 + ((feature >> 5) & 3) * 4 + j
    return ((feature // 128) * num_tiles + tile) * 512 + (feature % 32) * 16 + ((feature % 128) // 32) * 4 + j


@triton.jit
def _payload(x, amax_bits, RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LEAN: tl.constexpr):
    """E4M3 payload bytes (uint8) of FP32 `x` in blocks whose amax bits are `amax_bits` (broadcastable): the
    bytes of `block_payload(x, block_scale(amax_bits, RCEIL), HW_CAST)`.

    LEAN (rceil, hardware cast): fewer instructions per block. The inverse scale 2^(127 - byte) comes straight
    from d = amax / 448 rounded up to a power of two (its exponent field is byte << 23; d <= 2^-127 gives
    byte 0), without forming the byte or clamping it; a NaN/Inf block gets NaN from the FMA's addend
    amax * -0.0, which is -0 for finite blocks (so the product, -0 included, is unchanged) and NaN
    otherwise (the conversion then writes 0x7F). 7 instructions per block instead of 9.
    """
    if LEAN and RCEIL and HW_CAST:
        af = amax_bits.to(tl.float32, bitcast=True)
        d = (af * 0.0022321429569274187).to(tl.uint32, bitcast=True)
        up = tl.where(d > 0x400000, (d + 0x7FFFFF) & 0xFF800000, 0)  # byte << 23 for finite blocks
        inv = (0x7F000000 - up).to(tl.float32, bitcast=True)
        # the addend -0 (NaN for a NaN/Inf amax) from its bits: Triton writes both -(a - a) and the literal
        # -0.0 as +0, and x + 0 would turn a -0 payload into +0
        neg_zero = tl.full((), 0x80000000, tl.uint32).to(tl.float32, bitcast=True)
        y = tl.fma(x, inv, af * neg_zero)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return block_payload(x, block_scale(amax_bits, RCEIL), HW_CAST)


@triton.jit
def _chunk_tokens(row0, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr, TILE_TABLE: tl.constexpr):
    """(tok0, n_valid) of the chunk starting at padded row `row0`: packed token of row0 and tokens of its
    sequence in the chunk (<= 0: a chunk of padding rows), int64. TILE_TABLE: one lookup in `tile_tokens`
    (two neighbouring int64: first token of the tile, end of its sequence); else the owner sequence from
    `tile_seq`, then its offsets and first padded row."""
    if TILE_TABLE:
        tile_start = tl.load(tile_tokens_ptr + 2 * (row0 >> 7))
        seq_end = tl.load(tile_tokens_ptr + 2 * (row0 >> 7) + 1)
        tok0 = tile_start + (row0 & 127)
    else:
        b = tl.load(tile_seq_ptr + row0 // 128)
        seq_start = tl.load(offsets_ptr + b).to(tl.int64)
        seq_end = tl.load(offsets_ptr + b + 1).to(tl.int64)
        tok0 = seq_start + (row0 - tl.load(scale_offsets_ptr + b))
    return tok0, seq_end - tok0


@triton.jit
def _chunk_of(item, n_items, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr, H: tl.constexpr,
              ROWS: tl.constexpr, TILE_TABLE: tl.constexpr):
    """(row0, h, tok0, n_valid) of work item `item` (chunk * H + head) of the persistent walk: first padded row
    of the chunk, head, packed token of row0, tokens of the sequence in the chunk (<= 0: padding rows only).
    An item at or past `n_items` looks up the last item (in bounds) and gets n_valid 0: no load reads for it."""
    it = tl.minimum(item, n_items - 1)
    row0 = (it // H) * ROWS
    tok0, n_valid = _chunk_tokens(row0, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr, TILE_TABLE)
    n_valid = tl.where(item < n_items, n_valid, 0)
    return row0, it % H, tok0, n_valid


@triton.jit
def _load_chunk(x_ptr, tok0, h, n_valid, t, f_in, stride_t, stride_h, stride_d, ROWS: tl.constexpr,
                LARGE_OFFSETS: tl.constexpr):
    """The first feature chunk of a chunk's values as stored (rows at or past n_valid: 0, not read)."""
    valid = t < tl.minimum(n_valid, ROWS).to(tl.int32)
    if LARGE_OFFSETS:
        t = t.to(tl.int64)
        f_in = f_in.to(tl.int64)
    x_chunk = x_ptr + tok0 * stride_t + h.to(tl.int64) * stride_h
    return tl.load(x_chunk + t * stride_t + f_in * stride_d, mask=valid, other=0.0)


@triton.jit
def _store_payload(ptr, q, valid, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, q, mask=valid)
    else:
        tl.store(ptr, q)


@triton.jit
def _quantize_features(
    x_first, PRELOADED: tl.constexpr, MASKED: tl.constexpr, valid, t, f_in, cb, rows, jb, tile, num_tiles,
    x_chunk, stride_t, stride_d, p_hdim_chunk, p_seq_chunk, p_square_chunk,
    s_hdim_head, s_seq_head, s_sq_hdim_head, s_sq_seq_head,
    H: tl.constexpr, D: tl.constexpr, CHUNK_D: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr,
    DO_HDIM: tl.constexpr, DO_SEQ: tl.constexpr, DO_SQUARE: tl.constexpr, RCEIL: tl.constexpr,
    HW_CAST: tl.constexpr, LEAN: tl.constexpr, SHIFTS: tl.constexpr, FLOAT_MAX: tl.constexpr,
):
    """Payloads and scale bytes of a chunk with real tokens, CHUNK_D features at a time (see `_quantize_chunk`).
    MASKED: rows at or past the sequence's end (`valid` false) are neither read nor stored; else every row of
    the chunk is a token (no masks)."""
    NC: tl.constexpr = D // 32  # hdim-form scale columns
    N_COL_BLOCKS: tl.constexpr = (NC + 3) // 4
    CB: tl.constexpr = CHUNK_D // 32  # 32-feature blocks per feature chunk
    for ci in tl.static_range(D // CHUNK_D):
        f = ci * CHUNK_D + f_in
        if PRELOADED and ci == 0:
            x = exact_f32(x_first)
        else:
            if MASKED:
                x = exact_f32(tl.load(x_chunk + t * stride_t + f * stride_d, mask=valid, other=0.0))
            else:
                x = exact_f32(tl.load(x_chunk + t * stride_t + f * stride_d))
        if FLOAT_MAX:
            a = tl.abs(x)  # NaN-propagating FP32 maxima
        else:
            a = abs_bits(x)  # integer max: NaN/Inf cannot hide
        p_off = t * (H * D) + f
        col = ci * CB + cb  # hdim-form scale columns of this feature chunk
        if DO_HDIM or DO_SQUARE:
            hdim_amax = max_rows_of_blocks(a, ROW_BLOCKS_IN_THREAD, FLOAT_MAX)  # 1x32 along D
        if DO_HDIM:
            _store_payload(p_hdim_chunk + p_off, _payload(x, hdim_amax, RCEIL, HW_CAST, LEAN), valid, MASKED)
            byte = block_scale(hdim_amax, RCEIL)
            tl.store(s_hdim_head + _hdim_scale_offset(rows, col, N_COL_BLOCKS, SHIFTS), byte.to(tl.uint8))
        if DO_SEQ:  # 32x1 along tokens
            seq_amax = max_cols_of_blocks(a, ROW_BLOCKS_IN_THREAD, FLOAT_MAX)
            _store_payload(p_seq_chunk + p_off, _payload(x, seq_amax, RCEIL, HW_CAST, LEAN), valid, MASKED)
            byte = block_scale(seq_amax, RCEIL)
            tl.store(s_seq_head + _seq_scale_offset(ci * CHUNK_D + f_in, tile, jb, num_tiles, SHIFTS),
                     byte.to(tl.uint8))
        if DO_SQUARE:  # 32x32
            square_amax = max_cols_of_blocks(hdim_amax, ROW_BLOCKS_IN_THREAD, False)
            _store_payload(p_square_chunk + p_off, _payload(x, square_amax, RCEIL, HW_CAST, LEAN), valid,
                           MASKED)
            byte = block_scale(square_amax, RCEIL)
            # the hdim form repeats the byte on each real token row (padding rows: 0), the seq form
            # on each of the block's 32 features
            if MASKED:
                on_rows = tl.where(valid, byte, 0)
            else:
                on_rows = byte
            tl.store(s_sq_hdim_head + _hdim_scale_offset(rows, col, N_COL_BLOCKS, SHIFTS), on_rows.to(tl.uint8))
            tl.store(s_sq_seq_head + _seq_scale_offset(ci * CHUNK_D + f_in, tile, jb, num_tiles, SHIFTS),
                     byte.to(tl.uint8))  # broadcast over the block's features


@triton.jit
def _quantize_chunk(
    x_first, PRELOADED: tl.constexpr, row0, h, tok0, n_valid, t, f_in, cb, mb,
    x_ptr, p_hdim_ptr, p_seq_ptr, p_square_ptr, s_hdim_ptr, s_seq_ptr, s_sq_hdim_ptr, s_sq_seq_ptr,
    stride_t, stride_h, stride_d, num_tiles, hdim_head_bytes, seq_head_bytes,
    H: tl.constexpr, D: tl.constexpr, CHUNK_D: tl.constexpr, ROWS: tl.constexpr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr, DO_HDIM: tl.constexpr, DO_SEQ: tl.constexpr, DO_SQUARE: tl.constexpr,
    RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr, LEAN: tl.constexpr,
    FULL_PATH: tl.constexpr, CONST_STRIDES: tl.constexpr, SHIFTS: tl.constexpr, FLOAT_MAX: tl.constexpr,
):
    """Every output byte of one chunk (ROWS padded rows from row0, head h). `t`, `f_in`, `cb`, `mb`: the
    strip axes (int32); with PRELOADED, `x_first` holds the first feature chunk's values (`_load_chunk`),
    else each feature chunk is loaded here. CONST_STRIDES: the values are contiguous `[T, H, D]`, so their
    strides are compile-time constants (fewer address instructions)."""
    if CONST_STRIDES:
        stride_t = H * D
        stride_h = D
        stride_d = 1
    NC: tl.constexpr = D // 32  # hdim-form scale columns
    N_COL_BLOCKS: tl.constexpr = (NC + 3) // 4
    CB: tl.constexpr = CHUNK_D // 32  # 32-feature blocks per feature chunk
    NB: tl.constexpr = ROWS // 32  # 32-token blocks per program
    if SHIFTS:  # row0 >= 0
        tile = row0 >> 7
        jb = ((row0 >> 5) & 3) + mb  # 32-token blocks within the tile (seq-form columns 4 * tile + jb)
    else:
        tile = row0 // 128
        jb = (row0 % 128) // 32 + mb
    # Pointers to the chunk's first element are formed once (64-bit); offsets inside the chunk stay 32-bit
    # unless LARGE_OFFSETS, and the token mask compares 32-bit ints (n_valid > -128: int32 after the clamp).
    n_rows = tl.minimum(n_valid, ROWS).to(tl.int32)
    s_hdim_head = s_hdim_ptr + h.to(tl.int64) * hdim_head_bytes
    s_seq_head = s_seq_ptr + h.to(tl.int64) * seq_head_bytes
    s_sq_hdim_head = s_sq_hdim_ptr + h.to(tl.int64) * hdim_head_bytes
    s_sq_seq_head = s_sq_seq_ptr + h.to(tl.int64) * seq_head_bytes

    valid = t < n_rows
    rows = row0 + t  # padded scale rows (hdim form)
    if LARGE_OFFSETS:  # some offset inside a chunk reaches 2^31
        t = t.to(tl.int64)
        f_in = f_in.to(tl.int64)
    x_chunk = x_ptr + tok0 * stride_t + h.to(tl.int64) * stride_h
    p_chunk = (tok0 * H + h) * D
    # payloads arrive as float8 (on CUDA) or uint8 (interpreter) pointers; bytes are stored either way
    p_hdim_chunk = p_hdim_ptr.to(tl.pointer_type(tl.uint8)) + p_chunk
    p_seq_chunk = p_seq_ptr.to(tl.pointer_type(tl.uint8)) + p_chunk
    p_square_chunk = p_square_ptr.to(tl.pointer_type(tl.uint8)) + p_chunk

    if n_valid >= ROWS and FULL_PATH:  # every row a token: no masks
        _quantize_features(x_first, PRELOADED, False, valid, t, f_in, cb, rows, jb, tile, num_tiles,
                           x_chunk, stride_t, stride_d, p_hdim_chunk, p_seq_chunk, p_square_chunk,
                           s_hdim_head, s_seq_head, s_sq_hdim_head, s_sq_seq_head, H, D, CHUNK_D,
                           ROW_BLOCKS_IN_THREAD, DO_HDIM, DO_SEQ, DO_SQUARE, RCEIL, HW_CAST, LEAN, SHIFTS,
                           FLOAT_MAX)
    elif n_valid > 0:
        _quantize_features(x_first, PRELOADED, True, valid, t, f_in, cb, rows, jb, tile, num_tiles,
                           x_chunk, stride_t, stride_d, p_hdim_chunk, p_seq_chunk, p_square_chunk,
                           s_hdim_head, s_seq_head, s_sq_hdim_head, s_sq_seq_head, H, D, CHUNK_D,
                           ROW_BLOCKS_IN_THREAD, DO_HDIM, DO_SEQ, DO_SQUARE, RCEIL, HW_CAST, LEAN, SHIFTS,
                           FLOAT_MAX)
    else:  # padding rows only: every scale byte of the chunk is 0
        for ci in tl.static_range(D // CHUNK_D):
            col = ci * CB + cb
            hdim_off = _hdim_scale_offset(rows, col, N_COL_BLOCKS, SHIFTS)  # every (row, column) pair
            seq_off = _seq_scale_offset(ci * CHUNK_D + f_in, tile, jb, num_tiles, SHIFTS)  # (feature, block)
            if DO_HDIM:
                tl.store(s_hdim_head + hdim_off, tl.zeros(hdim_off.shape, tl.uint8))
            if DO_SEQ:
                tl.store(s_seq_head + seq_off, tl.zeros(seq_off.shape, tl.uint8))
            if DO_SQUARE:
                tl.store(s_sq_hdim_head + hdim_off, tl.zeros(hdim_off.shape, tl.uint8))
                tl.store(s_sq_seq_head + seq_off, tl.zeros(seq_off.shape, tl.uint8))

    # padding columns of the hdim form (D/32 not a multiple of 4): zeros in the last column block
    i = tl.arange(0, ROWS)
    j = tl.arange(0, 4)
    if NC % 4 != 0:
        if DO_HDIM or DO_SQUARE:
            pc = (N_COL_BLOCKS - 1) * 4 + j
            off = _hdim_scale_offset(row0 + i[:, None], pc[None, :], N_COL_BLOCKS, SHIFTS)
            pad = (pc[None, :] >= NC) & (i[:, None] >= 0)
            zero = tl.zeros([ROWS, 4], dtype=tl.uint8)
            if DO_HDIM:
                tl.store(s_hdim_head + off, zero, mask=pad)
            if DO_SQUARE:
                tl.store(s_sq_hdim_head + off, zero, mask=pad)
    # padding rows of the seq form (D not a multiple of 128): zeros in the last row block
    if D % 128 != 0:
        if DO_SEQ or DO_SQUARE:
            fp = ((D + 127) // 128 - 1) * 128 + tl.arange(0, 128)
            jp = (row0 % 128) // 32 + tl.arange(0, NB)
            off = _seq_scale_offset(fp[None, :], tile, jp[:, None], num_tiles, SHIFTS)  # [NB, 128]
            pad = (fp[None, :] >= D) & (jp[:, None] >= 0)
            zero = tl.zeros([NB, 128], dtype=tl.uint8)
            if DO_SEQ:
                tl.store(s_seq_head + off, zero, mask=pad)
            if DO_SQUARE:
                tl.store(s_sq_seq_head + off, zero, mask=pad)


@triton.jit
def _jagged_mx_kernel(
    x_ptr, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr,
    p_hdim_ptr, p_seq_ptr, p_square_ptr,
    s_hdim_ptr, s_seq_ptr, s_sq_hdim_ptr, s_sq_seq_ptr,
    stride_t, stride_h, stride_d,
    num_tiles, hdim_head_bytes, seq_head_bytes,
    H: tl.constexpr, D: tl.constexpr, CHUNK_D: tl.constexpr, ROWS: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_BLOCKS_IN_THREAD: tl.constexpr,
    DO_HDIM: tl.constexpr, DO_SEQ: tl.constexpr, DO_SQUARE: tl.constexpr,
    RCEIL: tl.constexpr, HW_CAST: tl.constexpr, LARGE_OFFSETS: tl.constexpr, PERSISTENT: tl.constexpr,
    LEAN: tl.constexpr, TILE_TABLE: tl.constexpr, FULL_PATH: tl.constexpr, CONST_STRIDES: tl.constexpr,
    SHIFTS: tl.constexpr, FLOAT_MAX: tl.constexpr,
):
    # PERSISTENT: the grid's programs walk the work items (chunk * H + head) p, p + n_programs, ..., and load
    # the next item's first feature chunk (its lookups one item further ahead) before quantizing and storing
    # the current one, so that its loads are in flight during that work. Otherwise: one item per program.
    CB: tl.constexpr = CHUNK_D // 32  # 32-feature blocks per feature chunk
    NB: tl.constexpr = ROWS // 32  # 32-token blocks per program
    if PERSISTENT:
        # token t = mb * 32 + c * THREAD_ROWS + r of the chunk, feature f = cb * 32 + g * 8 + e of a feature chunk
        g, c, cb, mb, r, e = tile_axes(NB, CB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
        t = mb * 32 + c * THREAD_ROWS + r
        f_in = cb * 32 + g * 8 + e
        n_items = num_tiles * (128 // ROWS) * H
        n_programs = tl.num_programs(0)
        item = tl.program_id(0)  # < n_items: the grid has no more programs than items
        row0, h, tok0, n_valid = _chunk_of(item, n_items, offsets_ptr, scale_offsets_ptr, tile_seq_ptr,
                                           tile_tokens_ptr, H, ROWS, TILE_TABLE)
        x = _load_chunk(x_ptr, tok0, h, n_valid, t, f_in, stride_t, stride_h, stride_d, ROWS, LARGE_OFFSETS)
        row0_next, h_next, tok0_next, n_valid_next = _chunk_of(
            item + n_programs, n_items, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr, H, ROWS,
            TILE_TABLE)
        while item < n_items:
            x_next = _load_chunk(x_ptr, tok0_next, h_next, n_valid_next, t, f_in, stride_t, stride_h, stride_d,
                                 ROWS, LARGE_OFFSETS)
            row0_after, h_after, tok0_after, n_valid_after = _chunk_of(
                item + 2 * n_programs, n_items, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr, H,
                ROWS, TILE_TABLE)
            _quantize_chunk(x, True, row0, h, tok0, n_valid, t, f_in, cb, mb,
                            x_ptr, p_hdim_ptr, p_seq_ptr, p_square_ptr, s_hdim_ptr, s_seq_ptr, s_sq_hdim_ptr,
                            s_sq_seq_ptr, stride_t, stride_h, stride_d, num_tiles, hdim_head_bytes, seq_head_bytes,
                            H, D, CHUNK_D, ROWS, ROW_BLOCKS_IN_THREAD, DO_HDIM, DO_SEQ, DO_SQUARE, RCEIL, HW_CAST,
                            LARGE_OFFSETS, LEAN, FULL_PATH, CONST_STRIDES, SHIFTS,
                            FLOAT_MAX)
            item += n_programs
            x = x_next
            row0, h, tok0, n_valid = row0_next, h_next, tok0_next, n_valid_next
            row0_next, h_next, tok0_next, n_valid_next = row0_after, h_after, tok0_after, n_valid_after
    else:
        pid = tl.program_id(0)
        h = pid % H
        row0 = (pid // H) * ROWS  # first padded scale row of this program
        # packed token of row0, tokens of the sequence in this chunk (<= 0: a chunk of padding rows)
        tok0, n_valid = _chunk_tokens(row0, offsets_ptr, scale_offsets_ptr, tile_seq_ptr, tile_tokens_ptr,
                                      TILE_TABLE)
        g, c, cb, mb, r, e = tile_axes(NB, CB, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
        t = mb * 32 + c * THREAD_ROWS + r
        f_in = cb * 32 + g * 8 + e
        _quantize_chunk(0, False, row0, h, tok0, n_valid, t, f_in, cb, mb,
                        x_ptr, p_hdim_ptr, p_seq_ptr, p_square_ptr, s_hdim_ptr, s_seq_ptr, s_sq_hdim_ptr, s_sq_seq_ptr,
                        stride_t, stride_h, stride_d, num_tiles, hdim_head_bytes, seq_head_bytes,
                        H, D, CHUNK_D, ROWS, ROW_BLOCKS_IN_THREAD, DO_HDIM, DO_SEQ, DO_SQUARE, RCEIL, HW_CAST,
                        LARGE_OFFSETS, LEAN, FULL_PATH, CONST_STRIDES, SHIFTS,
                            FLOAT_MAX)


def default_launch(orientations: tuple[str, ...], on_cuda: bool) -> LaunchOptions:
    """Launch options used when the caller gives none (see `launch`)."""
    if interpreter_enabled() and not on_cuda:
        return INTERPRETER_LAUNCH
    if "seq" in orientations or ("hdim" in orientations and "square" in orientations):
        return DEFAULT_LAUNCH["seq"]
    return DEFAULT_LAUNCH["hdim" if "hdim" in orientations else "square"]



def chunk_width(head_dim: int) -> int:
    """Features per inner step: the largest of 128, 64, 32 that divides D."""
    return next(w for w in (128, 64, 32) if head_dim % w == 0)


def launch_args(values: torch.Tensor, offsets: torch.Tensor, scale_offsets: torch.Tensor,
                tile_seq: torch.Tensor, padded_total: int, payloads: dict[str, torch.Tensor],
                scales: dict[str, torch.Tensor], rceil: bool, *, tile_tokens: torch.Tensor | None = None,
                hw_cast: bool | None = None, **tuning):
    """(grid, args, kwargs) of the kernel launch of `launch` (same arguments; `hw_cast` None: on CUDA).

    `kwargs` may be shared between calls: do not modify it.
    """
    grid, args, plan = _plan_and_args(values, offsets, scale_offsets, tile_seq, padded_total, payloads, scales,
                                      rceil, tile_tokens, hw_cast, **tuning)
    return grid, args, plan.launch.kwargs


def _plan_and_args(values, offsets, scale_offsets, tile_seq, padded_total, payloads, scales, rceil, tile_tokens=None,
                   hw_cast=None, chunk_d=None, **options):
    """(grid, positional arguments, `_LaunchPlan`) of a launch (see `launch`); `options`: fields of
    `LaunchOptions`."""
    unknown = sorted(set(options) - set(LaunchOptions._fields))
    if unknown:
        raise TypeError(f"unknown launch options {unknown}: expected chunk_d or fields of LaunchOptions "
                        f"{list(LaunchOptions._fields)}")
    t, heads, d = values.shape
    on_cuda = values.is_cuda
    interpreter = not on_cuda and interpreter_enabled()  # only CPU tensors run in the interpreter
    opt = options.get
    programs_per_sm = opt("programs_per_sm")
    plan = _launch_plan(
        heads, d, values.stride(), padded_total, "hdim" in payloads, "seq" in payloads, "square" in payloads,
        rceil, on_cuda, interpreter, chunk_d, opt("rows"), opt("thread_rows"), opt("row_blocks_in_thread"),
        opt("num_warps"), opt("max_registers"), on_cuda if hw_cast is None else hw_cast, _INT32_SPAN,
        programs_per_sm, sm_count(values.device, off_gpu=1) if programs_per_sm else 1, opt("direct_inverse"),
        opt("tile_table"), opt("unmasked_full"), opt("const_strides"), opt("shift_offsets"), opt("float_max"))
    if tile_tokens is None:
        if plan.launch.kwargs["TILE_TABLE"]:
            raise ValueError("tile_table launches need tile_tokens ([Tp/128, 2] int64, JaggedLayout.tile_tokens)")
        tile_tokens = tile_seq  # not read
    # pointers of the orientations not requested are never dereferenced: any uint8 buffer will do
    dummy = next(iter(scales.values()), None)
    if dummy is None:
        dummy = torch.empty(1, dtype=torch.uint8, device=values.device)
    # float8 payloads go to the kernel as they are (it stores bytes through a uint8 view of the pointer);
    # the interpreter, which has no float8 arrays, gets uint8 views
    p_hdim, p_seq, p_square = (payloads.get(o, dummy) for o in ("hdim", "seq", "square"))
    if interpreter and not on_cuda:
        p_hdim, p_seq, p_square = (p.view(torch.uint8) for p in (p_hdim, p_seq, p_square))
    args = (values, offsets, scale_offsets, tile_seq, tile_tokens, p_hdim, p_seq, p_square,
            scales.get("hdim", dummy), scales.get("seq", dummy), scales.get("square_hdim", dummy),
            scales.get("square_seq", dummy), *plan.scalars)
    return plan.launch.grid, args, plan


class _LaunchPlan(NamedTuple):
    """Everything of a launch but the tensors (`_launch_plan`): the scalar arguments that follow the tensors, and
    the `KernelLaunch` (grid, keyword arguments, their constexpr values in parameter order, the compiled kernel of
    each device and pointer specialization met, for direct relaunch)."""

    scalars: tuple[int, ...]
    launch: KernelLaunch


@functools.lru_cache(maxsize=256)
def _launch_plan(heads: int, d: int, strides: tuple[int, int, int], padded_total: int, hdim: bool, seq: bool,
                 square: bool, rceil: bool, on_cuda: bool, interpreter: bool, chunk_d: int | None, rows: int | None,
                 thread_rows: int | None, row_blocks_in_thread: bool | None, num_warps: int | None,
                 max_registers: int | None, hw_cast: bool, int32_span: int, programs_per_sm: int | None = None,
                 sm_count: int = 1, direct_inverse: bool | None = None, tile_table: bool | None = None,
                 unmasked_full: bool | None = None, const_strides: bool | None = None,
                 shift_offsets: bool | None = None, float_max: bool | None = None) -> _LaunchPlan:
    """The `_LaunchPlan` (grid, scalar arguments, keyword arguments) of a launch: everything but the tensors,
    which depends on ints only, so that repeated calls (same batch layout, shapes and options) reuse it.
    Offsets inside a chunk at or above `int32_span` take int64 arithmetic; a persistent grid has
    programs_per_sm x `sm_count` programs at most."""
    hdim_bytes, seq_bytes = scale_sizes(padded_total, d)
    chunk_d = chunk_width(d) if chunk_d is None else chunk_d
    if chunk_d % 32 or d % chunk_d or chunk_d & (chunk_d - 1):
        raise ValueError(f"chunk_d must be a power-of-two multiple of 32 dividing D = {d}, got {chunk_d}")
    orientations = tuple(o for o, want in (("hdim", hdim), ("seq", seq), ("square", square)) if want)
    base = INTERPRETER_LAUNCH if interpreter and not on_cuda else default_launch(orientations, True)
    given = dict(rows=rows, thread_rows=thread_rows, row_blocks_in_thread=row_blocks_in_thread, num_warps=num_warps,
                 max_registers=max_registers, programs_per_sm=programs_per_sm, direct_inverse=direct_inverse,
                 tile_table=tile_table, unmasked_full=unmasked_full, const_strides=const_strides,
                 shift_offsets=shift_offsets, float_max=float_max)
    (rows, thread_rows, row_blocks_in_thread, num_warps, max_registers, programs_per_sm, direct_inverse, tile_table,
     unmasked_full, const_strides, shift_offsets, float_max) = base._replace(
        **{name: v for name, v in given.items() if v is not None})
    check_strip_launch(rows, thread_rows, num_warps)
    if max_registers != 0 and not 16 <= max_registers <= 255:
        raise ValueError(f"max_registers must be 0 (no limit) or 16..255, got {max_registers}")
    if not isinstance(programs_per_sm, int) or programs_per_sm < 0:
        raise ValueError(f"programs_per_sm must be an int >= 0 (0: one program per chunk), got {programs_per_sm!r}")
    # Largest offset inside one chunk: its tokens' input rows, or its payload rows (H * D bytes each).
    span = rows * (abs(strides[0]) + heads * d) + d * abs(strides[2])
    n_items = padded_total // rows * heads  # chunks x heads
    grid = (min(n_items, programs_per_sm * sm_count) if programs_per_sm else n_items,)
    scalars = (*strides, padded_total // 128, hdim_bytes, seq_bytes)
    kwargs = dict(
        H=heads, D=d, CHUNK_D=chunk_d, ROWS=rows, THREAD_ROWS=thread_rows,
        ROW_BLOCKS_IN_THREAD=bool(row_blocks_in_thread), DO_HDIM=hdim, DO_SEQ=seq, DO_SQUARE=square,
        RCEIL=rceil, HW_CAST=hw_cast, LARGE_OFFSETS=span >= int32_span, PERSISTENT=programs_per_sm > 0,
        LEAN=bool(direct_inverse), TILE_TABLE=bool(tile_table), FULL_PATH=bool(unmasked_full),
        CONST_STRIDES=bool(const_strides) and tuple(strides) == (heads * d, d, 1), SHIFTS=bool(shift_offsets),
        FLOAT_MAX=bool(float_max) and hw_cast and not interpreter,
        num_warps=num_warps,
    )
    if max_registers:
        kwargs["maxnreg"] = max_registers
    return _LaunchPlan(scalars, KernelLaunch(_jagged_mx_kernel, grid, _N_TENSOR_ARGS + len(scalars), kwargs))


def launch(values: torch.Tensor, offsets: torch.Tensor, scale_offsets: torch.Tensor,
           tile_seq: torch.Tensor, padded_total: int, payloads: dict[str, torch.Tensor],
           scales: dict[str, torch.Tensor], rceil: bool, *, tile_tokens: torch.Tensor | None = None,
           **tuning) -> None:
    """Run the kernel once into preallocated outputs (any contents: every byte is written).

    Args:
        values: `[T, H, D]` float32/bfloat16/float16, any strides.
        offsets: `[B+1]` int32/int64; scale_offsets: `[B+1]` int64; padded_total: Tp.
        tile_seq: `[Tp/128]` int32, owner sequence of each 128-row tile (`metadata.tile_sequences`).
        payloads: orientation -> `[T, H, D]` float8_e4m3fn (contiguous) for each requested orientation.
        scales: `"hdim"`, `"seq"`, `"square_hdim"`, `"square_seq"` -> `[H, bytes]` uint8 (contiguous),
            present for each requested orientation (square needs both of its forms).
        tuning: launch keywords, each absent or None taking `default_launch`'s value: `chunk_d`, features per
            inner step (a power-of-two multiple of 32 dividing D; default the largest of 128/64/32 dividing D),
            and the fields of `LaunchOptions`. The bytes written do not depend on them; an unknown keyword is a
            TypeError.
        tile_tokens: `[Tp/128, 2]` int64 (`JaggedLayout.tile_tokens`), needed by tile_table launches.
    """
    if padded_total == 0:
        return
    grid, args, plan = _plan_and_args(values, offsets, scale_offsets, tile_seq, padded_total, payloads, scales,
                                      rceil, tile_tokens, **tuning)
    _run(args, plan)


# Tensor arguments of `_jagged_mx_kernel` (values, 4 metadata, 3 payloads, 4 scales): what a compiled kernel is
# specialized on besides the plan's ints and constexprs (dtype and 16-byte alignment of each).
_N_TENSOR_ARGS = 12


# Direct relaunch of the compiled kernel (`gem_lp.runtime.triton_launch`): a third of the public call's host time, which
# the GPU would otherwise wait for.


def _run(args: tuple, plan: _LaunchPlan) -> None:
    """Launch `_jagged_mx_kernel`: the first launch of each (device, dtypes and 16-byte alignment of the
    tensors) with a plan goes through Triton's JIT, later ones straight to the compiled kernel's launcher."""
    plan.launch(args, _compiled_launch(args[0]))


def _compiled_launch(values: torch.Tensor) -> bool:
    """True when the launch runs a compiled kernel (CUDA values), not the interpreter."""
    return values.is_cuda


_scale_sizes = functools.lru_cache(maxsize=256)(scale_sizes)


def _allocate(values: torch.Tensor, padded_total: int, hdim: bool, seq: bool, square: bool):
    t, heads, d = values.shape
    hdim_bytes, seq_bytes = _scale_sizes(padded_total, d)
    dev = values.device
    payloads, scales = {}, {}
    for name, want in (("hdim", hdim), ("seq", seq), ("square", square)):
        if want:
            payloads[name] = torch.empty(t, heads, d, dtype=PAYLOAD_DTYPE, device=dev)
    for name, want, nbytes in (("hdim", hdim, hdim_bytes), ("seq", seq, seq_bytes),
                               ("square_hdim", square, hdim_bytes), ("square_seq", square, seq_bytes)):
        if want:
            scales[name] = torch.empty(heads, nbytes, dtype=torch.uint8, device=dev)
    return payloads, scales


def _flat(payloads: dict, scales: dict) -> list[torch.Tensor]:
    """Fixed output order of the op: per requested orientation, its payload then its scale(s)."""
    out = []
    for name, scale_names in (("hdim", ("hdim",)), ("seq", ("seq",)), ("square", ("square_hdim", "square_seq"))):
        if name in payloads:
            out.append(payloads[name])
            out.extend(scales[s] for s in scale_names)
    return out


def _jagged_mx_quantize_impl(values: torch.Tensor, offsets: torch.Tensor, scale_offsets: torch.Tensor,
                             tile_seq: torch.Tensor, tile_tokens: torch.Tensor, padded_total: int, hdim: bool,
                             seq: bool, square: bool, rceil: bool) -> list[torch.Tensor]:
    """Jagged MX quantization in one launch; returns, for each requested orientation in the order hdim, seq,
    square: its payload `[T, H, D]` float8_e4m3fn and its blocked scales `[H, bytes]` uint8 (square: the
    hdim form, then the seq form)."""
    payloads, scales = _allocate(values, padded_total, hdim, seq, square)
    if padded_total:
        grid, args, plan = _plan_and_args(values, offsets, scale_offsets, tile_seq, padded_total, payloads,
                                          scales, rceil, tile_tokens=tile_tokens)
        _run(args, plan)
    return _flat(payloads, scales)


# The custom op is what traced and compiled graphs call; eager calls skip its dispatch (`skips_dispatch`).
jagged_mx_quantize = torch.library.custom_op("gem_lp::jagged_mx_quantize", _jagged_mx_quantize_impl,
                                             mutates_args=())


@jagged_mx_quantize.register_fake
def _(values, offsets, scale_offsets, tile_seq, tile_tokens, padded_total, hdim, seq, square, rceil):
    payloads, scales = _allocate(values, padded_total, hdim, seq, square)
    return _flat(payloads, scales)


def quantize_jagged_triton(values: torch.Tensor, layout, orientations: tuple[str, ...], scaling: str):
    """Triton backend of `quantize_jagged` (arguments already checked there)."""
    hdim, seq, square = "hdim" in orientations, "seq" in orientations, "square" in orientations
    args = (values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.tile_tokens, layout.padded_total,
            hdim, seq, square, scaling == "rceil")
    direct = skips_dispatch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.tile_tokens)
    outs = iter(_jagged_mx_quantize_impl(*args) if direct else jagged_mx_quantize(*args))
    t, heads, d = values.shape
    jmx = JaggedMXTensor(layout, scaling, values.dtype, heads, d)
    if hdim:
        jmx.payload_hdim, jmx.scale_hdim = next(outs), next(outs)
    if seq:
        jmx.payload_seq, jmx.scale_seq = next(outs), next(outs)
    if square:
        jmx.payload_square, jmx.scale_square_hdim, jmx.scale_square_seq = next(outs), next(outs), next(outs)
    return jmx
