"""One-launch Triton kernel for jagged MX quantization, registered as the custom op `gem_lp::jagged_mx_quantize`.

Grid: Tp/128 padded-row tiles x H heads (flattened, heads fastest). A tile belongs to one sequence (each
sequence's scale rows are padded to a multiple of 128); the layout finds it on device (`torch.searchsorted`
on `scale_offsets`). Each program reads its tile's `[128, D]` values of one head once (rows past the
sequence's end masked to 0, so their blocks get scale byte 0 under both rules), in chunks of CHUNK_D
features, and for every requested orientation stores the payload at the packed token positions and every
scale byte of its 128 padded rows (hdim form) and of its 4 token-block columns (seq form), padding bytes
included: the scale buffers need no zero-fill.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreter_enabled
from ..mx.formats import PAYLOAD_DTYPE
from ..mx.triton_numerics import abs_bits, encode, scale_byte
from .tensor import JaggedMXTensor, scale_sizes


@triton.jit
def _hdim_scale_offset(row, col, N_COL_BLOCKS: tl.constexpr):
    """Blocked-layout byte of scale (row, col) of an hdim-form matrix [Tp, D/32] (see mx.layout)."""
    return ((row // 128) * N_COL_BLOCKS + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


@triton.jit
def _seq_scale_offset(feature, tile, j, num_tiles):
    """Blocked-layout byte of scale (feature, 4*tile + j) of a seq-form matrix [D, Tp/32]; Tp/128 column blocks."""
    return ((feature // 128) * num_tiles + tile) * 512 + (feature % 32) * 16 + ((feature % 128) // 32) * 4 + j


@triton.jit
def _to_f32(x):
    """Exact FP32 of a loaded tile. bf16 is widened by its bits (<< 16): Triton's interpreter flushes
    bf16 subnormals to 0 in `.to(tl.float32)`, the GPU does not; the bit form is exact on both."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _jagged_mx_kernel(
    x_ptr, offsets_ptr, scale_offsets_ptr, tile_seq_ptr,
    p_hdim_ptr, p_seq_ptr, p_square_ptr,
    s_hdim_ptr, s_seq_ptr, s_sq_hdim_ptr, s_sq_seq_ptr,
    stride_t, stride_h, stride_d,
    num_tiles, hdim_head_bytes, seq_head_bytes,
    H: tl.constexpr, D: tl.constexpr, CHUNK_D: tl.constexpr, ROWS: tl.constexpr,
    DO_HDIM: tl.constexpr, DO_SEQ: tl.constexpr, DO_SQUARE: tl.constexpr,
    RCEIL: tl.constexpr, HW_CAST: tl.constexpr,
):
    # heads fastest: programs running together read neighbouring bytes of the same tokens
    pid = tl.program_id(0)
    tile = (pid // H).to(tl.int64)
    h = pid % H
    NC: tl.constexpr = D // 32  # hdim-form scale columns
    N_COL_BLOCKS: tl.constexpr = (NC + 3) // 4
    CB: tl.constexpr = CHUNK_D // 32  # 32-feature blocks per chunk
    NB: tl.constexpr = ROWS // 32  # 32-token blocks per step

    b = tl.load(tile_seq_ptr + tile)
    seq_start = tl.load(offsets_ptr + b).to(tl.int64)
    seq_end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    row0 = tile * 128
    tok0 = seq_start + (row0 - tl.load(scale_offsets_ptr + b))  # first packed token of this tile
    i = tl.arange(0, ROWS)
    hdim_base = h.to(tl.int64) * hdim_head_bytes
    seq_base = h.to(tl.int64) * seq_head_bytes

    # ROWS tokens (whole 32-token blocks) x CHUNK_D features per step: few registers on the GPU
    for step in range(128 // ROWS):
        tok = tok0 + step * ROWS + i
        valid = tok < seq_end
        rows = row0 + step * ROWS + i  # padded scale rows of this step
        jb = step * NB + tl.arange(0, NB)  # its 32-token blocks within the tile (seq-form columns 4*tile + jb)
        x_row = x_ptr + tok * stride_t + h * stride_h
        p_row = (tok * H + h) * D
        for ci in tl.static_range(D // CHUNK_D):
            d = ci * CHUNK_D + tl.arange(0, CHUNK_D)
            x = _to_f32(tl.load(x_row[:, None] + d[None, :] * stride_d, mask=valid[:, None], other=0.0))
            a = abs_bits(x)  # integer max: NaN/Inf cannot hide
            p_off = p_row[:, None] + d[None, :]
            c = ci * CB + tl.arange(0, CB)  # hdim-form scale columns of this chunk
            hdim_off = _hdim_scale_offset(rows[:, None], c[None, :], N_COL_BLOCKS)  # [ROWS, CB]
            seq_off = _seq_scale_offset(d[None, :], tile, jb[:, None], num_tiles)  # [NB, CHUNK_D]
            if DO_HDIM:  # 1x32 along D
                byte = scale_byte(tl.max(tl.reshape(a, [ROWS, CB, 32]), axis=2), RCEIL)  # [ROWS, CB]
                q = encode(tl.reshape(x, [ROWS, CB, 32]), byte[:, :, None], HW_CAST)
                tl.store(p_hdim_ptr + p_off, tl.reshape(q, [ROWS, CHUNK_D]), mask=valid[:, None])
                tl.store(s_hdim_ptr + hdim_base + hdim_off, byte.to(tl.uint8))
            if DO_SEQ:  # 32x1 along tokens
                byte = scale_byte(tl.max(tl.reshape(a, [NB, 32, CHUNK_D]), axis=1), RCEIL)  # [NB, CHUNK_D]
                q = encode(tl.reshape(x, [NB, 32, CHUNK_D]), byte[:, None, :], HW_CAST)
                tl.store(p_seq_ptr + p_off, tl.reshape(q, [ROWS, CHUNK_D]), mask=valid[:, None])
                tl.store(s_seq_ptr + seq_base + seq_off, byte.to(tl.uint8))
            if DO_SQUARE:  # 32x32
                amax = tl.max(tl.max(tl.reshape(a, [NB, 32, CB, 32]), axis=3), axis=1)  # [NB, CB]
                byte = scale_byte(amax, RCEIL)
                q = encode(tl.reshape(x, [NB, 32, CB, 32]), byte[:, None, :, None], HW_CAST)
                tl.store(p_square_ptr + p_off, tl.reshape(q, [ROWS, CHUNK_D]), mask=valid[:, None])
                on_rows = tl.reshape(tl.broadcast_to(byte[:, None, :], [NB, 32, CB]), [ROWS, CB])
                on_rows = tl.where(valid[:, None], on_rows, 0)  # rows past the sequence: padding, 0
                tl.store(s_sq_hdim_ptr + hdim_base + hdim_off, on_rows.to(tl.uint8))
                on_features = tl.reshape(tl.broadcast_to(byte[:, :, None], [NB, CB, 32]), [NB, CHUNK_D])
                tl.store(s_sq_seq_ptr + seq_base + seq_off, on_features.to(tl.uint8))

    # padding columns of the hdim form (D/32 not a multiple of 4): zeros in the last column block
    r = tl.arange(0, 128)
    j = tl.arange(0, 4)
    if NC % 4 != 0:
        if DO_HDIM or DO_SQUARE:
            c = (N_COL_BLOCKS - 1) * 4 + j
            off = _hdim_scale_offset(row0 + r[:, None], c[None, :], N_COL_BLOCKS)
            pad = (c[None, :] >= NC) & (r[:, None] >= 0)
            zero = tl.zeros([128, 4], dtype=tl.uint8)
            if DO_HDIM:
                tl.store(s_hdim_ptr + hdim_base + off, zero, mask=pad)
            if DO_SQUARE:
                tl.store(s_sq_hdim_ptr + hdim_base + off, zero, mask=pad)
    # padding rows of the seq form (D not a multiple of 128): zeros in the last row block
    if D % 128 != 0:
        if DO_SEQ or DO_SQUARE:
            f = ((D + 127) // 128 - 1) * 128 + r
            off = _seq_scale_offset(f[None, :], tile, j[:, None], num_tiles)  # [4, 128]
            pad = (f[None, :] >= D) & (j[:, None] >= 0)
            zero = tl.zeros([4, 128], dtype=tl.uint8)
            if DO_SEQ:
                tl.store(s_seq_ptr + seq_base + off, zero, mask=pad)
            if DO_SQUARE:
                tl.store(s_sq_seq_ptr + seq_base + off, zero, mask=pad)


def chunk_width(head_dim: int) -> int:
    """Features per inner step: the largest of 128, 64, 32 that divides D."""
    return next(w for w in (128, 64, 32) if head_dim % w == 0)


def launch(values: torch.Tensor, offsets: torch.Tensor, scale_offsets: torch.Tensor,
           tile_seq: torch.Tensor, padded_total: int, payloads: dict[str, torch.Tensor],
           scales: dict[str, torch.Tensor], rceil: bool, *,
           chunk_d: int | None = None, rows: int | None = None, num_warps: int = 4) -> None:
    """Run the kernel once into preallocated outputs (any contents: every byte is written).

    Args:
        values: `[T, H, D]` float32/bfloat16/float16, any strides.
        offsets: `[B+1]` int32/int64; scale_offsets: `[B+1]` int64; padded_total: Tp.
        tile_seq: `[Tp/128]` int32, owner sequence of each 128-row tile (`metadata.tile_sequences`).
        payloads: orientation -> `[T, H, D]` float8_e4m3fn (contiguous) for each requested orientation.
        scales: `"hdim"`, `"seq"`, `"square_hdim"`, `"square_seq"` -> `[H, bytes]` uint8 (contiguous),
            present for each requested orientation (square needs both of its forms).
        chunk_d, rows, num_warps: launch tuning: features per step (a multiple of 32 dividing D; default
            the largest of 128/64/32 dividing D), tokens per step (32, 64 or 128; default 32 on the GPU,
            where it keeps registers low, 128 in the interpreter, where fewer steps run faster), warps
            per program (default 4). The bytes written do not depend on them.
    """
    t, heads, d = values.shape
    num_tiles = padded_total // 128
    if num_tiles == 0:
        return
    hdim_bytes, seq_bytes = scale_sizes(padded_total, d)
    dummy = torch.empty(1, dtype=torch.uint8, device=values.device)

    def u8(x: torch.Tensor | None) -> torch.Tensor:
        return dummy if x is None else x.view(torch.uint8)

    chunk_d = chunk_width(d) if chunk_d is None else chunk_d
    if chunk_d % 32 or d % chunk_d:
        raise ValueError(f"chunk_d must be a multiple of 32 dividing D = {d}, got {chunk_d}")
    rows = (128 if interpreter_enabled() and not values.is_cuda else 32) if rows is None else rows
    if rows not in (32, 64, 128):
        raise ValueError(f"rows must be 32, 64 or 128, got {rows}")
    grid = (num_tiles * heads,)
    _jagged_mx_kernel[grid](
        values, offsets, scale_offsets, tile_seq,
        u8(payloads.get("hdim")), u8(payloads.get("seq")), u8(payloads.get("square")),
        u8(scales.get("hdim")), u8(scales.get("seq")), u8(scales.get("square_hdim")), u8(scales.get("square_seq")),
        values.stride(0), values.stride(1), values.stride(2),
        num_tiles, hdim_bytes, seq_bytes,
        H=heads, D=d, CHUNK_D=chunk_d, ROWS=rows,
        DO_HDIM="hdim" in payloads, DO_SEQ="seq" in payloads, DO_SQUARE="square" in payloads,
        RCEIL=rceil, HW_CAST=values.is_cuda,
        num_warps=num_warps,
    )


def _allocate(values: torch.Tensor, padded_total: int, hdim: bool, seq: bool, square: bool):
    t, heads, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(padded_total, d)
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


@torch.library.custom_op("gem_lp::jagged_mx_quantize", mutates_args=())
def jagged_mx_quantize(values: torch.Tensor, offsets: torch.Tensor, scale_offsets: torch.Tensor,
                       tile_seq: torch.Tensor, padded_total: int, hdim: bool, seq: bool, square: bool,
                       rceil: bool) -> list[torch.Tensor]:
    """Jagged MX quantization in one launch; returns, for each requested orientation in the order hdim, seq,
    square: its payload `[T, H, D]` float8_e4m3fn and its blocked scales `[H, bytes]` uint8 (square: the
    hdim form, then the seq form)."""
    payloads, scales = _allocate(values, padded_total, hdim, seq, square)
    launch(values, offsets, scale_offsets, tile_seq, padded_total, payloads, scales, rceil)
    return _flat(payloads, scales)


@jagged_mx_quantize.register_fake
def _(values, offsets, scale_offsets, tile_seq, padded_total, hdim, seq, square, rceil):
    payloads, scales = _allocate(values, padded_total, hdim, seq, square)
    return _flat(payloads, scales)


def quantize_jagged_triton(values: torch.Tensor, layout, orientations: tuple[str, ...], scaling: str):
    """Triton backend of `quantize_jagged` (arguments already checked there)."""
    flags = {o: o in orientations for o in ("hdim", "seq", "square")}
    outs = iter(jagged_mx_quantize(values, layout.offsets, layout.scale_offsets, layout.tile_seq,
                                   layout.padded_total, flags["hdim"], flags["seq"], flags["square"],
                                   scaling == "rceil"))
    t, heads, d = values.shape
    jmx = JaggedMXTensor(layout, scaling, values.dtype, heads, d)
    if flags["hdim"]:
        jmx.payload_hdim, jmx.scale_hdim = next(outs), next(outs)
    if flags["seq"]:
        jmx.payload_seq, jmx.scale_seq = next(outs), next(outs)
    if flags["square"]:
        jmx.payload_square, jmx.scale_square_hdim, jmx.scale_square_seq = next(outs), next(outs), next(outs)
    return jmx
