"""RMSNorm, with and without the MX cast: `rms_norm`, `rms_norm_quantize`, the `RMSNorm` module."""
from gem_lp.linear.modules import RMSNorm
from gem_lp.linear.ops import rms_norm, rms_norm_quantize
from gem_lp.linear.reference import RMSNormQuantized

__all__ = ["RMSNorm", "RMSNormQuantized", "rms_norm", "rms_norm_quantize"]
