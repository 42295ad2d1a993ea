"""gem-lp: exact MXFP8 numerics, jagged layouts, attention and fused norm/GEMM kernels for
jagged recommendation models, and a Hydra ranking-model trainer built on them."""

__version__ = "0.1.0"
