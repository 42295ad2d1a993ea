"""The tuning spaces of the jagged MX cast kernel (`gem_lp.jagged.kernels.triton_quantize`) and of the sm_90 MX GEMM
(`gem_lp.linear.kernels.cute_gemm`): the launches `bench_jagged` and `bench_mx_gemm` time beside the product's
defaults (every one writes the same bytes; the GPU tests run them)."""
from gem_lp.linear.kernels.cute_gemm import GemmLaunch

# The tuning space (D = 128): launch options `benchmarks/bench_jagged.py` times and the GPU tests run, as
# `LaunchOptions` tuples (rows, thread_rows, row_blocks_in_thread, num_warps, max_registers). A launch keeps
# its strips in registers when 4 * (32 / thread_rows) * (chunk_d / 32) * (rows / 32) >= 32 * num_warps
# (row_blocks_in_thread: without the factor 4). All are spill-free on sm_90
# (`python benchmarks/bench_jagged.py --compile-only` prints each build's registers, spills and programs per SM).
# Register limits: 128, 96 and 80 are the occupancy steps of 64-thread programs on sm_90 (8, 10 and 12
# programs per SM), 72 and 64 those of 128-thread programs (7 and 8). Only limits that spill nothing are
# listed: the hdim+seq default (32, 8; 128 registers unlimited) spills 56 bytes at 96 registers and 124 at
# 80; the hdim default (64, 2, row blocks; 145 registers) spills 80 bytes at 128 and 288 at 96 (the plain
# hdim strips need 64-80 registers unlimited).
CANDIDATE_LAUNCHES = {
    # hdim+seq: also 4-token strips (thread_rows 4), of 32 elements per thread with 4 or 8 warps; then the
    # default and the 64-thread strips with the byte-neutral options of `LaunchOptions` (fields 7-11:
    # direct_inverse, tile_table, unmasked_full, const_strides, shift_offsets). sm_90 SASS instructions of
    # the default (H4 D128, 64 registers, 8 programs per SM): 637; + direct_inverse 625, + tile_table 629,
    # both 617, + const_strides 610, + shift_offsets 570 (17.8 per element, the same 64 registers);
    # shift_offsets alone 611. unmasked_full holds two copies of the chunk code (1048-1146 in all), its
    # mask-free copy about 24 instructions shorter than the masked one. The 8-token strips with
    # direct_inverse, tile_table, const_strides and shift_offsets: 906 at 128 registers (14.2 per element).
    # float_max (FP32 block maxima, fields 12) takes the four-option build to 558 at 63 registers, and fits it
    # in 56 (566, 9 programs per SM: 36 warps instead of 32); the default with float_max alone: 618 at 56.
    # Left out for spilling: unmasked_full + direct_inverse at 64 registers without const_strides (4 bytes),
    # the 8-token strips with float_max at 128 registers (4 bytes), the four-option build at 48 (4 bytes).
    "hdim+seq": ((64, 16, False, 2, 0), (128, 16, False, 4, 0), (32, 8, False, 2, 0), (64, 8, False, 4, 0),
                 (128, 8, False, 8, 0), (32, 4, False, 2, 128), (32, 4, False, 4, 0), (32, 4, False, 4, 64),
                 (64, 4, False, 8, 0), (32, 2, False, 4, 0), (64, 4, False, 4, 0), (32, 4, False, 4, 72),
                 (32, 4, False, 4, 64, 0, False, True), (32, 4, False, 4, 64, 0, True, False),
                 (32, 4, False, 4, 64, 0, True, True), (32, 4, False, 2, 128, 0, True, True),
                 (32, 8, False, 2, 0, 0, True, True), (32, 4, False, 4, 64, 0, False, False, True),
                 (32, 4, False, 4, 64, 0, False, True, True), (32, 4, False, 4, 72, 0, True, True, True),
                 (32, 8, False, 2, 0, 0, True, True, True), (32, 4, False, 4, 64, 0, True, True, False, True),
                 (32, 4, False, 4, 64, 0, True, True, True, True), (32, 8, False, 2, 0, 0, True, True, False, True),
                 (32, 4, False, 4, 64, 0, False, False, False, False, True),
                 (32, 4, False, 4, 64, 0, True, True, False, True, True),
                 (32, 4, False, 4, 64, 0, True, True, True, True, True),
                 (32, 8, False, 2, 128, 0, True, True, False, True, True),
                 (32, 4, False, 4, 64, 0, True, True, False, True, True, True),
                 (32, 4, False, 4, 56, 0, True, True, False, True, True, True),
                 (32, 4, False, 4, 56, 0, False, False, False, False, False, True),
                 (32, 4, False, 4, 56, 0, True, True, True, True, True, True)),
    # hdim: whole 32-feature blocks per thread (row_blocks_in_thread), and the plain strips, whose warp-wide
    # 16-byte loads read 4 (thread_rows 4: 8) runs of 128 (64) contiguous bytes rather than 32 separate
    # 16-byte pieces
    "hdim": ((64, 1, True, 4, 0), (32, 1, True, 2, 0), (128, 1, True, 8, 0), (64, 2, True, 2, 0),
             (32, 8, False, 2, 0), (32, 4, False, 2, 0), (64, 8, False, 4, 0), (64, 4, False, 4, 0),
             # the default with the one-lookup prologue (638 SASS instructions against 642, 72 registers), with
             # the direct inverse too (80 registers: 12 programs per SM instead of 14; at 72: 624, no spills)
             (32, 8, False, 2, 0, 0, False, True), (32, 8, False, 2, 0, 0, True, True),
             (32, 8, False, 2, 72, 0, True, True), (32, 8, False, 2, 72, 0, True, True, False, True),  # 618
             (32, 8, False, 2, 0, 0, False, True, False, True, True),  # 596, 80 registers
             # with float_max: 540 at 92 registers (10 programs per SM), 531 at 88 with direct_inverse (11);
             # limits of 72 or 80 registers spill (H16: 4 bytes at 80)
             (32, 8, False, 2, 0, 0, False, True, False, True, True, True),
             (32, 8, False, 2, 0, 0, True, True, False, True, True, True)),
    "square": ((64, 2, True, 2, 0), (64, 1, True, 4, 0), (64, 16, False, 2, 0), (32, 8, False, 2, 0),
               (32, 4, False, 4, 0), (64, 8, False, 4, 0),
               # the default with the one-lookup prologue (609 against 619), with the direct inverse (610)
               (32, 8, False, 2, 0, 0, False, True), (32, 8, False, 2, 0, 0, True, True),
               (32, 8, False, 2, 96, 0, True, True, False, True),  # 610 (113 registers without the limit)
               (32, 8, False, 2, 96, 0, True, True, False, True, True),  # 586
               (32, 8, False, 2, 96, 0, True, True, False, True, True, True)),  # 545 with float_max
}
# The persistent walk (programs_per_sm > 0; the same tuples with a 6th field), timed beside CANDIDATE_LAUNCHES:
# the loads of a program's next chunk go out before it quantizes and stores the current one, instead of
# waiting for a program slot to free. It costs registers: the double buffer (bf16: rows * chunk_d /
# (64 * num_warps) per thread, 16 for (32, 4, w4), 32 for (32, 8, w2)) and the strip offsets, which the
# compiler keeps live across the walk. sm_90 builds (H4/H16 D128; `--compile-only`), registers and the
# programs an SM holds, none spills. Left out for spilling: (32, 4, w4) at 64 registers (hdim+seq 152 bytes,
# hdim 32), hdim+seq at 72-96 (128-52 bytes) and (32, 8, w2) at 128 or 168 (288 / 168 bytes).
PERSISTENT_LAUNCHES = {
    "hdim+seq": ((32, 8, False, 2, 0, 8), (32, 8, False, 2, 0, 16),  # 206, 4/SM: more programs than fit
                 (32, 8, False, 2, 0, 4),  # 206, 4/SM
                 (32, 4, False, 4, 0, 4),  # 119, 4/SM
                 (32, 8, False, 4, 0, 4)),  # 128, 4/SM
    "hdim": ((32, 8, False, 2, 0, 8), (32, 8, False, 2, 0, 16),  # 190, 5/SM: more programs than fit
             (32, 8, False, 2, 0, 5),  # 190, 5/SM
             (32, 8, False, 2, 168, 6),  # 159, 6/SM
             (32, 4, False, 4, 72, 7),  # 72, 7/SM
             (32, 4, False, 4, 80, 6)),  # 80, 6/SM
}

# The sm_90 MX GEMM's launches `bench_mx_gemm` times per shape (the launch table keeps each shape's fastest).
GEMM_LAUNCH_CANDIDATES = (GemmLaunch(128, 128, 1), GemmLaunch(128, 256, 1), GemmLaunch(128, 192, 1),
                          GemmLaunch(128, 128, 2))
