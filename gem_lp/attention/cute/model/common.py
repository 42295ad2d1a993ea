"""Pieces both kernel models share: operand checks, TMA tile loads, the recipe's FP32 helpers, the E4M3 roundings."""
from __future__ import annotations

import math
import warnings

import torch

from gem_lp.mx.reference import abs_bits, inv_scale_f32, scale_bytes

TILE = 128  # tile_m = tile_n = 128 in both kernels (config.SM100_FWD / SM100_BWD)
HEAD_DIMS = (64, 128)
MX_BLOCK = 32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class ScaleTileOutOfBounds(RuntimeWarning):
    """A kernel would read a scale tile outside its scale buffer (an out-of-bounds global load)."""


def check_payloads(names_and_tensors, heads_dims=HEAD_DIMS) -> tuple[int, int]:
    """E4M3 `[T, H, D]` payloads with one H and D in `heads_dims`; returns (H, D)."""
    shapes = set()
    for name, t in names_and_tensors:
        if t.dtype != torch.float8_e4m3fn or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] float8_e4m3fn payload, got {t.dtype} {tuple(t.shape)}")
        shapes.add(tuple(t.shape[1:]))
    if len(shapes) != 1:
        raise ValueError(f"payloads disagree in heads and head dims: {sorted(shapes)}")
    heads, dim = shapes.pop()
    if dim not in heads_dims:
        raise ValueError(f"the sm_100a kernels take head dims {heads_dims}, got {dim}")
    return heads, dim


def offsets_list(cu: torch.Tensor, name: str) -> list[int]:
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise ValueError(f"{name} must be int32 [B+1], got {cu.dtype} {tuple(cu.shape)}")
    return [int(x) for x in cu.tolist()]


def tma_rows(x: torch.Tensor, head: int, start: int, rows: int = TILE) -> torch.Tensor:
    """`[rows, D]` FP32 payload values of rows start .. start + rows - 1 of head `head`, as FA4's varlen TMA loads
    them: the packed tensor from the sequence's offset on (rows past the sequence's end are the next sequence's
    tokens), zero where the box leaves the tensor (TMA's out-of-bounds fill)."""
    t, _, d = x.shape
    out = torch.zeros(rows, d, dtype=torch.float32)
    lo, hi = max(start, 0), min(start + rows, t)
    if lo < hi:
        out[lo - start:hi - start] = x[lo:hi, head].to(torch.float32)
    return out


def fp32_fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """a * b + c with one FP32 rounding (the kernels' `fma_packed_f32x2`): the FP32 product is exact in FP64."""
    return (a.to(torch.float64) * torch.as_tensor(b, dtype=torch.float64) + torch.as_tensor(c, dtype=torch.float64)
            ).to(torch.float32)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to E4M3 (`cvt.rn.satfinite.e4m3x2.f32`: nearest even, saturating at 448)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)


def rceil_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The rceil E8M0 byte of FP32 block maxima (`mx_device.rceil_scale`; docs/numerics.md)."""
    return scale_bytes(abs_bits(amax.to(torch.float32).contiguous()), "rceil")


def mx_payload(x: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """E4M3 payload values of x under scale bytes `byte` (x times 2^(127 - byte) in FP32, then rounded)."""
    return e4m3(x * inv_scale_f32(byte))


def kernel_e8m0(byte: torch.Tensor) -> torch.Tensor:
    """`mx_device.e8m0_value`: the FP32 with exponent field `byte` (byte 0 gives 0, not 2^-127)."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def warn_out_of_bounds(reads: list, what: str) -> None:
    bad = sorted({tile for name, tile, inside in reads if not inside})
    if bad:
        names = sorted({name for name, tile, inside in reads if not inside})
        warnings.warn(f"{what} reads scale tiles {bad[:8]} of {names} outside their buffers (out-of-bounds global "
                      "loads; the model reads them as NaN scales)", ScaleTileOutOfBounds, stacklevel=3)
