"""MX device helpers for CuTe DSL kernels: the scale byte of a block max, the payload bytes of FP32 values, and the
stores of packed payload words. The rules are docs/numerics.md's (`gem_lp.mx.reference` is the oracle):

* block max as FP32 bit patterns: `|x|` bits order like `|x|`, and a NaN or Inf sorts above every finite value, so an
  integer max never drops a NaN (a float max would);
* `rceil`: d = fp32(amax * fp32(1/448)), byte = exponent field of d, plus 1 when d has mantissa bits; a subnormal d
  gives 1 when d > 2^-127, else 0. `floor`: clamp(exponent field of amax - 8, 0, 254). NaN/Inf in the block -> 255;
* payload = e4m3(x * 2^(127 - byte)) by the hardware conversion `cvt.rn.satfinite.e4m3x2.f32` (nearest-even,
  saturating to +-448, -0 -> 0x80); every payload byte of a byte-255 block is 0x7F.

All arithmetic is explicit PTX without `.ftz`: subnormal inputs, subnormal d and the subnormal factor 2^-127 (byte
254) must keep their values, as they do on the CPU.
"""
from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# fp32(1/448), the rceil rule's constant (`gem_lp.mx.formats.INV_E4M3_MAX`)
_F32_INV_E4M3_MAX = "0f3B124925"
# four payload bytes of a NaN/Inf block
NAN_WORD = 0x7F7F7F7F


def _asm(ret, args, body: str, constraints: str, loc=None, ip=None, side_effects: bool = False):
    return llvm.inline_asm(ret, [a.ir_value(loc=loc, ip=ip) for a in args], body, constraints,
                           has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def abs_max_nan(acc: Float32, x: Float32, *, loc=None, ip=None) -> Float32:
    """A value whose magnitude is max(|acc|, |x|), NaN when either is NaN (`max.NaN.xorsign.abs`: one instruction
    per element; the sign is meaningless, `scale_byte` drops it)."""
    return Float32(_asm(T.f32(), [Float32(acc), Float32(x)], "max.NaN.xorsign.abs.f32 $0, $1, $2;", "=f,f,f", loc,
                        ip))


@dsl_user_op
def scale_byte(amax: Float32, *, rceil: bool, loc=None, ip=None) -> Int32:
    """E8M0 scale byte (0..255) of a block whose maximum magnitude is |amax| (NaN or Inf -> 255).

    rceil: (bits(d) + 0x7FFFFF) >> 23 is d's exponent field plus one when d has mantissa bits (the carry), for normal
    and subnormal d alike, except that a subnormal d <= 2^-127 must give 0; Inf/NaN bits land at 255 and above, capped
    at 255."""
    if rceil:
        body = (
            "{\n\t.reg .f32 d;\n\t.reg .b32 a, db, b;\n\t.reg .pred psmall;\n\t"
            "mov.b32 a, $1;\n\tand.b32 a, a, 0x7FFFFFFF;\n\tmov.b32 d, a;\n\t"
            f"mul.rn.f32 d, d, {_F32_INV_E4M3_MAX};\n\t"
            "mov.b32 db, d;\n\tadd.u32 b, db, 0x7FFFFF;\n\tshr.u32 b, b, 23;\n\tmin.u32 b, b, 255;\n\t"
            "setp.le.u32 psmall, db, 0x400000;\n\tselp.u32 $0, 0, b, psmall;\n\t}")
    else:
        body = (
            "{\n\t.reg .b32 a;\n\t.reg .s32 e;\n\t.reg .pred pnan;\n\t"
            "mov.b32 a, $1;\n\tand.b32 a, a, 0x7FFFFFFF;\n\t"
            "shr.s32 e, a, 23;\n\tsub.s32 e, e, 8;\n\tmax.s32 e, e, 0;\n\tmin.s32 e, e, 254;\n\t"
            "setp.ge.s32 pnan, a, 0x7F800000;\n\tselp.s32 $0, 255, e, pnan;\n\t}")
    return Int32(_asm(T.i32(), [Float32(amax)], body, "=r,f", loc, ip))


@dsl_user_op
def inv_scale(byte: Int32, *, loc=None, ip=None) -> Float32:
    """2^(127 - byte) as FP32, for the bytes of finite blocks: those are <= 247 (rceil) or <= 246 (floor), so the
    factor is a normal number (the reference's subnormal case, byte 254, needs a block max above FP32's range).
    Byte 255 gives a meaningless factor: `payload_word` writes 0x7F there."""
    return Float32(_asm(T.f32(), [Int32(byte)], "{\n\t.reg .b32 t;\n\tsub.u32 t, 254, $1;\n\tshl.b32 $0, t, 23;\n\t}",
                        "=f,r", loc, ip))


@dsl_user_op
def payload_word(y0: Float32, y1: Float32, y2: Float32, y3: Float32, inv: Float32, byte: Int32, *, loc=None,
                 ip=None) -> Int32:
    """Four payload bytes (y0 in the low byte) of `y * inv` rounded to E4M3; 0x7F7F7F7F when `byte` is 255."""
    body = ("{\n\t.reg .f32 a, b, c, d;\n\t.reg .b16 lo, hi;\n\t.reg .b32 w;\n\t.reg .pred pnan;\n\t"
            "mul.rn.f32 a, $1, $5;\n\tmul.rn.f32 b, $2, $5;\n\tmul.rn.f32 c, $3, $5;\n\tmul.rn.f32 d, $4, $5;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 lo, b, a;\n\tcvt.rn.satfinite.e4m3x2.f32 hi, d, c;\n\t"
            "mov.b32 w, {lo, hi};\n\t"
            f"setp.eq.u32 pnan, $6, 255;\n\tselp.b32 $0, {NAN_WORD:#x}, w, pnan;\n\t}}")
    return Int32(_asm(T.i32(), [Float32(y0), Float32(y1), Float32(y2), Float32(y3), Float32(inv), Int32(byte)],
                      body, "=r,f,f,f,f,f,r", loc, ip))


@dsl_user_op
def store_u8(addr: Int64, offset: int, v: Int32, ok: Int32, *, loc=None, ip=None) -> None:
    """The low byte of `v` to global `addr + offset` (a constant) when `ok` != 0 (a predicated store, no branch)."""
    _asm(None, [Int64(addr), Int32(v), Int32(ok)],
         "{\n\t.reg .b16 h;\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\tcvt.u16.u32 h, $1;\n\t"
         f"@p st.global.u8 [$0+{int(offset)}], h;\n\t}}", "l,r,r", loc, ip, side_effects=True)


@dsl_user_op
def store_u32(addr: Int64, offset: int, v: Int32, ok: Int32, *, loc=None, ip=None) -> None:
    """Four bytes to global `addr + offset` (4-byte aligned; `offset` a constant) when `ok` != 0."""
    _asm(None, [Int64(addr), Int32(v), Int32(ok)],
         "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t"
         f"@p st.global.b32 [$0+{int(offset)}], $1;\n\t}}", "l,r,r", loc, ip, side_effects=True)


@dsl_user_op
def store_v2_u32(addr: Int64, offset: int, a: Int32, b: Int32, ok: Int32, *, loc=None, ip=None) -> None:
    """Eight bytes (a low) to global `addr + offset` (8-byte aligned; `offset` a constant) when `ok` != 0."""
    _asm(None, [Int64(addr), Int32(a), Int32(b), Int32(ok)],
         "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\t"
         f"@p st.global.v2.b32 [$0+{int(offset)}], {{$1, $2}};\n\t}}", "l,r,r,r", loc, ip, side_effects=True)


@dsl_user_op
def store_v4_u32(addr: Int64, offset: int, a: Int32, b: Int32, c: Int32, d: Int32, ok: Int32, *, loc=None,
                 ip=None) -> None:
    """Sixteen bytes (a lowest) to global `addr + offset` (16-byte aligned; `offset` a constant) when `ok` != 0."""
    _asm(None, [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d), Int32(ok)],
         "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $5, 0;\n\t"
         f"@p st.global.v4.b32 [$0+{int(offset)}], {{$1, $2, $3, $4}};\n\t}}", "l,r,r,r,r,r", loc, ip,
         side_effects=True)


@dsl_user_op
def red_add_f32x2(addr: Int64, offset: int, a: Float32, b: Float32, ok: Int32, *, loc=None, ip=None) -> None:
    """Atomically add `a` and `b` to the two FP32 at global `addr + offset` (8-byte aligned; `offset` a constant)
    when `ok` != 0: one vector reduction (sm_90 and later)."""
    _asm(None, [Int64(addr), Float32(a), Float32(b), Int32(ok)],
         "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\t"
         f"@p red.global.add.v2.f32 [$0+{int(offset)}], {{$1, $2}};\n\t}}", "l,f,f,r", loc, ip, side_effects=True)


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """`prmt.b32`: the bytes of `a` (0-3) and `b` (4-7) picked by the four nibbles of `selector` (lowest first)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {int(selector):#x};", "=r,r,r", loc, ip))


@dsl_user_op
def dequantized_bf16x2(word: Int32, byte: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """Two BF16 values (the lower one in the low half): payload bytes 0-1 (`high` False) or 2-3 (`high` True) of a
    payload word times the block's scale 2^(byte - 127), the dequantized values `gem_lp.mx.reference` gives, rounded
    to BF16 (nearest-even; E4M3 times a power of two is exact in FP32, and in BF16 unless it is below BF16's normal
    range). Byte 0 scales by the FP32 subnormal 2^-127, byte 255 gives NaN."""
    half = "hi" if high else "lo"
    body = ("{\n\t.reg .b16 lo, hi, f0, f1;\n\t.reg .b32 h, sb;\n\t.reg .f32 a, b, s;\n\t.reg .pred p;\n\t"
            "mov.b32 {lo, hi}, $1;\n\t"
            f"cvt.rn.f16x2.e4m3x2 h, {half};\n\t"
            "mov.b32 {f0, f1}, h;\n\tcvt.f32.f16 a, f0;\n\tcvt.f32.f16 b, f1;\n\t"
            "shl.b32 sb, $2, 23;\n\tsetp.eq.u32 p, $2, 0;\n\tselp.b32 sb, 0x00400000, sb, p;\n\t"
            "setp.eq.u32 p, $2, 255;\n\tselp.b32 sb, 0x7FC00000, sb, p;\n\tmov.b32 s, sb;\n\t"
            "mul.rn.f32 a, a, s;\n\tmul.rn.f32 b, b, s;\n\tcvt.rn.bf16x2.f32 $0, b, a;\n\t}")
    return Int32(_asm(T.i32(), [Int32(word), Int32(byte)], body, "=r,r,r", loc, ip))


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a / b, correctly rounded (as the CPU divides)."""
    return Float32(_asm(T.f32(), [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def rstd_of(mean_sq: Float32, eps: Float32, *, loc=None, ip=None) -> Float32:
    """1 / sqrt(mean_sq + eps), each step correctly rounded (the reference's `rsqrt` on the CPU is 1 / sqrt)."""
    body = "{\n\t.reg .f32 s;\n\tadd.rn.f32 s, $1, $2;\n\tsqrt.rn.f32 s, s;\n\tdiv.rn.f32 $0, 0f3F800000, s;\n\t}"
    return Float32(_asm(T.f32(), [Float32(mean_sq), Float32(eps)], body, "=f,f,f", loc, ip))
