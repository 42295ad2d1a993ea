"""Triton device functions for the exact MX rules of `reference.py`, shared by every MX kernel.

All of them work on FP32 values and int32 bit patterns so that a kernel gives the same bytes on the GPU
and in Triton's interpreter. The one exception is the final E4M3 rounding: `HW_CAST=True` uses the
hardware conversion (`cvt.rn.satfinite.e4m3x2.f32`, round-to-nearest-even), which the interpreter does
not implement faithfully (it rounds half up without carrying into the exponent); `HW_CAST=False` is an
integer implementation of the same rounding. The GPU tests check both against the reference.
"""
import triton
import triton.language as tl


@triton.jit
def exact_f32(x):
    """FP32 of a float tensor, exactly. bf16 is widened by its bits (<< 16): Triton's interpreter flushes
    bf16 subnormals to 0 in `.to(tl.float32)`, the GPU does not; the bit form is exact on both (and is
    what the hardware conversion does anyway). fp16 and fp32 convert as usual."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def abs_bits(x):
    """|x| of an FP32 tensor as int32 bits: ordered like |x|, NaN/Inf >= 0x7F800000."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def scale_byte(amax_bits, RCEIL: tl.constexpr):
    """E8M0 byte (int32 0..255) of a block from its amax bits (see reference.scale_bytes)."""
    if RCEIL:
        d = amax_bits.to(tl.float32, bitcast=True) * 0.0022321429569274187
        dbits = d.to(tl.int32, bitcast=True)
        exp = (dbits >> 23) & 0xFF
        up = ((dbits & 0x7FFFFF) != 0).to(tl.int32)
        sub = (dbits > 0x00400000).to(tl.int32)
        byte = tl.where(exp > 0, exp + up, sub)
    else:
        byte = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) - 8, 0), 254)
    return tl.where(amax_bits >= 0x7F800000, 255, byte)


@triton.jit
def inv_scale(byte):
    """2^(127 - byte) as FP32 (byte 254 -> subnormal 2^-127; byte 255 -> unused, payload is overwritten)."""
    bits = tl.where(byte == 254, 0x00400000, tl.maximum(254 - byte, 0) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(y):
    """Round-to-nearest-even E4M3 byte (int32) of FP32 `y` with |y| <= 448, by integer arithmetic."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range (|y| >= 2^-6): keep 3 mantissa bits, RNE on the 20 dropped bits, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: multiples of 2^-9, RNE via the 2^23 magic number (fp32 adds round to even)
    ay = a.to(tl.float32, bitcast=True)
    sub = ((ay * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a >= 0x3C800000, normal, sub) | sign


@triton.jit
def encode(x, byte, HW_CAST: tl.constexpr):
    """E4M3 payload (as uint8) of FP32 `x` under scale bytes `byte` (broadcastable); NaN blocks -> 0x7F."""
    y = x * inv_scale(byte)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if HW_CAST:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        q = e4m3_bits(y)
    return tl.where(byte == 255, 0x7F, q).to(tl.uint8)
