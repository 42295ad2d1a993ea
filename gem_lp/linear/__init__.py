"""MX linear layers (the MXLinear recipe, docs/numerics.md): `mx_linear`, `rms_norm_mx_linear`, `rms_norm_mx_mlp` and
their modules `MXLinear`, `RMSNormMXLinear`."""
from gem_lp.linear.modules import RECIPES, MXLinear, RMSNormMXLinear
from gem_lp.linear.ops import mx_linear, rms_norm_mx_linear, rms_norm_mx_mlp

__all__ = ["RECIPES", "MXLinear", "RMSNormMXLinear", "mx_linear", "rms_norm_mx_linear", "rms_norm_mx_mlp"]
