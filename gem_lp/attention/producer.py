"""The producer pass of the MXFP8 attention: MX-exact BF16 operands of jagged `[T, H, D]` tensors, in one launch.

Hopper has no block-scaled MMA, but every MX value (E4M3 x 2^k) is exact in BF16, so the attention kernels take
their operands as BF16 tensors holding the dequantized MX values. This Triton kernel reads each tensor once and
writes that operand, quantizing each MX block of the recipe (docs/numerics.md): `hdim` (1x32 along D), `seq`
(32 tokens x 1 feature) and `square` (32 tokens x 32 features), token blocks aligned to each sequence's first
token. Memory-bound: it ran at 92-94% of copy bandwidth on the H200 (docs/PERF.md).

Inputs may be views with a token stride larger than H x D (q, k, v of a fused projection's output).
A program takes a ROWS-token chunk of one sequence and one head; each thread a strip of THREAD_ROWS tokens x 8
features (`gem_lp.mx.triton_quantize.tile_axes`): one 16-byte load and store per token row, the 32-token max
mostly inside the thread, the 32-feature max across 4 lanes. Up to four tensors, each with its own offsets,
share a launch (`program_id(1)` picks the tensor).

Under Triton's interpreter (CPU tests) the FP8 casts are done in integer arithmetic (`HW_CAST=False`, the same
result) and FP32 -> BF16 rounds on the bits (the interpreter truncates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreter_enabled
from ..mx.triton_numerics import abs_bits, e4m3_bits, inv_scale, scale_byte
from ..mx.triton_quantize import max_cols_of_blocks, max_rows_of_blocks, tile_axes
from ..triton_launch import KernelLaunch
from .plan import cached_plan

MX_BLOCK = 32
# orientation codes of the producer (`mx_operands`' specs)
ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE = 1, 2, 3
ORIENTS = (ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE)
# (rows, thread_rows, row_blocks_in_thread, num_warps): the fastest on the H200 among the candidates measured
# (docs/PERF.md); under the interpreter, few large programs.
STRIPS_LAUNCH = (32, 8, False, 2)
INTERPRETER_STRIPS_LAUNCH = (128, 4, False, 1)


@triton.jit
def _to_f32(x):
    """Exact FP32 of a loaded tile (bf16 widened by its bits: the interpreter's cast flushes subnormals)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _cast_bf16(x, INTERPRET: tl.constexpr):
    """FP32 `x` to BF16, round-to-nearest-even (on the bits under the interpreter, which truncates; NaN kept)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _e4m3_value(q):
    """FP32 value of E4M3 bytes `q` (int32), exact. 0x7F/0xFF decode as +-480: they only occur in blocks whose
    scale byte is 255, whose scale value is NaN."""
    e = (q >> 3) & 0xF
    m = q & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((q & 0x80) != 0, -v, v)


@triton.jit
def _mx_round(x, byte, HW_CAST: tl.constexpr):
    """Dequantized MX value of FP32 `x` under E8M0 bytes `byte` (broadcast): exact FP32 (byte 255 -> NaN)."""
    y = tl.minimum(tl.maximum(x * inv_scale(byte), -448.0), 448.0)
    if HW_CAST:
        r = y.to(tl.float8e4nv).to(tl.float32)
    else:
        r = _e4m3_value(e4m3_bits(y))
    scale = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)
    return r * tl.where(byte == 255, float("nan"), scale)


@triton.jit
def _produce(x_ptr, x_row_stride, out_ptr, chunk_seq_ptr, offsets_ptr, chunk_offsets_ptr, chunk, h, H, D: tl.constexpr,
             ROWS: tl.constexpr, THREAD_ROWS: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr,
             ORIENT: tl.constexpr, HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    """One ROWS-token chunk (aligned to its sequence's start) of one head: the MX-exact operand."""
    b = tl.load(chunk_seq_ptr + chunk)
    if b >= 0:
        tok0 = tl.load(offsets_ptr + b) + (chunk - tl.load(chunk_offsets_ptr + b)) * ROWS
        n_valid = tl.load(offsets_ptr + b + 1) - tok0  # tokens of the sequence in this chunk
        # token t = mb * 32 + c * THREAD_ROWS + r of the chunk, feature f = cb * 32 + g * 8 + e
        g, c, cb, mb, r, e = tile_axes(ROWS // 32, D // 32, THREAD_ROWS, ROW_BLOCKS_IN_THREAD)
        t = mb * 32 + c * THREAD_ROWS + r
        valid = t < n_valid
        # int64 starts of the chunk's first row; offsets inside the chunk fit in int32
        base = (tok0 * H + h) * D
        x_base = tok0 * x_row_stride + h * D
        col = cb * 32 + g * 8 + e
        x = _to_f32(tl.load(x_ptr + x_base + (t * x_row_stride + col), mask=valid, other=0.0))
        if ORIENT == 1:  # hdim: 1x32 along D
            amax = max_rows_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD)
        elif ORIENT == 2:  # seq: 32 tokens x 1 feature (rows past the sequence are 0: never the max)
            amax = max_cols_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD)
        else:  # square: 32 tokens x 32 features
            amax = max_cols_of_blocks(max_rows_of_blocks(abs_bits(x), ROW_BLOCKS_IN_THREAD), ROW_BLOCKS_IN_THREAD)
        y = _mx_round(x, scale_byte(amax, True), HW_CAST)
        tl.store(out_ptr + base + (t * (H * D) + col), _cast_bf16(y, INTERPRET), mask=valid)


@triton.jit
def _producer_kernel(
    x0, rs0, out0, seq0, offs0, coffs0, x1, rs1, out1, seq1, offs1, coffs1, x2, rs2, out2, seq2, offs2, coffs2,
    x3, rs3, out3, seq3, offs3, coffs3, H,
    D: tl.constexpr, ROWS: tl.constexpr, THREAD_ROWS: tl.constexpr, ROW_BLOCKS_IN_THREAD: tl.constexpr,
    ORIENT0: tl.constexpr, ORIENT1: tl.constexpr, ORIENT2: tl.constexpr, ORIENT3: tl.constexpr,
    HW_CAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    """program_id(0) = chunk * H + head (heads fastest, so programs running together read neighbouring bytes of
    the same tokens), program_id(1) picks the tensor."""
    pid = tl.program_id(0)
    chunk = pid // H
    h = pid % H
    t = tl.program_id(1)
    if t == 0:
        _produce(x0, rs0, out0, seq0, offs0, coffs0, chunk, h, H, D, ROWS, THREAD_ROWS, ROW_BLOCKS_IN_THREAD, ORIENT0,
                 HW_CAST, INTERPRET)
    elif t == 1:
        _produce(x1, rs1, out1, seq1, offs1, coffs1, chunk, h, H, D, ROWS, THREAD_ROWS, ROW_BLOCKS_IN_THREAD, ORIENT1,
                 HW_CAST, INTERPRET)
    elif t == 2:
        _produce(x2, rs2, out2, seq2, offs2, coffs2, chunk, h, H, D, ROWS, THREAD_ROWS, ROW_BLOCKS_IN_THREAD, ORIENT2,
                 HW_CAST, INTERPRET)
    else:
        _produce(x3, rs3, out3, seq3, offs3, coffs3, chunk, h, H, D, ROWS, THREAD_ROWS, ROW_BLOCKS_IN_THREAD, ORIENT3,
                 HW_CAST, INTERPRET)


def _chunk_map(offsets: torch.Tensor, rows: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`chunk`-token chunks aligned to sequence starts: `seq [upper]` int32 (-1 past the last chunk),
    `chunk_offsets [B+1]` int64 (first chunk of each sequence), and `upper` (a bound needing no host sync);
    built once per offsets tensor."""
    def build():
        batch = offsets.numel() - 1
        n = (offsets[1:] - offsets[:-1] + chunk - 1) // chunk
        chunk_offsets = torch.zeros(batch + 1, dtype=torch.int64, device=offsets.device)
        chunk_offsets[1:] = torch.cumsum(n, 0)
        upper = rows // chunk + batch
        seq = torch.searchsorted(chunk_offsets[1:], torch.arange(upper, device=offsets.device), right=True)
        seq = torch.where(seq < batch, seq, torch.full_like(seq, -1))
        return seq.to(torch.int32).contiguous(), chunk_offsets, upper

    return cached_plan(offsets, ("producer chunks", rows, chunk), build)


def mx_operands(specs) -> list[torch.Tensor]:
    """The MX-exact BF16 operands of up to four `[T, H, D]` tensors (one H and D), in one launch.

    Args:
        specs: list of (x, offsets, orient): x float32/bfloat16/float16 `[T, H, D]` with contiguous heads and
            features (the token stride may be larger: a view into a fused QKV output is read in place), D a
            multiple of 32; offsets `[B+1]` int64 on x's device (tokens of each sequence); orient one of
            `ORIENTS`.
    Returns:
        the BF16 operands, in the order of `specs`.
    """
    if not 1 <= len(specs) <= 4:
        raise ValueError(f"mx_operands takes 1 to 4 tensors, got {len(specs)}")
    heads, dim = specs[0][0].shape[1], specs[0][0].shape[2]
    dev = specs[0][0].device
    for x, offsets, orient in specs:
        strided_ok = x.numel() == 0 or (x.stride(2) == 1 and x.stride(1) == dim)
        if x.dim() != 3 or x.shape[1:] != (heads, dim) or not strided_ok:
            raise ValueError(f"each tensor must be [T, {heads}, {dim}] with contiguous heads and features, got "
                             f"shape {tuple(x.shape)} strides {x.stride()}")
        if orient not in ORIENTS:
            raise ValueError(f"orient must be one of {ORIENTS}, got {orient!r}")
    if dim % MX_BLOCK:
        raise ValueError(f"the head dim must be a multiple of {MX_BLOCK}, got {dim}")
    interpret = interpreter_enabled() and dev.type != "cuda"
    rows, thread_rows, row_blocks_in_thread, warps = INTERPRETER_STRIPS_LAUNCH if interpret else STRIPS_LAUNCH
    outs = [torch.empty(x.shape, dtype=torch.bfloat16, device=dev) for x, _, _ in specs]
    maps = {}
    for x, offsets, _ in specs:  # one chunk map per distinct offsets tensor
        if id(offsets) not in maps:
            maps[id(offsets)] = _chunk_map(offsets, x.shape[0], rows)
    upper = max(m[2] for m in maps.values())
    if upper == 0 or all(m[1].numel() == 1 for m in maps.values()):  # no sequence
        return outs
    none = torch.full((upper,), -1, dtype=torch.int32, device=dev)
    args, orients = [], []
    for i in range(4):
        if i < len(specs):
            x, offsets, orient = specs[i]
            seq, chunk_offsets, n = maps[id(offsets)]
            if n < upper:  # programs past this tensor's chunks read -1 and return
                seq = torch.cat([seq, none[: upper - n]])
            args += [x, x.stride(0), outs[i], seq, offsets, chunk_offsets]
            orients.append(orient)
        else:  # unused slot: never launched (grid dim 1 = len(specs))
            args += [specs[0][0], specs[0][0].stride(0), outs[0], none, specs[0][1], specs[0][1]]
            orients.append(ORIENT_HDIM)
    args.append(heads)
    kwargs = dict(D=dim, ROWS=rows, THREAD_ROWS=thread_rows, ROW_BLOCKS_IN_THREAD=row_blocks_in_thread,
                  ORIENT0=orients[0], ORIENT1=orients[1], ORIENT2=orients[2], ORIENT3=orients[3],
                  HW_CAST=not interpret, INTERPRET=interpret, num_warps=warps)
    # a direct relaunch of the build an earlier batch found (`gem_lp.triton_launch`): the JIT's argument binding
    # of these 25 arguments cost more host time than the kernel takes at the GPU model's sizes
    KernelLaunch(_producer_kernel, (upper * heads, len(specs)), len(args), kwargs)(tuple(args), not interpret)
    return outs
