"""Plain-PyTorch MXFP8 quantize/dequantize: the exact rules, and the oracle every kernel is tested against.

Per block, `amax` is taken on the FP32 bit patterns (|x| as an int32 is ordered like |x| itself, and a
NaN or Inf shows up as an exponent field of 255, so no NaN can hide from a float max):

* a NaN or Inf anywhere in the block -> scale byte 255 (E8M0 NaN) and every payload byte of the block
  is the E4M3 NaN 0x7F; the block dequantizes to NaN.
* `rceil`: `d = fp32(amax * fp32(1/448))`; byte = exponent field of `d`, plus 1 when `d`'s mantissa is
  non-zero; when `d` is an FP32 subnormal, byte = 1 if `d > 2^-127`, else 0.
* `floor` (OCP): byte = clamp(exponent field of `amax` - 8, 0, 254).
* payload = `x * 2^(127 - byte)` in FP32 (exact: a power-of-two scaling), saturated to +-448 and
  rounded to nearest-even E4M3; -0 stays 0x80.
* dequantize: `fp32(payload) * 2^(byte - 127)`, exact in FP32 for every byte; byte 255 -> NaN.

One edge of the rules: under `rceil`, a block whose max is at least 248 * 2^120 (within 3% of FP32's largest
value) gets byte 247 and a payload that rounds up to 256, and 256 * 2^120 = 2^128 dequantizes to inf.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_lp.mx.formats import (
    BLOCK,
    E4M3_MAX,
    E8M0_NAN,
    INV_E4M3_MAX,
    NONFINITE_PAYLOAD,
    PAYLOAD_DTYPE,
    MXTensor,
    ceil_div,
    check_input,
    check_scaling,
)

_ABS_MASK = 0x7FFFFFFF
_EXP_ALL_ONES = 0x7F800000  # |x| bits at or above this: Inf or NaN
_F32_2POW_M127 = 0x00400000  # bits of 2^-127, an FP32 subnormal


def abs_bits(x32: torch.Tensor) -> torch.Tensor:
    """|x| of an FP32 tensor as int32 bit patterns (monotonic in |x|; NaN/Inf >= 0x7F800000)."""
    return x32.view(torch.int32) & _ABS_MASK


def scale_bytes(amax_bits: torch.Tensor, scaling: str = "rceil") -> torch.Tensor:
    """E8M0 scale bytes (uint8) from per-block amax given as FP32 bit patterns (int32)."""
    check_scaling(scaling)
    amax_bits = amax_bits.to(torch.int32)
    if scaling == "rceil":
        inv = torch.tensor(INV_E4M3_MAX, dtype=torch.float32, device=amax_bits.device)
        d = amax_bits.view(torch.float32) * inv
        dbits = d.view(torch.int32)
        exp = (dbits >> 23) & 0xFF
        mant = dbits & 0x7FFFFF
        byte = torch.where(exp > 0, exp + (mant != 0).to(torch.int32), (dbits > _F32_2POW_M127).to(torch.int32))
    else:
        byte = (((amax_bits >> 23) & 0xFF) - 8).clamp(0, 254)
    byte = torch.where(amax_bits >= _EXP_ALL_ONES, torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def inv_scale_f32(byte: torch.Tensor) -> torch.Tensor:
    """2^(127 - byte) in FP32 (byte 254 -> the subnormal 2^-127); byte 255 gives a value that callers overwrite."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 254, torch.full_like(b, _F32_2POW_M127), (254 - b).clamp(min=0) << 23)
    return bits.view(torch.float32)


def scale_f32(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) in FP32 (byte 0 -> the subnormal 2^-127, byte 255 -> NaN)."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, _F32_2POW_M127), b << 23)
    return torch.where(b == E8M0_NAN, torch.nan, bits.view(torch.float32))


def encode_payload(x32: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """E4M3 payload of FP32 values `x32` under broadcastable scale bytes `byte`."""
    y = (x32 * inv_scale_f32(byte)).clamp(-E4M3_MAX, E4M3_MAX)
    p = y.to(PAYLOAD_DTYPE).view(torch.uint8)
    p = torch.where(byte == E8M0_NAN, torch.full_like(p, NONFINITE_PAYLOAD), p)
    return p.view(PAYLOAD_DTYPE)


def _pad_dim(x: torch.Tensor, dim: int, allow_partial: bool, what: str) -> tuple[torch.Tensor, int]:
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % BLOCK == 0:
        return x, n
    if not allow_partial:
        raise ValueError(
            f"{what} has size {n}, which is not a multiple of {BLOCK}; MX blocks are 32 elements "
            f"(pass allow_partial=True to let the last block take its max over the real elements only)"
        )
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, ceil_div(n, BLOCK) * BLOCK - n]
    return torch.nn.functional.pad(x, pad), n


def quantize_reference(
    x: torch.Tensor,
    *,
    axis: int = -1,
    scaling: str = "rceil",
    block: str = "1d",
    allow_partial: bool = False,
) -> MXTensor:
    """MXFP8 quantization by the exact rules (see module docstring).

    Args:
        x: float32/bfloat16/float16 tensor.
        axis: dimension blocked by `block="1d"` (32 consecutive elements); ignored by `"square"`.
        scaling: `"rceil"` (default) or `"floor"`.
        block: `"1d"` or `"square"` (32x32 over the last two dims).
        allow_partial: let a blocked dimension that is not a multiple of 32 end in a partial block,
            whose scale comes from its real elements only (zero padding, never stored).

    Returns:
        MXTensor with payload of `x.shape` and plain scales.
    """
    check_input(x)
    check_scaling(scaling)
    x32 = x.detach().to(torch.float32)
    if block == "1d":
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension")
        ax = axis % x.dim() if -x.dim() <= axis < x.dim() else None
        if ax is None:
            raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dims")
        xt = x32.movedim(ax, -1)
        xp, n = _pad_dim(xt, -1, allow_partial, f"x.shape[{ax}]")
        blocks = xp.reshape(*xp.shape[:-1], xp.shape[-1] // BLOCK, BLOCK)
        byte = scale_bytes(abs_bits(blocks).amax(-1), scaling)
        data = encode_payload(blocks, byte.unsqueeze(-1)).reshape(xp.shape)[..., :n]
        return MXTensor(data.movedim(-1, ax).contiguous(), byte.movedim(-1, ax).contiguous(),
                        "1d", ax, scaling, x.dtype)
    if block == "square":
        if x.dim() < 2:
            raise ValueError(f"block='square' needs at least 2 dims, got shape {tuple(x.shape)}")
        xp, r = _pad_dim(x32, x.dim() - 2, allow_partial, f"x.shape[{x.dim() - 2}]")
        xp, c = _pad_dim(xp, x.dim() - 1, allow_partial, f"x.shape[{x.dim() - 1}]")
        R, C = xp.shape[-2:]
        blocks = xp.reshape(*xp.shape[:-2], R // BLOCK, BLOCK, C // BLOCK, BLOCK)
        byte = scale_bytes(abs_bits(blocks).amax(dim=(-3, -1)), scaling)
        data = encode_payload(blocks, byte[..., :, None, :, None]).reshape(xp.shape)[..., :r, :c]
        return MXTensor(data.contiguous(), byte, "square", None, scaling, x.dtype)
    raise ValueError(f"block must be '1d' or 'square', got {block!r}")


def dequantize(mx: MXTensor) -> torch.Tensor:
    """FP32 values of an MXTensor (exact; NaN for blocks whose scale byte is 255)."""
    payload = mx.data.to(torch.float32)
    scale = mx.plain_scale()
    if mx.scale_layout == "blocked":
        factor = scale_f32(scale).repeat_interleave(BLOCK, dim=1)[:, : payload.shape[1]]
        return payload * factor
    if mx.block == "1d":
        ax = mx.axis % payload.dim()
        factor = scale_f32(scale).repeat_interleave(BLOCK, dim=ax)
        factor = factor.narrow(ax, 0, payload.shape[ax])
        return payload * factor
    if mx.block == "square":
        factor = scale_f32(scale).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
        factor = factor[..., : payload.shape[-2], : payload.shape[-1]]
        return payload * factor
    raise ValueError(f"unknown block {mx.block!r}")


# The prologues the MX cast kernels can apply before quantizing (`gem_lp.mx.kernels`): an input activation, as the
# torch functions that define them (the oracle; the kernels compute the same values), or RMSNorm (`rms_norm_fp32`).
INPUT_ACTIVATIONS = {"silu": F.silu}


def check_input_activation(activation: str | None, name: str = "input_activation") -> None:
    """A clear error unless `activation` is None or a key of INPUT_ACTIVATIONS (`name`: the argument's name)."""
    if activation is not None and activation not in INPUT_ACTIVATIONS:
        raise ValueError(f"{name} must be None or one of {tuple(INPUT_ACTIVATIONS)}, got {activation!r}")


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = fp32(x) * rstd * fp32(weight) `[..., K]` and rstd `[...]`, both FP32 (differentiable)."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.square().mean(-1) + eps)
    return x32 * rstd[..., None] * weight.to(torch.float32), rstd
