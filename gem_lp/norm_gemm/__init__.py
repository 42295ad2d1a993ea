"""Removed: the package is split by op."""
raise ImportError(
    "gem_lp.norm_gemm is gone; its names moved by op: MXLinear, RMSNormMXLinear, mx_linear, rms_norm_mx_linear, "
    "rms_norm_mx_mlp -> gem_lp.linear; RMSNorm, rms_norm, rms_norm_quantize, RMSNormQuantized -> gem_lp.norm")
