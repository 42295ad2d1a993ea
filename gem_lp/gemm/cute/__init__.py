"""The MX GEMM on the CuTe DSL: `Y [M, N] = deq(A) @ B^T (+ bias)`, A an MX operand (E4M3 payload `[M, K]` + E8M0
scales per row per 32-wide k block), B a BF16 weight `[N, K]` (K-major), FP32 accumulation.

sm_90 (`mx_gemm_sm90`): quack's persistent cooperative `GemmDefaultSm90` with its register-sourced WGMMA mainloop and
our A-operand transform (`transform.MXTransformA`): A's payload bytes and the blocked scale tiles are TMA'd into shared
memory with B, and each k16 block of A is decoded to the exact BF16 fragment in registers (hardware E4M3 -> BF16
convert, one BF16 multiply by 2^(s - 127)) right before its WGMMA. There is no dequantize pass and no BF16 copy of A
in memory. Hopper has no block-scaled MMA; E4M3 x 2^k is exact in BF16 (down to BF16's subnormal step 2^-133), so
BF16 WGMMA on these fragments gives the exact MX product up to the FP32 accumulation order.

Scales: the kernel reads the 128x4 **blocked** layout (`gem_lp.mx.to_blocked`; flat, `blocked_size(M, K/32)` bytes,
padding bytes 0), which the producers already write (`norm_mx_cast(..., blocked_scales=True)`, the GEMM operand
casts). One 512-byte blocked tile holds the scales of 128 rows x 128 k: one TMA box per CTA tile and k-tile
(tile_K = 128), and one 32-bit shared-memory load per fragment row. The plain `[M, K/32]` layout cannot be TMA'd for
K < 512 (its row stride K/32 bytes is not a multiple of 16) and would need a byte gather per row; it is accepted and
converted by `to_blocked` first (a pass over the scales only, 1/32 of the payload bytes).

Shapes: any M >= 0 (jagged token counts; rows past M are TMA zero fill and not stored), K a multiple of 32 (a last
k-tile past K is zero fill), N a multiple of 8 (D's rows 16-byte aligned for the TMA store; quack's tile N).

Not wired into MXLinear yet: it is compiled for sm_90a on CPU (`python -m gem_lp.compile_check --arch sm_90a --op
gemm`), not yet run on a GPU. How it would be wired, in `gem_lp/norm_gemm/triton_gemm.py`'s `cublas` route:

* forward (`MXLinearTritonFunction.forward`, and `RMSNormMXLinearTritonFunction.forward` the same way): today the
  producer `rms_norm_mx(x2, ..., rowwise=mx_ops, row_operand=not mx_ops, ...)` writes X's exact BF16 values (the
  dequantized operand, 2 bytes per element, which cuBLAS reads back); it would write X's rowwise MX payload + blocked
  scales instead (`rowwise=True`, `row_operand=False`: 1 byte + 1/32), and
  `_gemm_nt(out.row_operand, w_ops.row, "cublas", x2.dtype, bias)` -- cuBLAS `torch.mm` / `torch.addmm` -- becomes
  `mx_gemm_sm90(out.rowwise.data, out.rowwise.scale, w_ops.row, bias, x2.dtype)`. `w_ops.row` (the MX-exact BF16
  weight `[N, K]`, made by `weight_operands` once per optimizer step) is B as it is. M is no longer bucketed
  (`gemm_rows`): the kernel is built once per (N, K) with M dynamic.
* backward dX (`_linear_backward`, `need_in`): `_gemm_nt(dy_row, w_ops.col.t(), ...)` likewise, with dY's rowwise MX
  cast (`_dy_operands` writing `rowwise=True`) as A; B = `w_ops.col.t()` (`[K_in, N]`) must then be contiguous along
  N, so `weight_operands` would keep W^T's BF16 values contiguous (one transpose per optimizer step) instead of the
  transposed view it returns today.
* dW stays on the dequantize + cuBLAS route: both of its operands are MX (dY^T and X^T along M), and this kernel
  takes one MX operand.

Unmeasured (no GPU run yet): correctness on the device (`tests/gemm/test_cute_gemm.py`), the speed against the
dequantize pass + cuBLAS and against cuBLAS / quack BF16 alone (`python -m benchmarks.bench_mx_gemm`), the launch
table (tile 128x128 by default; 128x256, 128x192 and cluster 2 are the candidates the benchmark times), whether the
decode hides under the WGMMAs (about 20 instructions per thread per k16 block and m64 atom, half of them converts),
and whether `mul.rn.bf16x2` keeps BF16 subnormals on the H200 (scale byte 0 is the subnormal 2^-127; the tests'
byte-0 rows check it).

sm_100 (compiled, not launched): Blackwell has the block-scaled MMA, so its MX GEMM is quack's own `GemmDefaultSm100`
with MXFP8 A and B and E8M0 scale factors per 32 k (`quack/blockscaled`; the same 512-byte 128x4 tiles as
`to_blocked`), no transform. `launch.build_sm100_mxfp8` builds it (2-CTA 256x256 tile) and `compile_check --arch
sm_100a --op gemm` checks that its PTX issues `tcgen05.mma.cta_group::2.kind::mxf8f6f4.block_scale.block32`. It takes
an MX B (the weight's MX cast rather than its BF16 form), so its public launch will be its own function; none is
written yet (scale-factor tensor view `(rm, rk, 32, 4, 4)` of the blocked bytes, and the run, are unverified).
"""
from .launch import GemmLaunch, mx_gemm_sm90

__all__ = ["GemmLaunch", "mx_gemm_sm90"]
