"""Jagged attention in Triton, forward and backward, BF16 and exact MXFP8 (LP-FA4 recipe, docs/numerics.md).

Hopper has no block-scaled MMA, but every MX value (E4M3 x 2^k) is exact in BF16. So the default path
("producer") is:

1. a memory-bound producer pass (`_operand_kernel`, one launch for K, V forward, or Q, K, V, dO backward):
   read each `[T, H, D]` once, quantize each MX block (hdim 1x32 along D, seq 32 tokens x 1 feature,
   square 32x32; token blocks aligned to each sequence's first token), and write the dequantized, MX-exact
   BF16 operand; the dO slot also writes Δ = rowsum(dO ⊙ O) of the rounded dO (minus dLSE when the LSE has a
   gradient).
   The forward's Q goes through the same pass (default); `q_in_kernel=True` rounds it in the kernel's
   prologue instead (`_operand_tile`, the same bits), which measured slower on the H200 (the prologue's
   register cost outweighs a third of the pass). Two kernels write the same bits:
   `producer="strips"` (default; `_operand_strips_kernel`, a program per 32-128-token chunk of one head,
   each thread a strip of tokens x 8 features as in the jagged quantize kernel) and `"blocks"`
   (`_operand_kernel`, a program per 32-token block of 4 heads);
2. BF16 flash kernels that round P (and, backward, dS) to the recipe's grid in registers: `const_p`
   e4m3(256 p) with the fixed scale 2^-8, `dynamic` 1x32 blocks along kv (forward) or 32x32 blocks
   (backward) with the rceil rule; dS in 32x32 blocks. The rounding is one FP32 add and subtract of a
   magic number per element (`_grid_round`: exact round-to-nearest-even on the E4M3 grid of the block's
   scale), not a `cvt` to FP8 and back, which runs at a quarter rate beside exp2 and halved the speed.
   With `precision="bf16"` the same kernels round P and dS to the operand dtype instead.

Forward variants of the same kernel, for measurement (`variant=`): `"dequant_in_loop"` loads the E4M3
payloads and the E8M0 bytes of `gem_lp.jagged.quantize_jagged` (blocked, per-sequence padded scales) and
dequantizes Q, K, V tiles in registers; `"fp8_qk"` computes QK^T as FP8 `tl.dot`s per 32-wide chunk of D,
each promoted into the FP32 scores by the product of the two E8M0 scales (V from the producer).
`warp_specialize=True` runs the KV loop as `tl.range(..., warp_specialize=True)`.

Scheduling: one launch covers every sequence and head. A tile map (`tile_seq`, `tile_idx`), built on
the device without a host sync, sends program i to one BLOCK_M-query tile of one sequence, largest
work first; tiles never cross sequences, so 32-token MX blocks stay aligned to sequence starts; causal
tiles skip fully masked KV tiles. Backward (`bwd_variant="split"`): a key-tile kernel accumulates dK,
dV in registers (in the transposed form S^T = K Q^T), a query-tile kernel accumulates dQ; no atomics.
With `broadcast_q` (one query sequence shared by every sequence) the query-tile kernel writes one FP32
partial dQ per sequence, and torch sums them. With `bwd_variant="atomic"` the key-tile kernel adds dQ
atomically into an FP32 buffer, or an FP16 one holding dQ times a static scale.
broadcast_q builds its query-tile map directly (`_broadcast_tiles`: every sequence has the same Lq), and
`kv_in_kernel=True` rounds K and V in the forward loop instead of the producer pass: with Lq <= BLOCK_M
each KV tile is read by one program, so K and V cross HBM once instead of three times.

Numerics against `reference.py` (same precision): the kernel's softmax is online, so it rounds p
relative to the running row max and rescales, while the reference rounds p relative to the final max.
Each rounded element is within one rounding of p on both sides: |P_kernel - P_ref| <= 2 u p + 2 a,
with u = 2^-4, a = 2^-18 (E4M3: half a step in 3 mantissa bits; the subnormal half-step 2^-10 of the
payload 256 p, or of p's block-max-scaled payload for `dynamic`), u = 2^-8 / a = 0 for BF16 P (2^-11
for FP16). Hence per output element |O_kernel - O_ref| <= (2u Σ_j p_j |v_j| + 2a Σ_j |v_j|) / l plus
the output rounding; the tests check this bound and a tight match against a tile-by-tile model of the
kernel. The backward rounds the same quantities as the reference (P from the final LSE), so it
agrees up to FP32 summation order.

Exactness caveat: dequantized MX values below 2^-133 (blocks whose scale byte is < 5) are not all
representable in BF16 and round; such blocks hold values below 2^-118.

Triton 3.6 interpreter workarounds (selected by the constexpr INTERPRET, so the GPU code is unchanged):
run-time loop bounds become while loops, BF16 dots get FP32 operands, FP32 -> BF16 casts round on the
bits (the interpreter truncates), and E4M3 casts are done in integer arithmetic (`HW_CAST=False`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend import interpreter_enabled, skips_dispatch
from ..mx.triton_numerics import abs_bits, e4m3_bits, encode, inv_scale, scale_byte
from ..mx.triton_quantize import check_strip_launch, max_cols_of_blocks, max_rows_of_blocks, tile_axes
from .layout import check_offsets_form, check_qkv
from .plan import cached_plan

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
PRECISIONS = ("bf16", "mxfp8")
P_QUANTS = ("const_p", "dynamic")
VARIANTS = ("producer", "dequant_in_loop", "fp8_qk")
BWD_VARIANTS = ("split", "atomic")
# Producer pass kernels: the strips kernel takes about 15 sm_90 instructions per element and operand (no
# shared memory), the blocks kernel 21 (and 16 KiB of shared memory for its layout changes); the same
# operand bits.
PRODUCERS = ("blocks", "strips")
DEFAULT_PRODUCER = "strips"
DQ_ACCUMS = ("fp32", "fp16")
HEAD_DIMS = (64, 128)
MX_BLOCK = 32

# constexpr codes (ORIENT_AS_IS: an operand the kernel takes as loaded; ORIENT_NONE rounds to BF16)
ORIENT_AS_IS, ORIENT_NONE, ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE = -1, 0, 1, 2, 3
PQ_NONE, PQ_CONST, PQ_DYNAMIC = 0, 1, 2
OPERANDS_16BIT, OPERANDS_MX_IN_LOOP, OPERANDS_FP8_QK = 0, 1, 2


# ============================================================================ device helpers


@triton.jit
def _to_f32(x):
    """Exact FP32 of a loaded tile (bf16 widened by its bits: the interpreter's cast flushes subnormals)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """FP32 `x` to `dtype`, round-to-nearest-even. The interpreter truncates FP32 -> BF16, so there the
    rounding is done on the bits first (NaN kept)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """tl.dot(a, b, acc) of 16-bit operands. Triton 3.6's interpreter computes BF16 dots wrongly, so
    there the operands are widened to FP32 first (the same exact products, summed in FP32)."""
    if INTERPRET:
        return tl.dot(_to_f32(a), _to_f32(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _e4m3_value(q):
    """FP32 value of E4M3 bytes `q` (int32), exact. 0x7F/0xFF decode as +-480: they only occur in
    blocks whose scale byte is 255, whose scale value is NaN."""
    e = (q >> 3) & 0xF
    m = q & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((q & 0x80) != 0, -v, v)


@triton.jit
def _payload_value(pay, HW_CAST: tl.constexpr):
    """FP32 value of a uint8 E4M3 payload tile."""
    if HW_CAST:
        return pay.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return _e4m3_value(pay.to(tl.int32))


@triton.jit
def _round_e4m3(y, HW_CAST: tl.constexpr):
    """FP32 `y` (|y| <= 448) rounded to nearest-even E4M3, as FP32. The interpreter's FP8 cast is not
    faithful, so `HW_CAST=False` rounds by integer arithmetic (same result)."""
    if HW_CAST:
        return y.to(tl.float8e4nv).to(tl.float32)
    else:
        return _e4m3_value(e4m3_bits(y))


@triton.jit
def _scale_value(byte):
    """2^(byte - 127) in FP32 of E8M0 bytes (int32): byte 0 -> 2^-127 (subnormal), 255 -> NaN."""
    v = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), v)


@triton.jit
def _mx_round(x, byte, HW_CAST: tl.constexpr):
    """Dequantized MX value of FP32 `x` under E8M0 bytes `byte` (broadcast): exact FP32."""
    y = tl.minimum(tl.maximum(x * inv_scale(byte), -448.0), 448.0)
    return _round_e4m3(y, HW_CAST) * _scale_value(byte)


@triton.jit
def _mx_round_rows(x, R: tl.constexpr, C: tl.constexpr, HW_CAST: tl.constexpr):
    """`[R, C]` FP32 through MXFP8 with 1x32 blocks along dim 1 (rceil), dequantized."""
    xb = tl.reshape(x, [R, C // 32, 32])
    byte = scale_byte(tl.max(abs_bits(xb), axis=2), True)
    return tl.reshape(_mx_round(xb, byte[:, :, None], HW_CAST), [R, C])


@triton.jit
def _mx_round_square(x, R: tl.constexpr, C: tl.constexpr, HW_CAST: tl.constexpr):
    """`[R, C]` FP32 through MXFP8 with 32x32 blocks (rceil, max-abs), dequantized."""
    xb = tl.reshape(x, [R // 32, 32, C // 32, 32])
    byte = scale_byte(tl.max(tl.max(abs_bits(xb), axis=3), axis=1), True)
    return tl.reshape(_mx_round(xb, byte[:, None, :, None], HW_CAST), [R, C])


@triton.jit
def _operand_tile(x, ORIENT: tl.constexpr, R: tl.constexpr, C: tl.constexpr, HW_CAST: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """A loaded `[R, C]` tile of q, k or v (rows: tokens from a 32-aligned offset of one sequence, rows past
    its end loaded as 0) as the BF16 operand the producer pass writes for it, with the same arithmetic, so
    the same bits: ORIENT_HDIM 1x32 blocks along C, ORIENT_SEQ 32x1 blocks along R, ORIENT_NONE plain
    rounding to BF16; ORIENT_AS_IS returns the tile unchanged."""
    if ORIENT == 1:
        xb = tl.reshape(_to_f32(x), [R, C // 32, 32])
        byte = scale_byte(tl.max(abs_bits(xb), axis=2), True)
        return _cast(tl.reshape(_mx_round(xb, byte[:, :, None], HW_CAST), [R, C]), tl.bfloat16, INTERPRET)
    elif ORIENT == 2:
        xb = tl.reshape(_to_f32(x), [R // 32, 32, C])
        byte = scale_byte(tl.max(abs_bits(xb), axis=1), True)
        return _cast(tl.reshape(_mx_round(xb, byte[:, None, :], HW_CAST), [R, C]), tl.bfloat16, INTERPRET)
    elif ORIENT == 0:
        return _cast(_to_f32(x), tl.bfloat16, INTERPRET)
    else:
        return x


@triton.jit
def _grid_round(x, byte):
    """FP32 `x` rounded to nearest-even on the grid of MX values under E8M0 bytes `byte` (int32,
    broadcast): the dequantized MX value, exactly, with no conversion instruction.

    In x's binade 2^e the E4M3 step is 2^(e-3), never finer than the subnormal step 2^(byte-136).
    With C = step * 2^23 > |x|, the sum |x| + C has ulp = step, so `(|x| + C) - C` is |x| rounded to the
    grid, ties to even, by the FP32 adder (full-rate ALU work, where `cvt` to E4M3 and back runs at a
    quarter rate beside exp2). Valid for 8 <= byte < 218 (then every MX normal is an FP32 normal, and
    |x| <= 448 * 2^(byte-127) < 2^100 keeps C finite); callers check. The rceil rule keeps
    |x| / scale <= 448, so no saturation is needed.
    """
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    e = a & 0x7F800000
    c_normal = tl.where(e == 0, 0, e + (20 << 23))  # FP32 subnormals are MX subnormals when byte >= 8
    c = tl.maximum(c_normal, (byte + 14) << 23).to(tl.float32, bitcast=True)
    r = (a.to(tl.float32, bitcast=True) + c) - c
    return tl.where(bits < 0, -r, r)


@triton.jit
def _fast_ok(amax_bits, byte):
    """True when `_grid_round` is exact for every block: bytes in [8, 218), all-zero blocks excepted."""
    bad = ((byte < 8) & (amax_bits != 0)) | (byte >= 218)
    return tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) == 0


@triton.jit
def _mx_round_rows_fast(x, R: tl.constexpr, C: tl.constexpr, HW_CAST: tl.constexpr):
    """`_mx_round_rows` (1x32 blocks along dim 1), by `_grid_round` when every block allows it."""
    xb = tl.reshape(x, [R, C // 32, 32])
    amax = tl.max(abs_bits(xb), axis=2)
    byte = scale_byte(amax, True)
    if _fast_ok(amax, byte):
        y = _grid_round(xb, byte[:, :, None])
    else:
        y = _mx_round(xb, byte[:, :, None], HW_CAST)
    return tl.reshape(y, [R, C])


@triton.jit
def _mx_round_square_fast(x, R: tl.constexpr, C: tl.constexpr, HW_CAST: tl.constexpr):
    """`_mx_round_square` (32x32 blocks), by `_grid_round` when every block allows it."""
    xb = tl.reshape(x, [R // 32, 32, C // 32, 32])
    amax = tl.max(tl.max(abs_bits(xb), axis=3), axis=1)
    byte = scale_byte(amax, True)
    if _fast_ok(amax, byte):
        y = _grid_round(xb, byte[:, None, :, None])
    else:
        y = _mx_round(xb, byte[:, None, :, None], HW_CAST)
    return tl.reshape(y, [R, C])


@triton.jit
def _hdim_scale_offset(row, col, N_COL_BLOCKS: tl.constexpr):
    """Byte of scale (row, col) in the 128x4 blocked layout of an hdim-form matrix [Tp, D/32]."""
    return ((row // 128) * N_COL_BLOCKS + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


@triton.jit
def _seq_scale_offset(feature, col, num_col_tiles):
    """Byte of scale (feature, col) in the blocked layout of a seq-form matrix [D, Tp/32]."""
    return (((feature // 128) * num_col_tiles + col // 4) * 512 + (feature % 32) * 16
            + ((feature % 128) // 32) * 4 + col % 4)


@triton.jit
def _load_hdim_mx(pay_ptr, s_ptr, tok, srow, mask, h, H, s_head_bytes, D: tl.constexpr, HW_CAST: tl.constexpr):
    """Dequantized `[R, D]` FP32 tile of an hdim-quantized jagged tensor (payload [T, H, D], blocked scales)."""
    d = tl.arange(0, D)
    pay = tl.load(pay_ptr + (tok[:, None] * H + h) * D + d[None, :], mask=mask[:, None], other=0)
    soff = _hdim_scale_offset(srow[:, None], (d // 32)[None, :], (D // 32 + 3) // 4)
    byte = tl.load(s_ptr + h * s_head_bytes + soff, mask=mask[:, None], other=0)
    return _payload_value(pay, HW_CAST) * _scale_value(byte.to(tl.int32))


@triton.jit
def _load_seq_mx(pay_ptr, s_ptr, tok, srow, mask, h, H, s_head_bytes, num_col_tiles, D: tl.constexpr,
                 HW_CAST: tl.constexpr):
    """Dequantized `[R, D]` FP32 tile of a seq-quantized jagged tensor (32-token blocks of padded rows)."""
    d = tl.arange(0, D)
    pay = tl.load(pay_ptr + (tok[:, None] * H + h) * D + d[None, :], mask=mask[:, None], other=0)
    soff = _seq_scale_offset(d[None, :], (srow // 32)[:, None], num_col_tiles)
    byte = tl.load(s_ptr + h * s_head_bytes + soff, mask=mask[:, None], other=0)
    return _payload_value(pay, HW_CAST) * _scale_value(byte.to(tl.int32))


@triton.jit
def _load_fp8_chunk(pay_ptr, s_ptr, tok, srow, mask, h, H, s_head_bytes, c: tl.constexpr, D: tl.constexpr):
    """Chunk c (features 32c..32c+31) of an hdim-quantized tensor: FP8 payload `[R, 32]` and scale `[R]` FP32."""
    d = c * 32 + tl.arange(0, 32)
    pay = tl.load(pay_ptr + (tok[:, None] * H + h) * D + d[None, :], mask=mask[:, None], other=0)
    soff = _hdim_scale_offset(srow, c, (D // 32 + 3) // 4)
    byte = tl.load(s_ptr + h * s_head_bytes + soff, mask=mask, other=0)
    return pay.to(tl.float8e4nv, bitcast=True), _scale_value(byte.to(tl.int32))


@triton.jit
def _round_p(p, BM: tl.constexpr, BN: tl.constexpr, P_QUANT: tl.constexpr, SQUARE: tl.constexpr,
             dtype: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """P (in [0, 1]) as the P.V (or P^T.dO) operand, dequantized: `const_p` -> e4m3(256 p) * 2^-8 (byte
    119, always inside `_grid_round`'s range), `dynamic` -> MX blocks (1x32 along dim 1, or 32x32 when
    SQUARE; rceil), none -> rounded to `dtype`."""
    if P_QUANT == 1:
        return _grid_round(p, 119).to(dtype)
    elif P_QUANT == 2:
        if SQUARE:
            return _mx_round_square_fast(p, BM, BN, HW_CAST).to(dtype)
        else:
            return _mx_round_rows_fast(p, BM, BN, HW_CAST).to(dtype)
    else:
        return _cast(p, dtype, INTERPRET)


# ============================================================================ producer pass


@triton.jit
def _produce(x_ptr, out_ptr, o_ptr, delta_ptr, dlse_ptr, blk_seq_ptr, offsets_ptr, blk_offsets_ptr, blk, hh, H,
             D: tl.constexpr, HG: tl.constexpr, ORIENT: tl.constexpr, WRITE_OUT: tl.constexpr,
             DELTA: tl.constexpr, HAS_DLSE: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """One 32-token block (aligned to its sequence's start) of HG heads: the MX-exact operand, and Δ."""
    b = tl.load(blk_seq_ptr + blk)
    if b >= 0:
        end = tl.load(offsets_ptr + b + 1)
        tok = tl.load(offsets_ptr + b) + (blk - tl.load(blk_offsets_ptr + b)) * 32 + tl.arange(0, 32)
        valid = (tok < end)[:, None] & (hh < H)[None, :]  # [32, HG]
        d = tl.arange(0, D)
        off = (tok[:, None, None] * H + hh[None, :, None]) * D + d[None, None, :]  # [32, HG, D]
        x = _to_f32(tl.load(x_ptr + off, mask=valid[:, :, None], other=0.0))
        if WRITE_OUT:
            if ORIENT == 1:  # hdim: 1x32 along D
                xb = tl.reshape(x, [32, HG, D // 32, 32])
                byte = scale_byte(tl.max(abs_bits(xb), axis=3), True)
                y = tl.reshape(_mx_round(xb, byte[:, :, :, None], HW_CAST), [32, HG, D])
            elif ORIENT == 2:  # seq: 32 tokens x 1 feature (padding rows are 0: they never raise the max)
                byte = scale_byte(tl.max(abs_bits(x), axis=0), True)
                y = _mx_round(x, byte[None, :, :], HW_CAST)
            elif ORIENT == 3:  # square: 32 tokens x 32 features
                xb = tl.reshape(x, [32, HG, D // 32, 32])
                byte = scale_byte(tl.max(tl.max(abs_bits(xb), axis=3), axis=0), True)
                y = tl.reshape(_mx_round(xb, byte[None, :, :, None], HW_CAST), [32, HG, D])
            else:  # plain rounding to the operand dtype
                y = x
            tl.store(out_ptr + off, _cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=valid[:, :, None])
            x = y
        if DELTA:  # x is dO as dP = dO V^T sees it (MX-rounded where the operand is), so dS's rows sum to ~0
            o = _to_f32(tl.load(o_ptr + off, mask=valid[:, :, None], other=0.0))
            delta = tl.sum(x * o, axis=2)
            rows = tok[:, None] * H + hh[None, :]
            if HAS_DLSE:
                delta -= tl.load(dlse_ptr + rows, mask=valid, other=0.0)
            tl.store(delta_ptr + rows, delta, mask=valid)


@triton.jit
def _operand_kernel(
    x0, out0, seq0, offs0, boffs0, x1, out1, seq1, offs1, boffs1, x2, out2, seq2, offs2, boffs2,
    x3, out3, seq3, offs3, boffs3, o_ptr, delta_ptr, dlse_ptr, H,
    D: tl.constexpr, HG: tl.constexpr, ORIENT0: tl.constexpr, ORIENT1: tl.constexpr, ORIENT2: tl.constexpr,
    ORIENT3: tl.constexpr, WRITE0: tl.constexpr, WRITE1: tl.constexpr, WRITE2: tl.constexpr,
    WRITE3: tl.constexpr, DELTA_SLOT: tl.constexpr, HAS_DLSE: tl.constexpr, HW_CAST: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The producer pass of up to four jagged tensors in one launch: program_id(2) picks the tensor, each
    with its own 32-token block map; the tensor in DELTA_SLOT (dO) also writes Δ (-1: none)."""
    blk = tl.program_id(0)
    hh = tl.program_id(1) * HG + tl.arange(0, HG)
    t = tl.program_id(2)
    if t == 0:
        _produce(x0, out0, o_ptr, delta_ptr, dlse_ptr, seq0, offs0, boffs0, blk, hh, H, D, HG, ORIENT0, WRITE0,
                 DELTA_SLOT == 0, HAS_DLSE, HW_CAST, INTERPRET)
    elif t == 1:
        _produce(x1, out1, o_ptr, delta_ptr, dlse_ptr, seq1, offs1, boffs1, blk, hh, H, D, HG, ORIENT1, WRITE1,
                 DELTA_SLOT == 1, HAS_DLSE, HW_CAST, INTERPRET)
    elif t == 2:
        _produce(x2, out2, o_ptr, delta_ptr, dlse_ptr, seq2, offs2, boffs2, blk, hh, H, D, HG, ORIENT2, WRITE2,
                 DELTA_SLOT == 2, HAS_DLSE, HW_CAST, INTERPRET)
    else:
        _produce(x3, out3, o_ptr, delta_ptr, dlse_ptr, seq3, offs3, boffs3, blk, hh, H, D, HG, ORIENT3, WRITE3,
                 DELTA_SLOT == 3, HAS_DLSE, HW_CAST, INTERPRET)


@triton.jit
def _produce_strips(x_ptr, out_ptr, o_ptr, delta_ptr, dlse_ptr, chunk_seq_ptr, offsets_ptr, chunk_offsets_ptr,
                    chunk, h, H, D: tl.constexpr, ROWS: tl.constexpr, THREAD_ROWS: tl.constexpr,
                    ROW_BLOCKS_IN_THREAD: tl.constexpr, ORIENT: tl.constexpr, WRITE_OUT: tl.constexpr,
                    DELTA: tl.constexpr, HAS_DLSE: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """`_produce` on one ROWS-token chunk (aligned to its sequence's start) of one head, in thread strips.

    Each thread owns THREAD_ROWS consecutive tokens x 8 consecutive features (`tile_axes` of
    `gem_lp.mx.triton_quantize`): one 16-byte load and store per token row, the 32-token (seq) max mostly
    inside the thread, the 32-feature (hdim) max across 4 lanes. The operand gets the same arithmetic as
    `_produce`, so the same bits; Δ is the same sum in another order.
    """
    b = tl.load(chunk_seq_ptr + chunk)
    if b >= 0:
        tok0 = tl.load(offsets_ptr + b) + (chunk - tl.load(chunk_offsets_ptr + b)) * ROWS
        n_valid = tl.load(offsets_ptr + b + 1) - tok0  # tokens of the sequence in this chunk
        # token t = mb * 32 + c * THREAD_ROWS + r of the chunk, feature f = cb * 32 + g * 8 + e
        g, c, cb, mb, r, e = tile_axes(ROWS // 32, D // 32, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
        t = mb * 32 + c * THREAD_ROWS + r
        valid = t < n_valid
        base = (tok0 * H + h) * D  # int64 start of the chunk's first row; offsets inside it fit in int32
        off = t * (H * D) + (cb * 32 + g * 8 + e)
        x = _to_f32(tl.load(x_ptr + base + off, mask=valid, other=0.0))
        if WRITE_OUT:
            if ORIENT == 1:  # hdim: 1x32 along D
                y = _mx_round(x, scale_byte(max_rows_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD), True), HW_CAST)
            elif ORIENT == 2:  # seq: 32 tokens x 1 feature (rows past the sequence are 0: never the max)
                y = _mx_round(x, scale_byte(max_cols_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD), True), HW_CAST)
            elif ORIENT == 3:  # square: 32 tokens x 32 features
                amax = max_cols_of_blocks(max_rows_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD), ROW_BLOCKS_IN_THREAD)
                y = _mx_round(x, scale_byte(amax, True), HW_CAST)
            else:  # plain rounding to the operand dtype
                y = x
            tl.store(out_ptr + base + off, _cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=valid)
            x = y
        if DELTA:  # x is dO as dP sees it (as in `_produce`); sum over the feature axes (g, cb, e)
            xo = x * _to_f32(tl.load(o_ptr + base + off, mask=valid, other=0.0))
            if ROW_BLOCKS_IN_THREAD:  # axes (c, cb, mb, g, r, e)
                delta = tl.sum(tl.sum(tl.sum(xo, axis=5, keep_dims=True), axis=3, keep_dims=True), axis=1,
                               keep_dims=True)
            else:  # axes (g, c, cb, mb, r, e)
                delta = tl.sum(tl.sum(tl.sum(xo, axis=5, keep_dims=True), axis=2, keep_dims=True), axis=0,
                               keep_dims=True)
            rows = (tok0 + t) * H + h
            if HAS_DLSE:
                delta -= tl.load(dlse_ptr + rows, mask=valid, other=0.0)
            tl.store(delta_ptr + rows, delta, mask=valid)


@triton.jit
def _operand_strips_kernel(
    x0, out0, seq0, offs0, coffs0, x1, out1, seq1, offs1, coffs1, x2, out2, seq2, offs2, coffs2,
    x3, out3, seq3, offs3, coffs3, o_ptr, delta_ptr, dlse_ptr, H,
    D: tl.constexpr, ROWS: tl.constexpr, THREAD_ROWS: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr,
    ORIENT0: tl.constexpr, ORIENT1: tl.constexpr, ORIENT2: tl.constexpr, ORIENT3: tl.constexpr,
    WRITE0: tl.constexpr, WRITE1: tl.constexpr, WRITE2: tl.constexpr, WRITE3: tl.constexpr,
    DELTA_SLOT: tl.constexpr, HAS_DLSE: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    """`_operand_kernel` in thread strips: program_id(0) = chunk * H + head (heads fastest, so programs
    running together read neighbouring bytes of the same tokens), program_id(1) picks the tensor."""
    pid = tl.program_id(0)
    chunk = pid // H
    h = pid % H
    t = tl.program_id(1)
    if t == 0:
        _produce_strips(x0, out0, o_ptr, delta_ptr, dlse_ptr, seq0, offs0, coffs0, chunk, h, H, D, ROWS, THREAD_ROWS,
                        ROW_BLOCKS_IN_THREAD, ORIENT0, WRITE0, DELTA_SLOT == 0, HAS_DLSE, HW_CAST, INTERPRET)
    elif t == 1:
        _produce_strips(x1, out1, o_ptr, delta_ptr, dlse_ptr, seq1, offs1, coffs1, chunk, h, H, D, ROWS, THREAD_ROWS,
                        ROW_BLOCKS_IN_THREAD, ORIENT1, WRITE1, DELTA_SLOT == 1, HAS_DLSE, HW_CAST, INTERPRET)
    elif t == 2:
        _produce_strips(x2, out2, o_ptr, delta_ptr, dlse_ptr, seq2, offs2, coffs2, chunk, h, H, D, ROWS, THREAD_ROWS,
                        ROW_BLOCKS_IN_THREAD, ORIENT2, WRITE2, DELTA_SLOT == 2, HAS_DLSE, HW_CAST, INTERPRET)
    else:
        _produce_strips(x3, out3, o_ptr, delta_ptr, dlse_ptr, seq3, offs3, coffs3, chunk, h, H, D, ROWS, THREAD_ROWS,
                        ROW_BLOCKS_IN_THREAD, ORIENT3, WRITE3, DELTA_SLOT == 3, HAS_DLSE, HW_CAST, INTERPRET)


# ============================================================================ forward


@triton.jit
def _fwd_step(acc, l_i, m_i, q, q0, q1, q2, q3, sq0, sq1, sq2, sq3,
              k_ptr, v_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, kv_row0, kv_srow0, Lk, start_n, offs_m, shift,
              h, H, qk_scale, k_scale_head, v_scale_head, v_num_tiles,
              D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              P_QUANT: tl.constexpr, OPERANDS: tl.constexpr, KV_ROUND: tl.constexpr, KV_TMA: tl.constexpr,
              HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """One KV tile of the online softmax: returns the updated (acc, l_i, m_i).

    KV_ROUND (OPERANDS == 0): `ORIENT_AS_IS` when k_ptr, v_ptr hold the operands; `ORIENT_HDIM` when they
    hold the raw K, V and each tile is rounded here (K 1x32 along D, V 32 tokens x 1 feature: the tile
    starts BN tokens apart from its sequence's start, so its 32-token blocks are the producer's);
    `ORIENT_NONE` rounds both to BF16. KV_TMA: full (unmasked) K and V tiles come through the host-side
    tensor descriptors k_desc, v_desc (`[Tk, H*D]`, block [BN, D]: a TMA copy on Hopper); masked tiles,
    and every tile without KV_TMA, through pointer loads."""
    offs_n = start_n + tl.arange(0, BN)
    n_mask = offs_n < Lk
    tok = kv_row0 + offs_n
    d = tl.arange(0, D)
    kv_off = (tok[:, None] * H + h) * D + d[None, :]
    # ---- S = Q K^T, in the log2 domain (qk_scale = softmax_scale * log2 e)
    if OPERANDS == 2:
        srow = kv_srow0 + offs_n
        k0, sk0 = _load_fp8_chunk(k_ptr, k_scale_ptr, tok, srow, n_mask, h, H, k_scale_head, 0, D)
        k1, sk1 = _load_fp8_chunk(k_ptr, k_scale_ptr, tok, srow, n_mask, h, H, k_scale_head, 1, D)
        s = tl.dot(q0, tl.trans(k0)) * sq0[:, None] * sk0[None, :]
        s += tl.dot(q1, tl.trans(k1)) * sq1[:, None] * sk1[None, :]
        if D == 128:
            k2, sk2 = _load_fp8_chunk(k_ptr, k_scale_ptr, tok, srow, n_mask, h, H, k_scale_head, 2, D)
            k3, sk3 = _load_fp8_chunk(k_ptr, k_scale_ptr, tok, srow, n_mask, h, H, k_scale_head, 3, D)
            s += tl.dot(q2, tl.trans(k2)) * sq2[:, None] * sk2[None, :]
            s += tl.dot(q3, tl.trans(k3)) * sq3[:, None] * sk3[None, :]
    else:
        if OPERANDS == 1:
            k = _load_hdim_mx(k_ptr, k_scale_ptr, tok, kv_srow0 + offs_n, n_mask, h, H, k_scale_head, D,
                              HW_CAST).to(tl.bfloat16)
        elif MASKED:
            k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        elif KV_TMA:
            k = k_desc.load([(kv_row0 + start_n).to(tl.int32), h * D])
        else:
            k = tl.load(k_ptr + kv_off)
        k = _operand_tile(k, KV_ROUND, BN, D, HW_CAST, INTERPRET)
        s = _dot(q, tl.trans(k), None, INTERPRET) * qk_scale
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
    # ---- online softmax (fully masked rows keep m = -inf; their p are exp2(-inf) = 0)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    # ---- P V with P on the recipe's grid
    if OPERANDS == 1:
        v = _load_seq_mx(v_ptr, v_scale_ptr, tok, kv_srow0 + offs_n, n_mask, h, H, v_scale_head, v_num_tiles,
                         D, HW_CAST).to(tl.bfloat16)
    elif MASKED:
        v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    elif KV_TMA:
        v = v_desc.load([(kv_row0 + start_n).to(tl.int32), h * D])
    else:
        v = tl.load(v_ptr + kv_off)
    if OPERANDS == 0:
        if KV_ROUND == 1:  # V's MX blocks run along the sequence
            v = _operand_tile(v, 2, BN, D, HW_CAST, INTERPRET)
        else:
            v = _operand_tile(v, KV_ROUND, BN, D, HW_CAST, INTERPRET)
    acc = _dot(_round_p(p, BM, BN, P_QUANT, False, v.dtype, HW_CAST, INTERPRET), v, acc, INTERPRET)
    return acc, l_i, m_new


@triton.jit
def sequence_bounds(o_offsets_ptr, kv_offsets_ptr, b):
    """(first output row, Lq, first kv row, Lk) of sequence `b`."""
    o_row0 = tl.load(o_offsets_ptr + b)
    kv_row0 = tl.load(kv_offsets_ptr + b)
    return o_row0, tl.load(o_offsets_ptr + b + 1) - o_row0, kv_row0, tl.load(kv_offsets_ptr + b + 1) - kv_row0


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, o_ptr, lse_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    q_base_ptr, o_offsets_ptr, kv_offsets_ptr, q_srow_ptr, kv_srow_ptr, tile_seq_ptr, tile_idx_ptr,
    H, qk_scale, q_scale_head, k_scale_head, v_scale_head, v_num_tiles,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, P_QUANT: tl.constexpr,
    OPERANDS: tl.constexpr, Q_ROUND: tl.constexpr, KV_ROUND: tl.constexpr, KV_TMA: tl.constexpr,
    HW_CAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One BM-query tile of one sequence and head: O (input dtype) and LSE (FP32, natural log).

    Q_ROUND (OPERANDS == 0): `ORIENT_AS_IS` when q_ptr holds the Q operand, else the orientation the
    prologue rounds the raw Q tile to (`_operand_tile`: the producer pass's bits, read once per program).
    KV_ROUND: the same for K and V in the loop (`_fwd_step`); KV_TMA: full K, V tiles through k_desc, v_desc."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + pid)
    if b < 0:
        return
    qt = tl.load(tile_idx_ptr + pid)
    o_row0, Lq, kv_row0, Lk = sequence_bounds(o_offsets_ptr, kv_offsets_ptr, b)
    shift = Lk - Lq  # causal: query i sees keys j <= i + shift
    offs_m = qt * BM + tl.arange(0, BM)
    m_mask = offs_m < Lq
    d = tl.arange(0, D)
    q_tok = tl.load(q_base_ptr + b) + offs_m

    q = tl.zeros([BM, D], dtype=tl.bfloat16)
    q0 = tl.zeros([BM, 32], dtype=tl.float8e4nv)
    q1 = q0
    q2 = q0
    q3 = q0
    sq0 = tl.zeros([BM], dtype=tl.float32)
    sq1 = sq0
    sq2 = sq0
    sq3 = sq0
    kv_srow0 = 0
    if OPERANDS == 0:
        q = tl.load(q_ptr + (q_tok[:, None] * H + h) * D + d[None, :], mask=m_mask[:, None], other=0.0)
        q = _operand_tile(q, Q_ROUND, BM, D, HW_CAST, INTERPRET)
    elif OPERANDS == 1:
        q_srow = tl.load(q_srow_ptr + b) + offs_m
        q = _load_hdim_mx(q_ptr, q_scale_ptr, q_tok, q_srow, m_mask, h, H, q_scale_head, D, HW_CAST).to(tl.bfloat16)
        kv_srow0 = tl.load(kv_srow_ptr + b)
    else:
        q_srow = tl.load(q_srow_ptr + b) + offs_m
        q0, sq0 = _load_fp8_chunk(q_ptr, q_scale_ptr, q_tok, q_srow, m_mask, h, H, q_scale_head, 0, D)
        q1, sq1 = _load_fp8_chunk(q_ptr, q_scale_ptr, q_tok, q_srow, m_mask, h, H, q_scale_head, 1, D)
        if D == 128:
            q2, sq2 = _load_fp8_chunk(q_ptr, q_scale_ptr, q_tok, q_srow, m_mask, h, H, q_scale_head, 2, D)
            q3, sq3 = _load_fp8_chunk(q_ptr, q_scale_ptr, q_tok, q_srow, m_mask, h, H, q_scale_head, 3, D)
        sq0 = sq0 * qk_scale
        sq1 = sq1 * qk_scale
        sq2 = sq2 * qk_scale
        sq3 = sq3 * qk_scale
        kv_srow0 = tl.load(kv_srow_ptr + b)

    # KV tiles [0, full_end) need no mask; [full_end, end) are masked (sequence end, causal diagonal)
    if CAUSAL:
        end = tl.minimum(tl.maximum(tl.minimum(qt * BM + BM, Lq) + shift, 0), Lk)
        full_end = tl.minimum(tl.maximum(qt * BM + shift + 1, 0), Lk) // BN * BN
    else:
        end = Lk
        full_end = Lk // BN * BN
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot take run-time range bounds; a while loop is the same walk
        start_n = 0
        while start_n < end:
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, q0, q1, q2, q3, sq0, sq1, sq2, sq3,
                                      k_ptr, v_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, kv_row0, kv_srow0, Lk,
                                      start_n, offs_m, shift, h, H, qk_scale, k_scale_head, v_scale_head, v_num_tiles,
                                      D, BM, BN, start_n >= full_end, CAUSAL, P_QUANT, OPERANDS, KV_ROUND, KV_TMA,
                                      HW_CAST, INTERPRET)
            start_n += BN
    else:
        if WARP_SPECIALIZE:
            for start_n in tl.range(0, full_end, BN, warp_specialize=True):
                acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, q0, q1, q2, q3, sq0, sq1, sq2, sq3,
                                      k_ptr, v_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, kv_row0, kv_srow0, Lk,
                                      start_n, offs_m, shift, h, H, qk_scale, k_scale_head, v_scale_head, v_num_tiles,
                                      D, BM, BN, False, CAUSAL, P_QUANT, OPERANDS, KV_ROUND, KV_TMA,
                                      HW_CAST, INTERPRET)
        else:
            for start_n in tl.range(0, full_end, BN):
                acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, q0, q1, q2, q3, sq0, sq1, sq2, sq3,
                                      k_ptr, v_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, kv_row0, kv_srow0, Lk,
                                      start_n, offs_m, shift, h, H, qk_scale, k_scale_head, v_scale_head, v_num_tiles,
                                      D, BM, BN, False, CAUSAL, P_QUANT, OPERANDS, KV_ROUND, KV_TMA,
                                      HW_CAST, INTERPRET)
        for start_n in tl.range(full_end, end, BN):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, q0, q1, q2, q3, sq0, sq1, sq2, sq3,
                                      k_ptr, v_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, kv_row0, kv_srow0, Lk,
                                      start_n, offs_m, shift, h, H, qk_scale, k_scale_head, v_scale_head, v_num_tiles,
                                      D, BM, BN, True, CAUSAL, P_QUANT, OPERANDS, KV_ROUND, KV_TMA,
                                      HW_CAST, INTERPRET)

    empty = l_i == 0.0
    denom = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(denom)) * 0.6931471805599453)
    o = acc / denom[:, None]
    o_tok = o_row0 + offs_m
    tl.store(o_ptr + (o_tok[:, None] * H + h) * D + d[None, :], _cast(o, o_ptr.dtype.element_ty, INTERPRET),
             mask=m_mask[:, None])
    tl.store(lse_ptr + o_tok * H + h, lse, mask=m_mask)


# ============================================================================ backward
#
# Non-broadcast: `_attn_bwd_kv_kernel` (one program per BLOCK_N-key tile: dK, dV in registers, computed in
# the transposed form S^T = K Q^T so that P^T and dS^T are register A-operands of their GEMMs) and
# `_attn_bwd_q_kernel` (one program per BLOCK_M-query tile: dQ in registers). No atomics, 7 GEMMs per
# tile pair; broadcast_q: the dQ kernel writes a partial dQ per sequence. `bwd_variant="atomic"`: the
# key-tile kernel also adds dS K into a dQ buffer with atomics (5 GEMMs) and there is no dQ kernel.


@triton.jit
def _bwd_kv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_row0, o_row0, Lq, start_m,
                 offs_n, n_mask, shift, h, H, qk_scale, sm_scale, dq_static_scale,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, P_QUANT: tl.constexpr,
                 DS_MX: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_FP16: tl.constexpr, HW_CAST: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """One query tile against the program's key tile: returns the updated (dK, dV) `[BN, D]`."""
    d = tl.arange(0, D)
    offs_m = start_m + tl.arange(0, BM)
    m_mask = offs_m < Lq
    q_tok = q_row0 + offs_m
    o_tok = o_row0 + offs_m
    q = tl.load(q_ptr + (q_tok[:, None] * H + h) * D + d[None, :], mask=m_mask[:, None], other=0.0)
    do = tl.load(do_ptr + (o_tok[:, None] * H + h) * D + d[None, :], mask=m_mask[:, None], other=0.0)
    s_t = _dot(k, tl.trans(q), None, INTERPRET) * qk_scale  # [BN, BM]
    # P^T = exp(S^T * scale - LSE), recomputed; queries without visible keys (LSE = -inf) give 0. LSE and Δ are
    # loaded next to their uses (the pipelined copies still go ahead; only the reads from shared memory move):
    # at D=128 BLOCK_N=64 each is 16 registers a thread, which otherwise stay live across the GEMMs
    lse = tl.load(lse_ptr + o_tok * H + h, mask=m_mask, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    visible = n_mask[:, None] & m_mask[None, :]
    if CAUSAL:
        visible = visible & (offs_n[:, None] <= offs_m[None, :] + shift)
    p_t = tl.where(visible, tl.math.exp2(s_t - lse2[None, :]), 0.0)
    dv = _dot(_round_p(p_t, BN, BM, P_QUANT, True, do.dtype, HW_CAST, INTERPRET), do, dv, INTERPRET)
    dp_t = _dot(v, tl.trans(do), None, INTERPRET)
    delta = tl.load(delta_ptr + o_tok * H + h, mask=m_mask, other=0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if DS_MX:  # 32x32 blocks: the same blocks as dS's, transposed
        ds_op = _mx_round_square_fast(ds_t, BN, BM, HW_CAST).to(q.dtype)
    else:
        ds_op = _cast(ds_t, q.dtype, INTERPRET)
    dk = _dot(ds_op, q, dk, INTERPRET)
    if ATOMIC_DQ:
        dq = _dot(tl.trans(ds_op), k, None, INTERPRET) * sm_scale
        dq_off = (q_tok[:, None] * H + h) * D + d[None, :]
        # relaxed: the adds need no ordering among themselves (the kernel's end publishes them); the default
        # acq_rel fences every one of them
        if DQ_FP16:
            tl.atomic_add(dq_ptr + dq_off, (dq * dq_static_scale).to(tl.float16), mask=m_mask[:, None],
                          sem="relaxed")
        else:
            tl.atomic_add(dq_ptr + dq_off, dq, mask=m_mask[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
    dk_pay_ptr, dk_s_hdim_ptr, dk_s_seq_ptr, dv_pay_ptr, dv_s_hdim_ptr, dv_s_seq_ptr,
    q_base_ptr, o_offsets_ptr, kv_offsets_ptr, kv_srow_ptr, tile_seq_ptr, tile_idx_ptr,
    H, qk_scale, sm_scale, dq_static_scale, s_hdim_head, s_seq_head, s_num_col_tiles,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, P_QUANT: tl.constexpr,
    DS_MX: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_FP16: tl.constexpr, MX_GRADS: tl.constexpr,
    HW_CAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One BN-key tile of one sequence and head: dK, dV over all query tiles (and dQ by atomics)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + pid)
    if b < 0:
        return
    kt = tl.load(tile_idx_ptr + pid)
    o_row0, Lq, kv_row0, Lk = sequence_bounds(o_offsets_ptr, kv_offsets_ptr, b)
    q_row0 = tl.load(q_base_ptr + b)
    shift = Lk - Lq
    offs_n = kt * BN + tl.arange(0, BN)
    n_mask = offs_n < Lk
    d = tl.arange(0, D)
    kv_tok = kv_row0 + offs_n
    kv_off = (kv_tok[:, None] * H + h) * D + d[None, :]
    k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    start = 0
    if CAUSAL:  # the first query that sees key kt*BN is kt*BN - shift
        start = tl.maximum(kt * BN - shift, 0) // BM * BM
    if INTERPRET:  # the interpreter cannot take run-time range bounds; a while loop is the same walk
        start_m = start
        while start_m < Lq:
            dk, dv = _bwd_kv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_row0, o_row0, Lq,
                                  start_m, offs_n, n_mask, shift, h, H, qk_scale, sm_scale, dq_static_scale,
                                  D, BM, BN, CAUSAL, P_QUANT, DS_MX, ATOMIC_DQ, DQ_FP16, HW_CAST, INTERPRET)
            start_m += BM
    else:
        for start_m in tl.range(start, Lq, BM):
            dk, dv = _bwd_kv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_row0, o_row0, Lq,
                                  start_m, offs_n, n_mask, shift, h, H, qk_scale, sm_scale, dq_static_scale,
                                  D, BM, BN, CAUSAL, P_QUANT, DS_MX, ATOMIC_DQ, DQ_FP16, HW_CAST, INTERPRET)
    dk = dk * sm_scale
    # store addresses from a 64-bit scalar base and 32-bit rows, not the loads' int64 `kv_off` (reused, its 16
    # registers a thread stayed live across the loop: with Δ's, the default sm_90 build spilled 92 bytes)
    kv_base = ((kv_row0 + kt * BN) * H + h) * D
    kv_rows = (tl.arange(0, BN) * (H * D))[:, None]
    if MX_GRADS:
        _store_square_mx(dk, dk_pay_ptr, dk_s_hdim_ptr, dk_s_seq_ptr, kv_tok, n_mask, kv_srow_ptr, b, kt, Lk, h, H,
                         s_hdim_head, s_seq_head, s_num_col_tiles, D, BN, HW_CAST)
        _store_square_mx(dv, dv_pay_ptr, dv_s_hdim_ptr, dv_s_seq_ptr, kv_tok, n_mask, kv_srow_ptr, b, kt, Lk, h, H,
                         s_hdim_head, s_seq_head, s_num_col_tiles, D, BN, HW_CAST)
    else:
        tl.store(dk_ptr + kv_base + kv_rows + d[None, :], _cast(dk, dk_ptr.dtype.element_ty, INTERPRET),
                 mask=n_mask[:, None])
        tl.store(dv_ptr + kv_base + kv_rows + d[None, :], _cast(dv, dv_ptr.dtype.element_ty, INTERPRET),
                 mask=n_mask[:, None])


@triton.jit
def _bwd_q_step(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, Lk, start_n, offs_m, shift, h, H, qk_scale,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                DS_MX: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """One key tile against the program's query tile: returns the updated dQ `[BM, D]` (unscaled)."""
    offs_n = start_n + tl.arange(0, BN)
    n_mask = offs_n < Lk
    d = tl.arange(0, D)
    kv_off = ((kv_row0 + offs_n)[:, None] * H + h) * D + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
    p = tl.math.exp2(_dot(q, tl.trans(k), None, INTERPRET) * qk_scale - lse2[:, None])
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        p = tl.where(visible, p, 0.0)
    dp = _dot(do, tl.trans(v), None, INTERPRET)
    ds = p * (dp - delta[:, None])
    if DS_MX:
        ds_op = _mx_round_square_fast(ds, BM, BN, HW_CAST).to(k.dtype)
    else:
        ds_op = _cast(ds, k.dtype, INTERPRET)
    return _dot(ds_op, k, dq, INTERPRET)


@triton.jit
def _attn_bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    q_base_ptr, o_offsets_ptr, kv_offsets_ptr, tile_seq_ptr, tile_idx_ptr, H, qk_scale, sm_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, DS_MX: tl.constexpr,
    DQ_AT_O_ROWS: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One BM-query tile of one sequence and head: dQ = Σ_kv dS K * scale, in registers, stored at the
    tile's q rows, or (DQ_AT_O_ROWS, broadcast_q) at its output rows: one partial dQ per sequence."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + pid)
    if b < 0:
        return
    qt = tl.load(tile_idx_ptr + pid)
    o_row0, Lq, kv_row0, Lk = sequence_bounds(o_offsets_ptr, kv_offsets_ptr, b)
    shift = Lk - Lq
    offs_m = qt * BM + tl.arange(0, BM)
    m_mask = offs_m < Lq
    d = tl.arange(0, D)
    q_tok = tl.load(q_base_ptr + b) + offs_m
    o_tok = o_row0 + offs_m
    q = tl.load(q_ptr + (q_tok[:, None] * H + h) * D + d[None, :], mask=m_mask[:, None], other=0.0)
    do = tl.load(do_ptr + (o_tok[:, None] * H + h) * D + d[None, :], mask=m_mask[:, None], other=0.0)
    lse = tl.load(lse_ptr + o_tok * H + h, mask=m_mask, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + o_tok * H + h, mask=m_mask, other=0.0)
    if CAUSAL:
        end = tl.minimum(tl.maximum(tl.minimum(qt * BM + BM, Lq) + shift, 0), Lk)
        full_end = tl.minimum(tl.maximum(qt * BM + shift + 1, 0), Lk) // BN * BN
    else:
        end = Lk
        full_end = Lk // BN * BN
    dq = tl.zeros([BM, D], dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot take run-time range bounds; a while loop is the same walk
        start_n = 0
        while start_n < end:
            dq = _bwd_q_step(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, Lk, start_n, offs_m, shift, h, H,
                             qk_scale, D, BM, BN, start_n >= full_end, CAUSAL, DS_MX, HW_CAST, INTERPRET)
            start_n += BN
    else:
        for start_n in tl.range(0, full_end, BN):
            dq = _bwd_q_step(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, Lk, start_n, offs_m, shift, h, H,
                             qk_scale, D, BM, BN, False, CAUSAL, DS_MX, HW_CAST, INTERPRET)
        for start_n in tl.range(full_end, end, BN):
            dq = _bwd_q_step(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, Lk, start_n, offs_m, shift, h, H,
                             qk_scale, D, BM, BN, True, CAUSAL, DS_MX, HW_CAST, INTERPRET)
    dq_tok = o_tok if DQ_AT_O_ROWS else q_tok
    tl.store(dq_ptr + (dq_tok[:, None] * H + h) * D + d[None, :], _cast(dq * sm_scale, dq_ptr.dtype.element_ty,
             INTERPRET), mask=m_mask[:, None])


@triton.jit
def _store_square_mx(x, pay_ptr, s_hdim_ptr, s_seq_ptr, tok, n_mask, srow_ptr, b, kt, Lk, h, H,
                     s_hdim_head, s_seq_head, num_col_tiles, D: tl.constexpr, BN: tl.constexpr,
                     HW_CAST: tl.constexpr):
    """Store `[BN, D]` FP32 as MXFP8 32x32 blocks in `gem_lp.jagged`'s format: payload [T, H, D] and the
    square scales in both blocked forms (rows past the sequence keep their zero padding)."""
    xb = tl.reshape(x, [BN // 32, 32, D // 32, 32])
    byte = scale_byte(tl.max(tl.max(abs_bits(xb), axis=3), axis=1), True)  # [BN/32, D/32]
    pay = tl.reshape(encode(xb, byte[:, None, :, None], HW_CAST), [BN, D])
    d = tl.arange(0, D)
    tl.store(pay_ptr + (tok[:, None] * H + h) * D + d[None, :], pay, mask=n_mask[:, None])
    srow = tl.load(srow_ptr + b) + kt * BN + tl.arange(0, BN)  # padded scale rows of this tile
    on_rows = tl.reshape(tl.broadcast_to(byte[:, None, :], [BN // 32, 32, D // 32]), [BN, D // 32])
    c = tl.arange(0, D // 32)
    hoff = _hdim_scale_offset(srow[:, None], c[None, :], (D // 32 + 3) // 4)
    tl.store(s_hdim_ptr + h * s_hdim_head + hoff, on_rows.to(tl.uint8), mask=n_mask[:, None])
    j = tl.arange(0, BN // 32)
    jmask = kt * BN + j * 32 < Lk
    col = (tl.load(srow_ptr + b) + kt * BN) // 32 + j  # 32-token block columns of the seq form
    on_features = tl.reshape(tl.broadcast_to(byte[:, :, None], [BN // 32, D // 32, 32]), [BN // 32, D])
    soff = _seq_scale_offset(d[None, :], col[:, None], num_col_tiles)
    tl.store(s_seq_ptr + h * s_seq_head + soff, on_features.to(tl.uint8), mask=jmask[:, None])


# ============================================================================ host: geometry and tile maps


class _Geometry:
    """Device-side description of one batch (no host sync): int64 offsets and per-sequence row starts.

    Attributes:
        batch: B. q_offsets: `[B+1]` offsets into q's rows (`[0, Lq]` for broadcast_q).
        kv_offsets: `[B+1]`. o_offsets: `[B+1]` output rows (`b * Lq` for broadcast_q).
        q_base: `[B]` first q row of each sequence (0 for broadcast_q). num_out: output rows.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                 broadcast_q: bool):
        dev = q.device
        self.kv_offsets = kv_offsets.to(device=dev, dtype=torch.int64).contiguous()
        self.batch = self.kv_offsets.numel() - 1
        self.broadcast_q = broadcast_q
        if broadcast_q:
            lq = q.shape[0]
            # built on the device: torch.tensor(..., device=cuda) is a blocking copy (a host sync per call)
            self.q_offsets = torch.arange(2, dtype=torch.int64, device=dev) * lq
            self.o_offsets = torch.arange(self.batch + 1, dtype=torch.int64, device=dev) * lq
            self.q_base = torch.zeros(self.batch, dtype=torch.int64, device=dev)
            self.num_out = self.batch * lq
        else:
            self.q_offsets = q_offsets.to(device=dev, dtype=torch.int64).contiguous()
            self.o_offsets = self.q_offsets
            self.q_base = self.q_offsets[:-1].contiguous()
            self.num_out = q.shape[0]
        self.q_rows, self.kv_rows = q.shape[0], k.shape[0]

    def q_lengths(self) -> torch.Tensor:
        return self.o_offsets[1:] - self.o_offsets[:-1]

    def kv_lengths(self) -> torch.Tensor:
        return self.kv_offsets[1:] - self.kv_offsets[:-1]


def _tile_map(lengths: torch.Tensor, block: int, upper: int, work_of) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of `block` rows of every sequence, `[upper]` int32 (sequence, tile index), most work first.

    `upper` bounds the number of tiles (sum of ceil(L/block) <= rows/block + B), so the grid needs no
    host sync; the slots past the real tiles hold sequence -1 and their programs return at once.
    """
    batch = lengths.numel()
    nt = (lengths + block - 1) // block
    cum = torch.cumsum(nt, 0)
    t = torch.arange(upper, device=lengths.device)
    seq = torch.searchsorted(cum, t, right=True)
    valid = seq < batch
    seq = seq.clamp(max=batch - 1)
    idx = t - (cum[seq] - nt[seq])
    work = torch.where(valid, work_of(seq, idx), torch.full_like(idx, -1))
    order = torch.argsort(work, descending=True, stable=True)
    tile_seq = torch.where(valid, seq, torch.full_like(seq, -1))[order]
    return tile_seq.to(torch.int32).contiguous(), idx[order].to(torch.int32).contiguous()


def _broadcast_tiles(g: _Geometry, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The query tiles of broadcast_q: every sequence has the same Lq (a host integer), so the tiles are
    known without a search, B * ceil(Lq / block_m) of them: sequences in order of decreasing Lk (their
    work), each one's last query tile (the most keys under causal) first; a few device ops, no host sync."""
    n_tiles = triton.cdiv(g.q_rows, block_m)
    order = torch.argsort(g.kv_lengths(), descending=True, stable=True).to(torch.int32)
    tile_seq = order[:, None].expand(g.batch, n_tiles).reshape(-1)
    tile_idx = torch.arange(n_tiles - 1, -1, -1, dtype=torch.int32, device=order.device).repeat(g.batch)
    return tile_seq, tile_idx, g.batch * n_tiles


def _cached_for_batch(g: _Geometry, key: tuple, build):
    """`build()` once per batch (`plan.cached_plan` on the kv offsets) when the plan is a function of the kv
    offsets alone: self-attention (one offsets tensor) and broadcast_q (Lq a host integer); else built."""
    if g.broadcast_q:
        return cached_plan(g.kv_offsets, key + ("broadcast", g.q_rows, g.kv_rows), build)
    if g.q_offsets is g.kv_offsets:
        return cached_plan(g.kv_offsets, key + ("self", g.q_rows, g.kv_rows), build)
    return build()


def _fwd_tiles(g: _Geometry, block_m: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    return _cached_for_batch(g, ("fwd tiles", block_m, causal), lambda: _build_fwd_tiles(g, block_m, causal))


def _bwd_tiles(g: _Geometry, block_n: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    return _cached_for_batch(g, ("bwd tiles", block_n, causal), lambda: _build_bwd_tiles(g, block_n, causal))


def _block_map(offsets: torch.Tensor, rows: int, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`block`-token chunks aligned to sequence starts: `blk_seq [upper]` int32 (-1 past the last chunk),
    `blk_offsets [B+1]` int64 (first chunk of each sequence), and `upper`; built once per offsets tensor."""
    return cached_plan(offsets, ("block map", rows, block), lambda: _build_block_map(offsets, rows, block))


def _build_fwd_tiles(g: _Geometry, block_m: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    if g.broadcast_q:
        return _broadcast_tiles(g, block_m)
    lq, lk = g.q_lengths(), g.kv_lengths()
    upper = g.num_out // block_m + g.batch

    def work(seq, idx):  # KV columns a query tile visits
        if not causal:
            return lk[seq]
        last = torch.minimum((idx + 1) * block_m, lq[seq])
        return (last + lk[seq] - lq[seq]).clamp(min=0).minimum(lk[seq])

    return (*_tile_map(lq, block_m, upper, work), upper)


def _build_bwd_tiles(g: _Geometry, block_n: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    lq, lk = g.q_lengths(), g.kv_lengths()
    upper = g.kv_rows // block_n + g.batch

    def work(seq, idx):  # query rows a key tile visits
        if not causal:
            return lq[seq]
        first = (idx * block_n - (lk[seq] - lq[seq])).clamp(min=0).minimum(lq[seq])
        return lq[seq] - first

    return (*_tile_map(lk, block_n, upper, work), upper)


def _build_block_map(offsets: torch.Tensor, rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    batch = offsets.numel() - 1
    nb = (offsets[1:] - offsets[:-1] + block - 1) // block
    blk_offsets = torch.zeros(batch + 1, dtype=torch.int64, device=offsets.device)
    blk_offsets[1:] = torch.cumsum(nb, 0)
    upper = rows // block + batch
    t = torch.arange(upper, device=offsets.device)
    seq = torch.searchsorted(blk_offsets[1:], t, right=True)
    blk_seq = torch.where(seq < batch, seq, torch.full_like(seq, -1))
    return blk_seq.to(torch.int32).contiguous(), blk_offsets, upper


def _forward_operands(xs, offsets, orients, hw_cast: bool, producer: str) -> list[torch.Tensor]:
    """q, k, v as the forward kernel reads them: those with `ORIENT_AS_IS` as they are, the others through
    one producer launch."""
    todo = [i for i, o in enumerate(orients) if o != ORIENT_AS_IS]
    ops = list(xs)
    if todo:
        made = _operands([(xs[i], offsets[i], orients[i], True) for i in todo], hw_cast=hw_cast,
                         producer=producer)[0]
        for i, op in zip(todo, made):
            ops[i] = op
    return ops


def _row_tiles(x: torch.Tensor, block_n: int):
    """Host-side tensor descriptor of `[T, H, D]` viewed as `[T, H*D]`, block [block_n, D] (one head's rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, heads, dim = x.shape
    return TensorDescriptor.from_tensor(x.view(t, heads * dim), [block_n, dim])


def _hw_cast(x: torch.Tensor, hw_cast: bool | None) -> bool:
    if hw_cast is None:
        return x.is_cuda and not interpreter_enabled()
    return bool(hw_cast)


def _operands(specs, *, hw_cast: bool, o: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
              producer: str = DEFAULT_PRODUCER, strips=None
              ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Producer pass of up to four `[T, H, D]` tensors (one H and D) in one launch.

    Args:
        specs: list of (x, offsets, orient, write): offsets `[B+1]` int64 on x's device; orient one of
            `ORIENT_*` (`ORIENT_NONE` rounds x to BF16); write=False skips the operand (Δ only).
        o, dlse: with `o`, the last tensor is dO, and Δ `[T, H]` FP32 = rowsum(dO ⊙ O) (- dLSE) is written.
        producer: `"blocks"` (`_operand_kernel`: a program per 32-token block of PRODUCER_HEADS heads) or
            `"strips"` (`_operand_strips_kernel`: a program per ROWS-token chunk of one head, in thread
            strips). The same operand bits; Δ summed in another order.
        strips: the strips launch (rows, thread_rows, row_blocks_in_thread, num_warps); default
            `STRIPS_LAUNCH` (GPU) or `INTERPRETER_STRIPS_LAUNCH`.

    Returns:
        (the BF16 MX-exact operands, None where skipped; Δ or None).
    """
    heads, dim = specs[0][0].shape[1], specs[0][0].shape[2]
    dev = specs[0][0].device
    if producer not in PRODUCERS:
        raise ValueError(f"producer must be one of {PRODUCERS}, got {producer!r}")
    if producer == "strips":
        rows, thread_rows, row_blocks_in_thread, strip_warps = _strips_launch(dev, strips)
        chunk = rows
    else:
        chunk = MX_BLOCK
    outs = [torch.empty(x.shape, dtype=torch.bfloat16, device=dev) if write else None for x, _, _, write in specs]
    last_x = specs[-1][0]
    delta = torch.empty(last_x.shape[0], heads, dtype=torch.float32, device=dev) if o is not None else None
    maps = {}
    for x, offsets, _, _ in specs:  # one chunk map per distinct offsets tensor
        if id(offsets) not in maps:
            maps[id(offsets)] = _block_map(offsets, x.shape[0], chunk)
    upper = max(m[2] for m in maps.values())
    if upper == 0 or all(m[1].numel() == 1 for m in maps.values()):  # no sequence
        if delta is not None:
            delta.zero_()
        return outs, delta
    none = torch.full((upper,), -1, dtype=torch.int32, device=dev)
    args, orients, writes = [], [], []
    for i in range(4):
        if i < len(specs):
            x, offsets, orient, write = specs[i]
            blk_seq, blk_offsets, n = maps[id(offsets)]
            if n < upper:  # programs past this tensor's blocks read -1 and return
                blk_seq = torch.cat([blk_seq, none[: upper - n]])
            args += [x, outs[i] if write else x, blk_seq, offsets, blk_offsets]
            orients.append(orient)
            writes.append(write)
        else:  # unused slot: never launched (grid dim 2 = len(specs))
            args += [last_x, last_x, none, specs[0][1], specs[0][1]]
            orients.append(ORIENT_NONE)
            writes.append(False)
    tail = (o if o is not None else last_x, delta if delta is not None else last_x,
            dlse if dlse is not None else last_x, heads)
    slots = dict(ORIENT0=orients[0], ORIENT1=orients[1], ORIENT2=orients[2], ORIENT3=orients[3],
                 WRITE0=writes[0], WRITE1=writes[1], WRITE2=writes[2], WRITE3=writes[3],
                 DELTA_SLOT=len(specs) - 1 if o is not None else -1, HAS_DLSE=dlse is not None,
                 HW_CAST=hw_cast, INTERPRET=interpreter_enabled())
    if producer == "strips":
        _operand_strips_kernel[(upper * heads, len(specs))](
            *args, *tail, D=dim, ROWS=rows, THREAD_ROWS=thread_rows, ROW_BLOCKS_IN_THREAD=row_blocks_in_thread,
            num_warps=strip_warps, **slots)
    else:
        hg = min(PRODUCER_HEADS, triton.next_power_of_2(heads))
        _operand_kernel[(upper, triton.cdiv(heads, hg), len(specs))](
            *args, *tail, D=dim, HG=hg, num_warps=PRODUCER_WARPS, **slots)
    return outs, delta


# ============================================================================ host: launch configs

# Producer programs: one 32-token block of up to PRODUCER_HEADS heads (16 KiB of BF16 at D=128).
PRODUCER_HEADS = 4
PRODUCER_WARPS = 8
# Strips producer launches (rows, thread_rows, row_blocks_in_thread, num_warps): the default is the jagged
# quantize kernel's measured launch for any set of casts with seq (gem_lp/jagged/triton_kernel.py); the
# candidates are its hdim+seq tuning space, which `benchmarks/bench_attention.py` times (same bits each).
STRIPS_LAUNCH = (32, 8, False, 2)
STRIPS_CANDIDATES = ((32, 8, False, 2), (64, 16, False, 2), (128, 16, False, 4), (64, 8, False, 4),
                     (128, 8, False, 8), (64, 2, True, 2))
# Under the interpreter the cost is per program and per op: few, large programs.
INTERPRETER_STRIPS_LAUNCH = (128, 4, False, 1)


def _strips_launch(device: torch.device, strips) -> tuple[int, int, bool, int]:
    """The strips producer's (rows, thread_rows, row_blocks_in_thread, num_warps), checked."""
    if strips is None:
        return INTERPRETER_STRIPS_LAUNCH if interpreter_enabled() and device.type != "cuda" else STRIPS_LAUNCH
    if len(strips) != 4:
        raise ValueError(f"strips must be (rows, thread_rows, row_blocks_in_thread, num_warps), got {strips!r}")
    rows, thread_rows, row_blocks_in_thread, warps = strips
    check_strip_launch(rows, thread_rows, warps, prefix="strips ")
    return int(rows), int(thread_rows), bool(row_blocks_in_thread), int(warps)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim; the GPU benchmark sweeps alternatives.
# Backward "kv": the key-tile kernel (BLOCK_M = its query step, BLOCK_N = its key tile); "q": the dQ kernel.
# Measured on the H200 (docs/PERF.md): the MXFP8 forward and both backward kernels prefer 4 warps at D=128.
FWD_CONFIGS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
FWD_MX_CONFIGS = {64: (128, 64, 4, 3), 128: (64, 64, 4, 3)}
BWD_KV_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
BWD_Q_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
# Under the interpreter cost is per program and per op: small tiles keep tests quick and multi-tile.
INTERPRETER_CONFIGS = {"fwd": (64, 32, 1, 1), "bwd_kv": (32, 64, 1, 1), "bwd_q": (64, 32, 1, 1)}


def _config(which: str, dim: int, on_gpu: bool, override) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel `which`; 0 entries of `override` keep the default."""
    table = {"fwd": FWD_CONFIGS, "fwd_mx": FWD_MX_CONFIGS, "bwd_kv": BWD_KV_CONFIGS, "bwd_q": BWD_Q_CONFIGS}[which]
    base = table[dim] if on_gpu else INTERPRETER_CONFIGS["fwd" if which == "fwd_mx" else which]
    if not override:
        return base
    override = tuple(override)
    if len(override) > 4:
        raise ValueError(f"a kernel config has at most 4 entries (BLOCK_M, BLOCK_N, num_warps, num_stages), "
                         f"got {override}")
    cfg = tuple(o if o else b for o, b in zip(override + (0,) * (4 - len(override)), base))
    for name, n in (("BLOCK_M", cfg[0]), ("BLOCK_N", cfg[1])):
        if n % MX_BLOCK or n & (n - 1) or n > 128:
            raise ValueError(f"{name} must be 32, 64 or 128 (a power-of-two multiple of {MX_BLOCK}), got {n}")
    return cfg


# ============================================================================ host: forward and backward


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None,
                      kv_offsets: torch.Tensor, *, causal: bool = False, broadcast_q: bool = False,
                      precision: str = "mxfp8", softmax_scale: float | None = None, p_quant: str = "const_p",
                      variant: str = "producer", warp_specialize: bool = False, config=None,
                      q_in_kernel: bool = False, kv_in_kernel: bool = False, kv_tma: bool = False,
                      producer: str = DEFAULT_PRODUCER, hw_cast: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of jagged attention (arguments checked by `jagged_attention_triton`; offsets trusted).

    Args:
        q: `[Tq, H, D]` (`[Lq, H, D]` with broadcast_q), k, v: `[Tk, H, D]`, contiguous, one dtype.
        q_offsets, kv_offsets: `[B+1]` int32/int64 on q's device (q_offsets unused with broadcast_q).
        variant: `"producer"`, `"dequant_in_loop"` or `"fp8_qk"` (mxfp8 only; see module docstring).
        config: optional (BLOCK_M, BLOCK_N, num_warps, num_stages); 0 entries keep the default.
        q_in_kernel: where Q becomes its operand when it needs one (the `"producer"` variant, and FP32
            inputs of the 16-bit recipe): True rounds each Q tile in the kernel's prologue (Q is read once
            per program; K and V, read by every query tile, stay in the producer pass), False (default,
            measured faster) puts Q in the producer pass too. The same bits either way.
        kv_in_kernel: round each K and V tile in the kernel's loop instead of in the producer pass (same
            bits): every query tile rounds it again, but K and V cross HBM once instead of three times.
            For few query tiles per sequence (broadcast_q with Lq <= BLOCK_M: each KV tile is read by one
            program); `"producer"` variant only.
        kv_tma: load the full (unmasked) K and V tiles through host-side TMA tensor descriptors over the
            `[Tk, H*D]` operands (block [BLOCK_N, D]); masked tiles keep pointer loads. Operands taken
            as loaded (`kv_in_kernel` rounds them after the load); `"producer"` variant only.
        producer: the producer pass's kernel, `"blocks"` or `"strips"` (`_operands`; the same bits).
        hw_cast: E4M3 rounding by the hardware cast (default on CUDA) or by integer arithmetic.

    Returns:
        O `[T_out, H, D]` in q's dtype and LSE `[T_out, H]` FP32 (natural log; -inf without keys).
    """
    g = _Geometry(q, k, q_offsets, kv_offsets, broadcast_q)
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty(g.num_out, heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(g.num_out, heads, dtype=torch.float32, device=q.device)
    if g.num_out == 0:
        return out, lse
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    hw = _hw_cast(q, hw_cast)
    bm, bn, warps, stages = _config("fwd_mx" if precision == "mxfp8" else "fwd", dim,
                                    q.is_cuda and not interpreter_enabled(), config)
    dummy_u8 = torch.empty(1, dtype=torch.uint8, device=q.device)
    q_scale = k_scale = v_scale = dummy_u8
    q_srow = kv_srow = g.q_base
    q_head = k_head = v_head = v_tiles = 0
    for name, on in (("kv_in_kernel", kv_in_kernel), ("kv_tma", kv_tma)):
        if on and variant != "producer" and precision == "mxfp8":
            raise ValueError(f"{name}=True needs variant='producer', got {variant!r}")
    q_round = kv_round = ORIENT_AS_IS
    if precision == "bf16" or variant == "producer":
        operands = OPERANDS_16BIT
        if precision == "bf16":
            p_code = PQ_NONE
            # the 16-bit recipe's operands are BF16: FP32 inputs are rounded, 16-bit inputs taken as they are
            orients = (ORIENT_NONE,) * 3 if q.dtype == torch.float32 else (ORIENT_AS_IS,) * 3
        else:
            p_code = PQ_CONST if p_quant == "const_p" else PQ_DYNAMIC
            orients = (ORIENT_HDIM, ORIENT_HDIM, ORIENT_SEQ)
        if q_in_kernel:
            q_round, orients = orients[0], (ORIENT_AS_IS,) + orients[1:]
        if kv_in_kernel:
            kv_round, orients = orients[1], orients[:1] + (ORIENT_AS_IS, ORIENT_AS_IS)
        q_op, k_op, v_op = _forward_operands((q, k, v), (g.q_offsets, g.kv_offsets, g.kv_offsets), orients, hw,
                                             producer)
    else:
        p_code = PQ_CONST if p_quant == "const_p" else PQ_DYNAMIC
        from ..jagged import JaggedLayout, quantize_jagged

        q_layout = JaggedLayout.from_offsets(g.q_offsets, q)
        kv_layout = JaggedLayout.from_offsets(g.kv_offsets, k)
        qj = quantize_jagged(q, q_layout, ("hdim",))
        kj = quantize_jagged(k, kv_layout, ("hdim",))
        q_op, q_scale, q_head = qj.payload_hdim.view(torch.uint8), qj.scale_hdim, qj.scale_hdim.shape[1]
        k_op, k_scale, k_head = kj.payload_hdim.view(torch.uint8), kj.scale_hdim, kj.scale_hdim.shape[1]
        q_srow = (torch.zeros(g.batch, dtype=torch.int64, device=q.device) if broadcast_q
                  else q_layout.scale_offsets[:-1].contiguous())
        kv_srow = kv_layout.scale_offsets[:-1].contiguous()
        if variant == "dequant_in_loop":
            operands = OPERANDS_MX_IN_LOOP
            vj = quantize_jagged(v, kv_layout, ("seq",))
            v_op, v_scale, v_head = vj.payload_seq.view(torch.uint8), vj.scale_seq, vj.scale_seq.shape[1]
            v_tiles = kv_layout.num_tiles
        else:
            operands = OPERANDS_FP8_QK
            v_op = _operands([(v, g.kv_offsets, ORIENT_SEQ, True)], hw_cast=hw, producer=producer)[0][0]
    if g.batch == 0:
        return out, lse
    k_desc, v_desc = (_row_tiles(k_op, bn), _row_tiles(v_op, bn)) if kv_tma else (k_op, v_op)
    tile_seq, tile_idx, upper = _fwd_tiles(g, bm, causal)
    _attn_fwd_kernel[(upper, heads)](
        q_op, k_op, v_op, k_desc, v_desc, out, lse, q_scale, k_scale, v_scale,
        g.q_base, g.o_offsets, g.kv_offsets, q_srow, kv_srow, tile_seq, tile_idx,
        heads, scale * LOG2E, q_head, k_head, v_head, v_tiles,
        D=dim, BM=bm, BN=bn, CAUSAL=causal, P_QUANT=p_code, OPERANDS=operands, Q_ROUND=q_round, KV_ROUND=kv_round,
        KV_TMA=bool(kv_tma), HW_CAST=hw,
        WARP_SPECIALIZE=warp_specialize, INTERPRET=interpreter_enabled(), num_warps=warps, num_stages=stages,
    )
    return out, lse


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, q_offsets: torch.Tensor | None, kv_offsets: torch.Tensor, *,
                       causal: bool = False, broadcast_q: bool = False, precision: str = "mxfp8",
                       softmax_scale: float | None = None, p_quant: str = "const_p",
                       dlse: torch.Tensor | None = None, bwd_variant: str = "split", dq_accum: str = "fp32",
                       dq_static_scale: float = 1.0, grad_format: str = "dense",
                       grad_dtype: torch.dtype | None = None, config=None, dq_config=None,
                       producer: str = DEFAULT_PRODUCER, hw_cast: bool | None = None):
    """Backward of jagged attention by the recipe (docs/numerics.md); inputs as for `attention_forward`.

    Args:
        do: `[T_out, H, D]` gradient of O (contiguous); o, lse: the forward's outputs.
        dlse: optional `[T_out, H]` FP32 gradient of LSE (folded into Δ).
        bwd_variant: `"split"` (a key-tile kernel for dK, dV and a query-tile kernel for dQ, no atomics;
            with broadcast_q the dQ kernel writes one FP32 partial dQ per sequence, summed by torch) or
            `"atomic"` (one key-tile kernel adding dQ atomically: with broadcast_q every key tile of the
            batch adds into the same Lq rows).
        dq_accum: dQ buffer of the atomic variant: `"fp32"`, or `"fp16"` holding dQ * dq_static_scale
            (halves the atomic traffic; pick the scale so that |dQ| * scale stays inside FP16's range).
        grad_format: `"dense"` (dK, dV tensors) or `"mxfp8"`: dK and dV leave the kernel as
            `gem_lp.jagged.JaggedMXTensor`s with a `square` payload (32x32 blocks, rceil; both blocked
            scale forms), quantized in the kernel's epilogue from the FP32 accumulators.
        grad_dtype: dtype of dQ (and of dense dK, dV); default q's dtype.
        config, dq_config: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the key-tile and dQ kernels.
        producer: the producer pass's kernel, `"blocks"` or `"strips"` (the same operand bits; Δ summed in
            another order).

    Returns:
        (dQ `[Tq, H, D]` (`[Lq, H, D]` with broadcast_q: summed over the batch), dK, dV).
    """
    g = _Geometry(q, k, q_offsets, kv_offsets, broadcast_q)
    heads, dim = q.shape[1], q.shape[2]
    grad_dtype = grad_dtype or q.dtype
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    hw = _hw_cast(q, hw_cast)
    on_gpu = q.is_cuda and not interpreter_enabled()
    bm, bn, warps, stages = _config("bwd_kv", dim, on_gpu, config)
    atomic = bwd_variant == "atomic"
    mx = precision == "mxfp8"
    if mx or q.dtype == torch.float32:  # MX-exact (or, FP32 inputs of the 16-bit recipe, BF16) operands
        orients = (ORIENT_SQUARE, ORIENT_SQUARE, ORIENT_HDIM, ORIENT_SQUARE) if mx else (ORIENT_NONE,) * 4
        (q_op, k_op, v_op, do_op), delta = _operands(
            [(q, g.q_offsets, orients[0], True), (k, g.kv_offsets, orients[1], True),
             (v, g.kv_offsets, orients[2], True), (do, g.o_offsets, orients[3], True)], hw_cast=hw, o=o, dlse=dlse,
            producer=producer)
    else:
        q_op, k_op, v_op, do_op = q, k, v, do
        delta = _operands([(do, g.o_offsets, ORIENT_NONE, False)], hw_cast=hw, o=o, dlse=dlse, producer=producer)[1]
    if atomic:
        dq_buf = torch.zeros(q.shape, dtype=torch.float16 if dq_accum == "fp16" else torch.float32, device=q.device)
    elif broadcast_q:  # one FP32 partial dQ per sequence (at its output rows), summed below
        dq_buf = torch.empty(g.num_out, heads, dim, dtype=torch.float32, device=q.device)
    else:
        dq_buf = torch.empty(q.shape, dtype=grad_dtype, device=q.device)
    mx_grads = grad_format == "mxfp8"
    dummy_u8 = torch.empty(1, dtype=torch.uint8, device=q.device)
    kv_srow = g.kv_offsets
    s_hdim_head = s_seq_head = s_tiles = 0
    if mx_grads:
        from ..jagged import JaggedLayout, JaggedMXTensor
        from ..jagged.tensor import scale_sizes

        layout = JaggedLayout.from_offsets(g.kv_offsets, k)
        s_hdim_head, s_seq_head = scale_sizes(layout.padded_total, dim)
        s_tiles = layout.num_tiles
        kv_srow = layout.scale_offsets[:-1].contiguous()
        grads = []
        for _ in range(2):
            grads.append(JaggedMXTensor(
                layout, "rceil", grad_dtype, heads, dim,
                payload_square=torch.empty(k.shape, dtype=torch.float8_e4m3fn, device=k.device),
                scale_square_hdim=torch.zeros(heads, s_hdim_head, dtype=torch.uint8, device=k.device),
                scale_square_seq=torch.zeros(heads, s_seq_head, dtype=torch.uint8, device=k.device)))
        dk_t = dv_t = dummy_u8
        dk_mx = (grads[0].payload_square.view(torch.uint8), grads[0].scale_square_hdim, grads[0].scale_square_seq)
        dv_mx = (grads[1].payload_square.view(torch.uint8), grads[1].scale_square_hdim, grads[1].scale_square_seq)
    else:
        dk_t = torch.empty(k.shape, dtype=grad_dtype, device=k.device)
        dv_t = torch.empty(v.shape, dtype=grad_dtype, device=v.device)
        dk_mx = dv_mx = (dummy_u8, dummy_u8, dummy_u8)
    p_code = (PQ_CONST if p_quant == "const_p" else PQ_DYNAMIC) if mx else PQ_NONE
    if g.batch > 0 and g.kv_rows > 0:
        tile_seq, tile_idx, upper = _bwd_tiles(g, bn, causal)
        _attn_bwd_kv_kernel[(upper, heads)](
            q_op, k_op, v_op, do_op, lse, delta, dq_buf, dk_t, dv_t, *dk_mx, *dv_mx,
            g.q_base, g.o_offsets, g.kv_offsets, kv_srow, tile_seq, tile_idx,
            heads, scale * LOG2E, scale, float(dq_static_scale), s_hdim_head, s_seq_head, s_tiles,
            D=dim, BM=bm, BN=bn, CAUSAL=causal, P_QUANT=p_code, DS_MX=mx, ATOMIC_DQ=atomic,
            DQ_FP16=dq_accum == "fp16", MX_GRADS=mx_grads, HW_CAST=hw, INTERPRET=interpreter_enabled(),
            num_warps=warps, num_stages=stages,
        )
    elif not mx_grads:
        dk_t.zero_()
        dv_t.zero_()
    if atomic:
        if dq_accum == "fp16":
            dq = (dq_buf.to(torch.float32) / dq_static_scale).to(grad_dtype)
        else:
            dq = dq_buf.to(grad_dtype)
    else:
        dq = dq_buf
        if g.batch > 0 and g.num_out > 0:
            qbm, qbn, qwarps, qstages = _config("bwd_q", dim, on_gpu, dq_config)
            tile_seq, tile_idx, upper = _fwd_tiles(g, qbm, causal)
            _attn_bwd_q_kernel[(upper, heads)](
                q_op, k_op, v_op, do_op, lse, delta, dq, g.q_base, g.o_offsets, g.kv_offsets, tile_seq, tile_idx,
                heads, scale * LOG2E, scale,
                D=dim, BM=qbm, BN=qbn, CAUSAL=causal, DS_MX=mx, DQ_AT_O_ROWS=broadcast_q, HW_CAST=hw,
                INTERPRET=interpreter_enabled(), num_warps=qwarps, num_stages=qstages,
            )
        else:
            dq.zero_()
        if broadcast_q:
            dq = dq.view(g.batch, q.shape[0], heads, dim).sum(0).to(grad_dtype)
    if mx_grads:
        return dq, grads[0], grads[1]
    return dq, dk_t, dv_t


# ============================================================================ checks


def _check_offsets_values(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, q_rows: int, kv_rows: int) -> None:
    """Offsets start at 0, never decrease and end at their tensor's rows: one host sync for all checks."""
    checks = []
    for name, offs, rows, what in (("q_offsets", q_offsets, q_rows, "q"), ("kv_offsets", kv_offsets, kv_rows, "k")):
        checks += [(offs[0] != 0, offs, f"{name} must start at 0"),
                   ((offs[1:] < offs[:-1]).any(), offs, f"{name} must be non-decreasing"),
                   (offs[-1] != rows, offs, f"{name} must end at the number of rows of {what} ({rows})")]
    flags = torch.stack([c for c, _, _ in checks]).tolist()
    for bad, (_, offs, msg) in zip(flags, checks):
        if bad:
            raise ValueError(f"{msg}, got {offs.tolist()[:16]}{'...' if offs.numel() > 16 else ''}")


def _check_inputs(q, k, v, q_offsets, kv_offsets, broadcast_q: bool, precision: str, p_quant: str, variant: str,
                  bwd_variant: str, dq_accum: str, dq_static_scale: float,
                  producer: str = DEFAULT_PRODUCER) -> None:
    check_qkv(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [T, H, D] (the kernels index rows as T x H x D); "
                             f"got strides {t.stride()} for shape {tuple(t.shape)}, call .contiguous()")
    if not q.is_cuda and not interpreter_enabled():
        raise ValueError(f"the Triton attention kernels need CUDA tensors, got {q.device} (set "
                         f"TRITON_INTERPRET=1 before importing gem_lp to run them in Triton's interpreter)")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"the Triton attention kernels take head dim D in {HEAD_DIMS}, got D={q.shape[2]} "
                         f"(use backend='reference' for other head dims)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} for the Triton kernels, got {precision!r} "
                         f"(precision='fp32' is the reference oracle: use backend='reference')")
    if p_quant not in P_QUANTS:
        raise ValueError(f"p_quant must be one of {P_QUANTS}, got {p_quant!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant != "producer" and precision != "mxfp8":
        raise ValueError(f"variant={variant!r} is an MXFP8 forward variant; precision={precision!r} takes 'producer'")
    if producer not in PRODUCERS:
        raise ValueError(f"producer must be one of {PRODUCERS}, got {producer!r}")
    if bwd_variant not in BWD_VARIANTS:
        raise ValueError(f"bwd_variant must be one of {BWD_VARIANTS}, got {bwd_variant!r}")
    if dq_accum not in DQ_ACCUMS:
        raise ValueError(f"dq_accum must be one of {DQ_ACCUMS}, got {dq_accum!r}")
    if not (isinstance(dq_static_scale, (int, float)) and math.isfinite(dq_static_scale) and dq_static_scale > 0):
        raise ValueError(f"dq_static_scale must be a positive finite number, got {dq_static_scale!r}")
    if broadcast_q:
        if kv_offsets is None:
            raise ValueError("kv_offsets is required with broadcast_q=True (q is one shared query sequence)")
        check_offsets_form(kv_offsets, "kv_offsets", q.device)
        if q_offsets is not None:
            check_offsets_form(q_offsets, "q_offsets", q.device)
            if q_offsets.numel() != 2:
                raise ValueError(f"q_offsets must be None or [0, Lq] with broadcast_q=True, got shape "
                                 f"{tuple(q_offsets.shape)}")
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        check_offsets_form(q_offsets, "q_offsets", q.device)
        if kv_offsets is None:
            if k.shape[0] != q.shape[0]:
                raise ValueError(f"kv_offsets=None means self-attention: k must have Tq={q.shape[0]} rows, "
                                 f"got {k.shape[0]}")
        else:
            check_offsets_form(kv_offsets, "kv_offsets", q.device)
            if kv_offsets.numel() != q_offsets.numel():
                raise ValueError(f"q_offsets and kv_offsets must describe the same number of sequences, got "
                                 f"B={q_offsets.numel() - 1} and B={kv_offsets.numel() - 1}")


# ============================================================================ custom ops and autograd


def _attention_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                      kv_offsets: torch.Tensor, causal: bool, broadcast_q: bool, precision: str,
                      softmax_scale: float, p_quant: str, variant: str, warp_specialize: bool, q_in_kernel: bool,
                      kv_in_kernel: bool, kv_tma: bool, producer: str, validate_offsets: bool, bwd_variant: str,
                      dq_accum: str, dq_static_scale: float, fwd_config: list[int], bwd_config: list[int],
                      dq_config: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of jagged attention (the backward options ride along for the autograd context)."""
    if validate_offsets:
        _check_offsets_values(q_offsets, kv_offsets, q.shape[0], k.shape[0])
    return attention_forward(q, k, v, q_offsets, kv_offsets, causal=causal, broadcast_q=broadcast_q,
                             precision=precision, softmax_scale=softmax_scale, p_quant=p_quant, variant=variant,
                             warp_specialize=warp_specialize, config=fwd_config, q_in_kernel=q_in_kernel,
                             kv_in_kernel=kv_in_kernel, kv_tma=kv_tma, producer=producer)


# The custom ops are what traced and compiled graphs call; eager calls skip their dispatch (`_EagerAttention`).
_attention_fwd_op = torch.library.custom_op("gem_lp::jagged_attention_fwd", _attention_fwd_impl, mutates_args=())


@_attention_fwd_op.register_fake
def _(q, k, v, q_offsets, kv_offsets, causal, broadcast_q, precision, softmax_scale, p_quant, variant,
      warp_specialize, q_in_kernel, kv_in_kernel, kv_tma, producer, validate_offsets, bwd_variant, dq_accum,
      dq_static_scale, fwd_config, bwd_config, dq_config):
    num_out = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty(num_out, q.shape[1], q.shape[2]), q.new_empty(num_out, q.shape[1], dtype=torch.float32)


def _attention_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, dlse: torch.Tensor | None, q_offsets: torch.Tensor,
                      kv_offsets: torch.Tensor, causal: bool, broadcast_q: bool, precision: str,
                      softmax_scale: float, p_quant: str, bwd_variant: str, dq_accum: str, dq_static_scale: float,
                      bwd_config: list[int], dq_config: list[int], producer: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of jagged attention by the recipe."""
    return attention_backward(do, q, k, v, o, lse, q_offsets, kv_offsets, causal=causal, broadcast_q=broadcast_q,
                              precision=precision, softmax_scale=softmax_scale, p_quant=p_quant, dlse=dlse,
                              bwd_variant=bwd_variant, dq_accum=dq_accum, dq_static_scale=dq_static_scale,
                              config=bwd_config, dq_config=dq_config, producer=producer)


_attention_bwd_op = torch.library.custom_op("gem_lp::jagged_attention_bwd", _attention_bwd_impl, mutates_args=())


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, q_offsets, kv_offsets, causal, broadcast_q, precision, softmax_scale, p_quant,
      bwd_variant, dq_accum, dq_static_scale, bwd_config, dq_config, producer):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_OP_INPUTS = 23  # arguments of gem_lp::jagged_attention_fwd


def _setup_context(ctx, inputs, output):
    (q, k, v, q_offsets, kv_offsets, causal, broadcast_q, precision, softmax_scale, p_quant, _variant,
     _warp_specialize, _q_in_kernel, _kv_in_kernel, _kv_tma, producer, _validate, bwd_variant, dq_accum,
     dq_static_scale, _fwd_config, bwd_config, dq_config) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_offsets, kv_offsets)
    ctx.options = (causal, broadcast_q, precision, softmax_scale, p_quant, bwd_variant, dq_accum, dq_static_scale,
                   bwd_config, dq_config, producer)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dlse, backward_op=None):
    """The registered backward of the forward op; `backward_op`: what computes the gradients (default the
    backward custom op)."""
    q, k, v, o, lse, q_offsets, kv_offsets = ctx.saved_tensors
    if do is None and dlse is None:
        return (None,) * _FWD_OP_INPUTS
    do = torch.zeros_like(o) if do is None else do.contiguous()
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    backward_op = _attention_bwd_op if backward_op is None else backward_op
    dq, dk, dv = backward_op(do, q, k, v, o, lse, dlse, q_offsets, kv_offsets, *ctx.options)
    return (dq, dk, dv) + (None,) * (_FWD_OP_INPUTS - 3)


torch.library.register_autograd("gem_lp::jagged_attention_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The forward op with its registered autograd, for eager calls: the same implementations, context and
    backward without the dispatcher, whose argument handling for 23 inputs (torch's custom-op autograd
    wrapper re-fills every default) took about a third of a fwd+bwd call's host time (CPU, launches mocked)."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.device_type = inputs[0].device.type
        with torch.autocast(ctx.device_type, enabled=False):  # as for the op: autocast does not reach it
            output = _attention_fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        with torch.autocast(ctx.device_type, enabled=False):
            return _backward(ctx, do, dlse, _attention_bwd_impl)


# ============================================================================ public entry point


def jagged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None,
                            kv_offsets: torch.Tensor | None = None, *, causal: bool = False,
                            broadcast_q: bool = False, precision: str = "bf16", softmax_scale: float | None = None,
                            p_quant: str = "const_p", return_lse: bool = False, variant: str = "producer",
                            warp_specialize: bool = False, q_in_kernel: bool = False,
                            kv_in_kernel: bool | None = None, kv_tma: bool = False,
                            producer: str = DEFAULT_PRODUCER, validate_offsets: bool = True,
                            bwd_variant: str = "split", dq_accum: str = "fp32", dq_static_scale: float = 1.0,
                            fwd_config=None, bwd_config=None, dq_config=None
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Jagged attention on the Triton kernels, differentiable (semantics of `gem_lp.attention.jagged_attention`).

    Args:
        q: `[Tq, H, D]` (`[Lq, H, D]` with broadcast_q), k, v: `[Tk, H, D]`; contiguous, one dtype
            (bfloat16, float16 or float32) on CUDA (or CPU under TRITON_INTERPRET=1); D in {64, 128}.
        q_offsets, kv_offsets: `[B+1]` int32/int64 (CPU or q's device); kv_offsets=None for self-attention;
            with broadcast_q, q_offsets is None or `[0, Lq]` and kv_offsets is required.
        causal: query i sees keys j <= i + (Lk - Lq) of its sequence.
        precision: `"bf16"` (16-bit operands: BF16, or FP16 for FP16 inputs) or `"mxfp8"` (LP-FA4).
        p_quant: `"const_p"` or `"dynamic"` (mxfp8).
        return_lse: also return LSE `[T_out, H]` FP32 (natural log; differentiable).
        variant: mxfp8 forward variant, `"producer"` (default), `"dequant_in_loop"`, `"fp8_qk"`.
        warp_specialize: run the forward KV loop with `tl.range(..., warp_specialize=True)` (GPU only).
        q_in_kernel: round Q to its operand in the forward kernel's prologue instead of in the producer
            pass (default; `attention_forward`); the same bits either way.
        kv_in_kernel: round K and V tiles in the forward kernel's loop instead of in the producer pass
            (same bits; fewer HBM bytes when each KV tile meets few query tiles, as with broadcast_q).
            None (default): True for mxfp8 broadcast_q (measured 2.6x faster there), else False.
        kv_tma: full K, V tiles of the forward through TMA tensor descriptors (`attention_forward`).
        producer: the producer pass's kernel (forward and backward), `"blocks"` or `"strips"` (`_operands`).
        validate_offsets: check the offsets' values (start 0, non-decreasing, end at the rows), one host
            sync per call; False when the caller has checked them (the sync stalls the launch queue).
        bwd_variant: `"split"` (dK/dV and dQ kernels, no atomics; broadcast_q sums one partial dQ per
            sequence) or `"atomic"` (dQ by atomic adds).
        dq_accum, dq_static_scale: the atomic dQ buffer, FP32 or FP16 holding dQ * dq_static_scale.
        fwd_config, bwd_config, dq_config: optional (BLOCK_M, BLOCK_N, num_warps, num_stages) of the
            forward, backward key-tile and dQ kernels, 0 = default.

    Returns:
        O `[T_out, H, D]` in q's dtype (T_out = Tq, or B * Lq with broadcast_q), and LSE with return_lse.
    """
    _check_inputs(q, k, v, q_offsets, kv_offsets, broadcast_q, precision, p_quant, variant, bwd_variant, dq_accum,
                  dq_static_scale, producer)
    dim = q.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dim)
    elif not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    if kv_in_kernel is None:
        kv_in_kernel = broadcast_q and precision == "mxfp8"
    if kv_offsets is None:
        kv_offsets = q_offsets
    if broadcast_q and q_offsets is None:
        q_offsets = torch.arange(2, dtype=torch.int64, device=q.device) * q.shape[0]  # no host sync
    q_offs = q_offsets.to(device=q.device, dtype=torch.int64)
    kv_offs = kv_offsets.to(device=q.device, dtype=torch.int64)
    fwd = _EagerAttention.apply if skips_dispatch(q, k, v, q_offs, kv_offs) else _attention_fwd_op
    o, lse = fwd(q, k, v, q_offs, kv_offs, causal, broadcast_q, precision, float(softmax_scale), p_quant, variant,
                 warp_specialize, bool(q_in_kernel), bool(kv_in_kernel), bool(kv_tma), producer, validate_offsets,
                 bwd_variant, dq_accum, float(dq_static_scale), list(fwd_config or ()), list(bwd_config or ()),
                 list(dq_config or ()))
    return (o, lse) if return_lse else o
