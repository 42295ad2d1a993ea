"""GEMM kernels (the MX GEMM on the CuTe DSL: `gem_lp.gemm.cute`)."""
