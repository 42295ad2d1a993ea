"""RMSNorm, with and without the MX cast: `rms_norm`, `rms_norm_quantize`, the `RMSNorm` module."""
from gem_lp.norm.modules import RMSNorm
from gem_lp.norm.ops import rms_norm, rms_norm_quantize
from gem_lp.norm.reference import RMSNormQuantized, rms_norm_quantize_reference

__all__ = ["RMSNorm", "RMSNormQuantized", "rms_norm", "rms_norm_quantize", "rms_norm_quantize_reference"]
