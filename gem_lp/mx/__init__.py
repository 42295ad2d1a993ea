"""MXFP8 numerics (OCP MX v1.0, E4M3 payload, E8M0 scales per 32 elements), exact by docs/numerics.md."""
from gem_lp.mx.formats import BLOCK, E4M3_MAX, MXTensor
from gem_lp.mx.layout import blocked_index, blocked_size, from_blocked, to_blocked
from gem_lp.mx.ops import dequantize, quantize, quantize_dual
from gem_lp.mx.reference import quantize_reference, scale_bytes

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "MXTensor",
    "blocked_index",
    "blocked_size",
    "dequantize",
    "from_blocked",
    "quantize",
    "quantize_dual",
    "quantize_reference",
    "scale_bytes",
    "to_blocked",
]
