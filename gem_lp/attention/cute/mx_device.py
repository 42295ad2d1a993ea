"""Device helpers of the MX attention kernels: E8M0 scales of a block max, and FP32 pairs rounded to a block's
MX (E4M3 x 2^k) grid, delivered as the BF16x2 operand register of a wgmma (every MX value is exact in BF16).

Rounding goes through the hardware conversion, `cvt.rn.satfinite.e4m3x2.f32` (round-to-nearest-even, E4M3
subnormals included), and back through `cvt.rn.f16x2.e4m3x2`. FP16 holds every E4M3 value; its bits shifted
right by 3 are the same value times 2^-112 as BF16 bits (exponent field 5 -> 8 bits, mantissa 10 -> 7 bits, the
low bits being zero), so one shift, one mask and one BF16 multiply give the BF16 operand. The scale rule is the
`rceil` rule of docs/numerics.md (`gem_lp.mx.reference.scale_bytes`): d = fp32(amax * fp32(1/448)), byte = the
exponent of d, plus one when d has mantissa bits, 255 when the block holds a NaN or an Inf.

BF16 has FP32's exponent range but 7 mantissa bits, so a dequantized value is exact unless it falls below BF16's
subnormal floor 2^-133 (a block scale byte below 3; such blocks hold values below 2^-118).
"""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# BF16x2 bit patterns: -0 (the neutral addend of a multiply written as an FMA), 2^104 (const_p: a payload of
# 256 p times 2^-112 back to p), 2^112 (payload times 2^-112 back to the payload).
_BF16X2_NEG_ZERO = "0x80008000"
_BF16X2_2POW104 = "0x73807380"
_BF16X2_2POW112 = "0x77807780"
# The E4M3 payload of const_p is e4m3(256 p); 2^8 as an FP32 immediate.
_F32_256 = "0f43800000"
# fp32(1/448), the rceil rule's constant.
_F32_INV_E4M3_MAX = "0f3B124925"


def _asm(ret, args, body: str, constraints: str, loc=None, ip=None):
    return llvm.inline_asm(ret, [a.ir_value(loc=loc, ip=ip) for a in args], body, constraints,
                           has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def abs_bits_max(acc: Int32, x: Float32, *, loc=None, ip=None) -> Int32:
    """max(acc, |x| as FP32 bits): the bits order like |x|, and NaN/Inf sort above every finite value."""
    return Int32(_asm(T.i32(), [Int32(acc), Float32(x)],
                      "{\n\t.reg .b32 t;\n\tand.b32 t, $2, 0x7FFFFFFF;\n\tmax.s32 $0, $1, t;\n\t}",
                      "=r,r,f", loc, ip))


@dsl_user_op
def fmax_bits(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """max of two |x| bit patterns."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "max.s32 $0, $1, $2;", "=r,r,r", loc, ip))


def _rceil_byte(amax: str) -> str:
    """PTX computing the rceil byte of the block max bits in operand `amax` into register `byte`, and predicate
    `pnan` (byte 255)."""
    return _RCEIL_BYTE.replace("$2", amax)


_RCEIL_BYTE = (
    ".reg .f32 d;\n\t.reg .b32 db, e, m, t, byte;\n\t.reg .pred pm, psub, pbig, pnan;\n\t"
    "mov.b32 d, $2;\n\t"
    f"mul.rn.f32 d, d, {_F32_INV_E4M3_MAX};\n\t"
    "mov.b32 db, d;\n\t"
    "shr.u32 e, db, 23;\n\tand.b32 e, e, 255;\n\t"
    "and.b32 m, db, 0x7FFFFF;\n\t"
    "setp.ne.u32 pm, m, 0;\n\tselp.u32 t, 1, 0, pm;\n\tadd.u32 byte, e, t;\n\t"
    "setp.eq.u32 psub, e, 0;\n\tsetp.gt.u32 pbig, db, 0x400000;\n\tselp.u32 t, 1, 0, pbig;\n\t"
    "selp.u32 byte, t, byte, psub;\n\t"
    "setp.ge.s32 pnan, $2, 0x7F800000;\n\tselp.u32 byte, 255, byte, pnan;\n\t"
)


@dsl_user_op
def mx_scales(amax_bits: Int32, *, single_step: bool, loc=None, ip=None) -> tuple[Float32, Int32]:
    """(2^(127 - byte), the dequantizing BF16x2 factor) of a block whose |max| bits are `amax_bits`.

    The factor is 2^(byte - 15) with `single_step` (one multiply takes the shifted FP16 bits, value times 2^-112,
    to the dequantized value; exact for byte <= 142, always true of P whose max is <= 1), else 2^(byte - 127)
    (applied after the factor 2^112). Byte 255 (NaN / Inf in the block) gives NaN for both, so the whole block
    dequantizes to NaN.
    """
    if single_step:
        dq = "add.u32 t, byte, 112;\n\tshl.b32 t, t, 7;\n\t"
    else:  # byte 0 -> 2^-127 = BF16 subnormal 0x0040
        dq = ("shl.b32 t, byte, 7;\n\tsetp.eq.u32 psub, byte, 0;\n\tselp.b32 t, 0x40, t, psub;\n\t")
    body = (
        "{\n\t" + _rceil_byte("$2") +
        # 2^(127 - byte) as FP32 bits; byte <= 253 for any finite block max (the max would exceed FP32's range)
        "sub.u32 t, 254, byte;\n\tshl.b32 t, t, 23;\n\tselp.b32 $0, 0x7FC00000, t, pnan;\n\t"
        + dq +
        "selp.b32 t, 0x7FC0, t, pnan;\n\tshl.b32 m, t, 16;\n\tor.b32 $1, t, m;\n\t}"
    )
    out = _asm(llvm.StructType.get_literal([T.f32(), T.i32()]), [Int32(amax_bits)], body, "=f,=r,r", loc, ip)
    return (Float32(llvm.extractvalue(T.f32(), out, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), out, [1], loc=loc, ip=ip)))


# PTX appended to a conversion whose BF16x2 result is in $0: $1 = the FP32 sum of its two halves.
_PAIR_SUM = ("shl.b32 k, $0, 16;\n\tand.b32 z, $0, 0xFFFF0000;\n\tmov.b32 x, k;\n\tmov.b32 y, z;\n\t"
             "add.rn.f32 $1, x, y;\n\t")


def _with_sum(ret_sum: bool, body: str, constraints: str, args, loc, ip):
    """Run a pair conversion (BF16x2 in $0); with `ret_sum`, also return the FP32 sum of the two values."""
    if not ret_sum:
        return Int32(_asm(T.i32(), args, body + "}", constraints, loc, ip))
    body = body.replace("$", "$$").replace("$$0", "$0")  # shift the inputs by one: $1 is the second output
    for i in range(9, 0, -1):
        body = body.replace(f"$${i}", f"${i + 1}")
    out = _asm(llvm.StructType.get_literal([T.i32(), T.f32()]), args, body + _PAIR_SUM + "}",
               "=r,=f," + constraints[3:], loc, ip)
    return (Int32(llvm.extractvalue(T.i32(), out, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), out, [1], loc=loc, ip=ip)))


@dsl_user_op
def const_p_bf16x2(p0: Float32, p1: Float32, *, ret_sum: bool = False, loc=None, ip=None):
    """BF16x2 of fp32(e4m3(256 p)) * 2^-8 for p0 (low half) and p1 (high half), 0 <= p <= 1: const_p's P.
    With `ret_sum`, (that, the FP32 sum of the two rounded values)."""
    body = (
        "{\n\t.reg .b16 e;\n\t.reg .b32 h, k, z;\n\t.reg .f32 x, y;\n\t"
        f"mul.rn.f32 x, $1, {_F32_256};\n\tmul.rn.f32 y, $2, {_F32_256};\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 e, y, x;\n\t"
        "cvt.rn.f16x2.e4m3x2 h, e;\n\t"
        "shr.b32 h, h, 3;\n\tand.b32 h, h, 0x0FFF0FFF;\n\t"
        f"mov.b32 k, {_BF16X2_2POW104};\n\tmov.b32 z, {_BF16X2_NEG_ZERO};\n\t"
        "fma.rn.bf16x2 $0, h, k, z;\n\t"
    )
    return _with_sum(ret_sum, body, "=r,f,f", [Float32(p0), Float32(p1)], loc, ip)


@dsl_user_op
def e4m3_bf16x2(x0: Float32, x1: Float32, *, ret_sum: bool = False, loc=None, ip=None):
    """BF16x2 of e4m3(x0) (low half), e4m3(x1) (high half), 0 <= x <= 448: a payload under a fixed scale.
    With `ret_sum`, (that, the FP32 sum of the two rounded values)."""
    body = (
        "{\n\t.reg .b16 e;\n\t.reg .b32 h, k, z;\n\t.reg .f32 x, y;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 e, $2, $1;\n\t"
        "cvt.rn.f16x2.e4m3x2 h, e;\n\t"
        "shr.b32 h, h, 3;\n\tand.b32 h, h, 0x0FFF0FFF;\n\t"
        f"mov.b32 k, {_BF16X2_2POW112};\n\tmov.b32 z, {_BF16X2_NEG_ZERO};\n\t"
        "fma.rn.bf16x2 $0, h, k, z;\n\t"
    )
    return _with_sum(ret_sum, body, "=r,f,f", [Float32(x0), Float32(x1)], loc, ip)


@dsl_user_op
def mx_bf16x2(x0: Float32, x1: Float32, inv_scale: Float32, dequant: Int32, *, signed: bool,
              single_step: bool, ret_sum: bool = False, loc=None, ip=None):
    """BF16x2 of the MX-dequantized x0 (low half), x1 (high half) under one block's scale: `inv_scale` and
    `dequant` from `mx_scales(..., single_step=single_step)`. `signed=False` when x >= 0 (skips the sign).
    With `ret_sum`, (that, the FP32 sum of the two dequantized values)."""
    sign = ("and.b32 s, h, 0x80008000;\n\t" if signed else "")
    merge = ("or.b32 m, m, s;\n\t" if signed else "")
    if single_step:
        tail = "fma.rn.bf16x2 $0, m, $4, z;\n\t"
    else:
        tail = f"mov.b32 k, {_BF16X2_2POW112};\n\tfma.rn.bf16x2 m, m, k, z;\n\tfma.rn.bf16x2 $0, m, $4, z;\n\t"
    body = (
        "{\n\t.reg .b16 e;\n\t.reg .b32 h, m, s, k, z;\n\t.reg .f32 x, y;\n\t"
        "mul.rn.f32 x, $1, $3;\n\tmul.rn.f32 y, $2, $3;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 e, y, x;\n\t"
        "cvt.rn.f16x2.e4m3x2 h, e;\n\t"
        + sign +
        "shr.b32 m, h, 3;\n\tand.b32 m, m, 0x0FFF0FFF;\n\t"
        + merge +
        f"mov.b32 z, {_BF16X2_NEG_ZERO};\n\t" + tail
    )
    return _with_sum(ret_sum, body, "=r,f,f,f,r", [Float32(x0), Float32(x1), Float32(inv_scale), Int32(dequant)],
                     loc, ip)


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """ceil(x) as FP32 (+-inf and NaN unchanged)."""
    return Float32(_asm(T.f32(), [Float32(x)], "cvt.rpi.f32.f32 $0, $1;", "=f,f", loc, ip))


@dsl_user_op
def rint_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """x rounded to the nearest integer (ties to even) as FP32."""
    return Float32(_asm(T.f32(), [Float32(x)], "cvt.rni.f32.f32 $0, $1;", "=f,f", loc, ip))


@dsl_user_op
def exp2_int(k: Float32, *, loc=None, ip=None) -> Float32:
    """2^k for an integer-valued k, exactly, built from the exponent bits: 0 for k < -126 (and for k = -inf), FP32's
    largest power of two for k > 127; NaN gives 1."""
    body = ("{\n\t.reg .s32 e;\n\t"
            "cvt.rni.s32.f32 e, $1;\n\t"  # saturates to the int32 range; NaN -> 0
            "max.s32 e, e, -127;\n\tmin.s32 e, e, 127;\n\tadd.s32 e, e, 127;\n\t"
            "shl.b32 e, e, 23;\n\tmov.b32 $0, e;\n\t}")
    return Float32(_asm(T.f32(), [Float32(k)], body, "=f,f", loc, ip))


@dsl_user_op
def e4m3x4_sum(word: Int32, *, loc=None, ip=None) -> Float32:
    """The FP32 sum of the four E4M3 values packed in `word` (exact conversions; FP32 adds)."""
    body = ("{\n\t.reg .b16 lo, hi, a, b, c, d;\n\t.reg .b32 h0, h1;\n\t.reg .f32 fa, fb, fc, fd;\n\t"
            "mov.b32 {lo, hi}, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 h0, lo;\n\tcvt.rn.f16x2.e4m3x2 h1, hi;\n\t"
            "mov.b32 {a, b}, h0;\n\tmov.b32 {c, d}, h1;\n\t"
            "cvt.f32.f16 fa, a;\n\tcvt.f32.f16 fb, b;\n\tcvt.f32.f16 fc, c;\n\tcvt.f32.f16 fd, d;\n\t"
            "add.rn.f32 fa, fa, fb;\n\tadd.rn.f32 fc, fc, fd;\n\tadd.rn.f32 $0, fa, fc;\n\t}")
    return Float32(_asm(T.f32(), [Int32(word)], body, "=f,r", loc, ip))


@dsl_user_op
def rceil_scale(amax_bits: Int32, *, loc=None, ip=None) -> tuple[Float32, Int32]:
    """(2^(127 - byte), byte): the E8M0 scale byte of a block whose |max| bits are `amax_bits` by the rceil rule,
    and the factor that takes the block's values to their E4M3 payload range (NaN for byte 255)."""
    body = ("{\n\t" + _rceil_byte("$2") +
            "sub.u32 t, 254, byte;\n\tshl.b32 t, t, 23;\n\tselp.b32 $0, 0x7FC00000, t, pnan;\n\t"
            "mov.b32 $1, byte;\n\t}")
    out = _asm(llvm.StructType.get_literal([T.f32(), T.i32()]), [Int32(amax_bits)], body, "=f,=r,r", loc, ip)
    return (Float32(llvm.extractvalue(T.f32(), out, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), out, [1], loc=loc, ip=ip)))


@dsl_user_op
def e8m0_value(byte: Int32, *, loc=None, ip=None) -> Float32:
    """2^(byte - 127) as FP32 (byte 0 -> 0 rather than the subnormal 2^-127; 255 -> inf)."""
    return Float32(_asm(T.f32(), [Int32(byte)], "{\n\t.reg .b32 t;\n\tshl.b32 t, $1, 23;\n\tmov.b32 $0, t;\n\t}",
                        "=f,r", loc, ip))
