"""The tuning spaces of the Triton MX cast kernels: the launches of `gem_lp.mx.kernels.triton_cast` that
`benchmarks/tune_casts.py` times beside the product's default (`strip_config`), and those of
`gem_lp.mx.kernels.triton_quantize` that `benchmarks/bench_quantize.py` times, each checked against the reference."""
from gem_lp.mx.kernels.triton_cast import MEASURED_CONFIG, NormConfig
from gem_lp.mx.kernels.triton_quantize import CastConfig

# The tuning space `benchmarks/tune_casts.py` times (each checked against the reference) and the GPU tests
# run, for the K of the benchmark shapes: thread strips (programs_per_sm > 0: a persistent walk that bounds the
# re-read bytes in flight; max_registers: a register cap for more programs per SM).
# The strips keep every thread busy when
# 4 * (32 / thread_rows) * (block_k / 32) * (block_m / 32) >= 32 * num_warps.
# Comments: sm_90 registers per thread (ptxas, M = 32768, bf16 x, RMSNorm + both casts, blocked scales), the
# programs an SM holds and the warps that makes; none spills. Left out for spilling (bytes): 32x256 w4 r8, 64x128
# w4 r8, 32x128 w2 r8 capped at 128 (24-40), 32x128 w4 r4 at 80 (32-36), prefetch under caps below its ~125
# registers (76-96), one pass in 32 warps (capped at 64), 32x1024 w16 r8 at K = 4096 (16).
# At K = 4096 a row block is 256 KiB: 4 resident per SM would re-read 132 MiB, more than the L2 holds, so
# the second sweep there comes from DRAM unless few row blocks are in flight (1-2 per SM).
CANDIDATE_CONFIGS = {
    1024: (
        MEASURED_CONFIG,  # 162, 3/SM, 12 warps
        NormConfig(32, 256, 4, 8, False, 2),  # 248, 2/SM, persistent
        NormConfig(32, 1024, 8, 16),  # 183, 1/SM, one pass: x read once
        NormConfig(32, 1024, 16, 8),  # 105, 1/SM, 16 warps, one pass, 64 elements a thread
        NormConfig(32, 1024, 16, 4, False, 0, 128),  # 122, 1/SM, 16 warps, one pass, 2 strips of 4 rows
        NormConfig(32, 128, 4, 4, False, 0, 0, True),  # 127, 4/SM, 16 warps, prefetch
        NormConfig(32, 256, 8, 4, False, 0, 0, True),  # 123, 2/SM, 16 warps, prefetch
        NormConfig(32, 512, 16, 4, False, 0, 128, True),  # 124, 1/SM, 16 warps, prefetch, 8 MiB re-read in flight
        NormConfig(32, 256, 8, 4, False, 2, 128),  # 125, 2/SM, 16 warps, persistent, 16.5 MiB in flight
        NormConfig(64, 128, 4, 8),  # 166, 3/SM
        NormConfig(32, 128, 4, 4),  # 96, 5/SM, 20 warps: 32 elements a thread
        NormConfig(32, 128, 2, 8),  # 165, 6/SM
        NormConfig(32, 64, 1, 8, False, 0, 168),  # 164, 12/SM
    ),
    4096: (
        MEASURED_CONFIG,  # 162, 3/SM, 12 warps, 99 MiB re-read in flight
        NormConfig(32, 256, 4, 8, False, 2),  # 242, 2/SM, persistent
        NormConfig(64, 128, 4, 8),  # 166, 3/SM
        NormConfig(32, 512, 8, 8, False, 1),  # 240, 1/SM, persistent
        NormConfig(32, 256, 8, 4, False, 1),  # 155, 1/SM, persistent, 33 MiB in flight
        NormConfig(32, 256, 8, 4, False, 1, 0, True),  # 185, 1/SM, persistent, prefetch
        NormConfig(32, 256, 8, 4, False, 2, 128),  # 124, 2/SM, 16 warps, persistent, 66 MiB in flight
        NormConfig(32, 256, 8, 4, False, 0, 0, True),  # 123, 2/SM, 16 warps, prefetch
        NormConfig(32, 128, 4, 4, False, 0, 0, True),  # 127, 4/SM, 16 warps, prefetch, 132 MiB in flight
        NormConfig(32, 128, 4, 4),  # 95, 5/SM, 20 warps
        NormConfig(32, 128, 2, 8),  # 165, 6/SM
    ),
}
# The dual cast without the norm into both dequantized operands (weight None, row_operand + col_operand, no
# payloads: MXLinear's dY, 32768 x 3072 in the benchmark), per K: the launches the benchmark times beside the
# default (`strip_config(K, operands=True)`: 32x64 w1 r8, 128 registers, 16 warps per SM; 226 before the float
# block maxima). Tile programs drop the loop over K and its live addresses. Comments as above (sm_90, M = 32768,
# bf16); with `column_sums` the same launches take 56-105 registers and 1.5-3 more instructions per element.
OPERAND_CAST_CANDIDATE_CONFIGS = {
    3072: (
        NormConfig(32, 64, 1, 8, tile_programs=True),  # 104, 19/SM, 19 warps, 64 elements a thread
        NormConfig(32, 64, 2, 4, tile_programs=True),  # 62, 16/SM, 32 warps, 32 elements a thread
        NormConfig(32, 128, 4, 4, tile_programs=True),  # 62, 8/SM, 32 warps
        NormConfig(64, 128, 8, 4, tile_programs=True),  # 62, 4/SM, 32 warps
        NormConfig(64, 64, 2, 8, tile_programs=True),  # 104, 9/SM, 18 warps
        NormConfig(32, 64, 2, 2, tile_programs=True),  # 48, 21/SM, 42 warps, 16 elements a thread
        NormConfig(32, 64, 1, 4),  # 104, 19/SM, 19 warps, the loop over K
    ),
}


# `mx_cast_2d`'s tuning space: configurations `benchmarks/bench_quantize.py` times (each checked byte for byte) and
# the GPU tests run. All are spill-free on sm_90; a config keeps its strips in registers when
# 4 * (32 / thread_rows) * (block_k / 32) * (block_m / 32) >= 32 * num_warps (with row_blocks_in_thread:
# (32 / thread_rows) * (block_k / 32) * (block_m / 32) >= 32 * num_warps).
QUANTIZE_CANDIDATE_CONFIGS = {
    "rowwise": (CastConfig(64, 128, 4, 1, True), CastConfig(32, 256, 4, 1, True), CastConfig(32, 128, 2, 1, True),
                CastConfig(128, 128, 4, 2, True), CastConfig(64, 128, 4, 8)),
    "colwise": (CastConfig(128, 64, 2, 16), CastConfig(128, 128, 4, 16), CastConfig(256, 64, 4, 16),
                CastConfig(64, 64, 2, 8), CastConfig(128, 64, 4, 8)),
    "dual": (CastConfig(128, 64, 2, 16), CastConfig(128, 128, 4, 16), CastConfig(64, 64, 1, 16),
             CastConfig(128, 64, 4, 8), CastConfig(64, 128, 4, 8), CastConfig(128, 128, 8, 8)),
    "square": (CastConfig(64, 128, 4, 2, True), CastConfig(32, 256, 4, 1, True), CastConfig(128, 128, 4, 4, True),
               CastConfig(64, 128, 4, 8)),
}
