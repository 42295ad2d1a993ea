"""RMSNorm(+MX quantize), the MXFP8 linear recipe and their modules (recipe: docs/numerics.md)."""
from .modules import RECIPES, MXLinear, RMSNorm, RMSNormMXLinear
from .ops import mx_linear, rms_norm, rms_norm_mx_linear, rms_norm_mx_mlp, rms_norm_quantize
from .reference import RMSNormQuantized

__all__ = [
    "RECIPES",
    "MXLinear",
    "RMSNorm",
    "RMSNormMXLinear",
    "RMSNormQuantized",
    "mx_linear",
    "rms_norm",
    "rms_norm_mx_linear",
    "rms_norm_mx_mlp",
    "rms_norm_quantize",
]
