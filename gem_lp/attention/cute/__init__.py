"""Jagged attention on the CuTe DSL: FlashAttention-4's kernels for BF16, and FA4's Hopper kernels extended with
the LP-FA4 MXFP8 recipe (`fwd_sm90`, `bwd_sm90`). Importing this package needs the CuTe DSL stack
(nvidia-cutlass-dsl, flash-attn-4, quack-kernels); `gem_lp.attention` imports it only on the `cute` backend."""
