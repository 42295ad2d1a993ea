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

Measured on the H200 (`python -m benchmarks.bench_mx_gemm`, docs/PERF.md): exact (the same 55.6 dB against the FP32
product as cuBLAS on deq(A), byte-0 scale rows included: `tests/gemm/test_cute_gemm.py` passes on the device), but at
0.65-0.78x of the best BF16 GEMM (quack / cuBLAS on an A already in BF16): the decode does not hide under the
WGMMAs. Against the current route (a dequantize pass, then cuBLAS) it is slower at four of the model shapes (0.65-0.76x
against 0.73-0.95x of the best peer) and faster at K = 256 -> N = 768, the GPU model's QKV projection (0.034 ms
against 0.054-0.067 ms), where the pass costs as much as the GEMM.

Not wired into MXLinear: the route it would replace is faster at most shapes. Where it would go, in
`gem_lp/norm_gemm/triton_gemm.py`'s `cublas` route: the forward's producer would write X's rowwise MX payload and
blocked scales (`rowwise=True`, `row_operand=False`) instead of X's exact BF16 values, and `_gemm_nt(out.row_operand,
w_ops.row, "cublas", ...)` would become `mx_gemm_sm90(out.rowwise.data, out.rowwise.scale, w_ops.row, bias,
x2.dtype)` (`w_ops.row`, the MX-exact BF16 weight made once per optimizer step, is B as it is; M dynamic, no
`gemm_rows` bucketing); the backward's dX likewise with dY's rowwise cast as A and W^T's BF16 values kept contiguous
along N. dW stays on the dequantize + cuBLAS route (both of its operands are MX).

sm_100 (compiled, not launched): Blackwell has the block-scaled MMA, so its MX GEMM is quack's own `GemmDefaultSm100`
with MXFP8 A and B and E8M0 scale factors per 32 k (`quack/blockscaled`; the same 512-byte 128x4 tiles as
`to_blocked`), no transform. `launch.build_sm100_mxfp8` builds it (2-CTA 256x256 tile) and `compile_check --arch
sm_100a --op gemm` checks that its PTX issues `tcgen05.mma.cta_group::2.kind::mxf8f6f4.block_scale.block32`. It takes
an MX B (the weight's MX cast rather than its BF16 form), so its public launch will be its own function; none is
written yet (scale-factor tensor view `(rm, rk, 32, 4, 4)` of the blocked bytes, and the run, are unverified).
The GEMM + quantize epilogue on sm_100 is quack's `BlockScaleFactorStore` on the same GEMM
(`build_sm100_mxfp8(mx_out="row" | "col")`, 256x128 tiles): Y as E4M3 payload with blocked E8M0 scales along N or
along M, what the next GEMM (or a backward GEMM contracting over M) reads directly; compiled and its PTX checked
(the block-scaled MMA, the E8M0 and E4M3 conversions of the epilogue), never run.
"""
from .launch import GemmLaunch, mx_gemm_sm90

__all__ = ["GemmLaunch", "mx_gemm_sm90"]
