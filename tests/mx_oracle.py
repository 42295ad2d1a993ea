"""A second, independent implementation of the MX rules in pure Python (floats and struct, no torch math).

It is the oracle of the oracle: `gem_lp.mx.reference` (torch) is checked against it element by element, so a
mistake in either shows up as a mismatch. Written from docs/numerics.md with different means on purpose
(`math.frexp` instead of bit masks, a table search instead of a cast).
"""
import bisect
import math
import struct


def f32(v: float) -> float:
    """Round a Python float to the nearest FP32 value (round-to-nearest-even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


INV448 = f32(1 / 448)

# E4M3 (fn) non-negative finite values by code 0..126, from the format definition.
E4M3_VALUES = [((c & 7) / 8) * 2.0**-6 if (c >> 3) == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
               for c in range(127)]


def e4m3_code(y: float) -> int:
    """Round-to-nearest-even E4M3 code of y, saturating at 448; -0 -> 0x80."""
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = min(abs(y), 448.0)
    i = bisect.bisect_left(E4M3_VALUES, a)
    if i < len(E4M3_VALUES) and E4M3_VALUES[i] == a:
        return sign | i
    lo, hi = i - 1, i
    mid = (E4M3_VALUES[lo] + E4M3_VALUES[hi]) / 2  # exact in double
    if a < mid:
        c = lo
    elif a > mid:
        c = hi
    else:
        c = lo if lo % 2 == 0 else hi
    return sign | c


def scale_byte(block: list[float], scaling: str) -> int:
    if any(not math.isfinite(v) for v in block):
        return 255
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0
    if scaling == "floor":
        m, q = math.frexp(amax)  # amax = m * 2^q, 0.5 <= m < 1
        exp_field = q - 1 + 127 if amax >= 2.0**-126 else 0
        return min(max(exp_field - 8, 0), 254)
    d = f32(amax * INV448)
    if d == 0:
        return 0
    if d < 2.0**-126:
        return 1 if d > 2.0**-127 else 0
    m, q = math.frexp(d)
    return (q - 1 + 127) + (0 if m == 0.5 else 1)


def quantize_block(block: list[float], scaling: str) -> tuple[int, list[int]]:
    """(scale byte, payload codes) of one block of FP32 values given as Python floats."""
    byte = scale_byte(block, scaling)
    if byte == 255:
        return byte, [0x7F] * len(block)
    k = 127 - byte
    return byte, [e4m3_code(v * 2.0**k) for v in block]


def dequantize_value(code: int, byte: int) -> float:
    if byte == 255 or (code & 0x7F) == 0x7F:
        return math.nan
    v = E4M3_VALUES[code & 0x7F] * 2.0 ** (byte - 127)
    return -v if code & 0x80 else v
