"""The A-operand transform of the sm_90 MX GEMM: E4M3 payload + E8M0 scales (128x4 blocked layout) to the exact BF16
WGMMA fragment, in registers, on the way to quack's register-sourced (RS) WGMMA mainloop.

quack's `GemmSm90` takes a `TransformA` (quack/operand_transform/transform.py): the kernel owns the pipeline, the
WGMMA issue and the epilogue; the transform owns A's storage (smem layout, TMA box, gmem tiling) and the per-k16
produce `copy_block(stage, b, k_tile)` that writes the A fragment. This one declares:

* A storage: the payload `[M, K]` (row stride K bytes) crosses as the view `(16, M, K/16)` with strides
  `(1, K, 16)`: a TMA box `(16, tile_M, tile_K/16)` lands in smem as `[k // 16][m][k % 16]` (16-byte runs, one
  per row and 16-wide k group). A thread's fragment bytes of a k16 block are two byte pairs per row (k = 2q, 2q+1
  and 2q+8, 2q+9 of lane quad q); with 16-byte row runs the eight rows of a warp's load sit in 16 distinct banks,
  so the 16-bit loads are bank-conflict free without a swizzle. Rows past M and k past K arrive as zeros (TMA
  out-of-bounds fill).
* Scales: one 512-byte tile of the blocked layout (128 rows x 4 k-blocks = 128 rows x 128 k) per 128 rows of the
  CTA tile and k-tile, TMA'd with A and B under the same mbarrier (a `quack.operand_transform.AuxOperandA`). Row
  r's four scale bytes of the tile are the 32-bit word `(r % 32) * 4 + (r % 128) // 32`: one LDS.32 per row per
  k-tile. tile_K is therefore 128 (the blocked tile's k extent).
* Decode of a k16 block, per m64 atom (two rows r, r + 8 per thread, eight bytes): quack's
  `decode_e4m3x4_to_bf16x4` (hardware `cvt` E4M3x2 -> F16x2 -> F32 -> BF16x2: exact, NaN payloads stay NaN),
  then one `mul.rn.bf16x2` by the pair (2^(s_r - 127), 2^(s_r8 - 127)) in BF16. E8M0 -> BF16 bits: `s << 7`, with
  byte 0 -> 0x0040 (2^-127, a BF16 subnormal) and byte 255 -> 0x7FC0 (NaN) as docs/numerics.md specifies.
  The product is rounded once to BF16: exact except values below BF16's subnormal step 2^-133 (scale bytes 0-2
  with small payloads), rounded to nearest even there -- the same BF16 as the dequantize pass
  (`triton_gemm.mx_dequantize_operand`), and an E4M3 payload times 2^(s-127) that overflows FP32 is inf in both.

quack's own MXFP8 decode format (`quack.operand_transform.formats.Mxfp8`, via `nvfp4_utils.sf_e8m0_pair_to_bf16x2`)
maps scale byte 0 to +0.0 and 255 to +inf and needs an offline repack of A; neither fits an activation operand made
every step, hence this transform.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from quack.blockscaled.nvfp4_utils import decode_e4m3x4_to_bf16x4, mul_bf16x2_bcast
from quack.operand_transform import AuxOperandA, TransformA

# Rows and k of one 512-byte tile of the blocked scale layout (docs/numerics.md, "Blocked scale layout").
SCALE_TILE_ROWS = 128
SCALE_TILE_K = 128  # 4 scale columns of 32 k
SCALE_TILE_WORDS = 128  # 512 bytes as Int32
# k run of one A smem row segment (bytes): the TMA box's inner extent.
A_RUN = 16


class MXScaleTiles(AuxOperandA):
    """The blocked scales as an aux A-side operand: per k-tile, the `tile_M / 128` blocked tiles of the CTA's rows.

    gmem: the flat blocked bytes viewed as Int32 `(128 words, row tiles, column tiles)`, strides `(1, 128 * column
    tiles, 128)`; smem per stage `(128, tile_M / 128)` words."""

    dtype = Int32
    multicast = False  # 512-byte boxes: each CTA loads its own copy

    def __init__(self, gemm):
        self.gemm = gemm

    def _row_tiles(self) -> int:
        return self.gemm.cta_tile_shape_mnk[0] // SCALE_TILE_ROWS

    def bytes_per_stage(self) -> int:
        return 4 * SCALE_TILE_WORDS * self._row_tiles()

    def make_smem_layout_staged(self, ab_stage):
        return cute.make_ordered_layout((SCALE_TILE_WORDS, self._row_tiles(), ab_stage), order=(0, 1, 2))

    def make_tma(self, mAux):
        box = (SCALE_TILE_WORDS, self._row_tiles())
        return self.gemm._make_tma_atoms_and_tensors(
            mAux, cute.make_ordered_layout(box, order=(0, 1)), box, self.gemm.cluster_shape_mnk[1])

    def gmem_slice(self, mAux, tile_coord_mnkl, batch_idx):
        # (128, row tiles, column tiles) -> (128, tile_M / 128, k-tiles)
        return cute.local_tile(mAux, (SCALE_TILE_WORDS, self._row_tiles()), (0, tile_coord_mnkl[0], None))


@cute.jit
def e8m0_to_bf16_bits(s: Int32) -> Int32:
    """E8M0 byte (0..255 in an Int32) -> BF16 bits of 2^(s - 127): `s << 7`, OR 0x40 for bytes 0 (2^-127, the BF16
    subnormal 0x0040) and 255 (0x7FC0, NaN). `((s + 1) & 0xFF) - 2` is negative exactly for those two bytes."""
    special = ((((s + 1) & 0xFF) - 2) >> 31) & 0x40
    return (s << 7) | special


class MXTransformA(TransformA):
    """E4M3 A payload + blocked E8M0 scales -> exact BF16 RS-WGMMA fragment (module docstring)."""

    owns_a_layout = True
    a_major_mode = cute.nvgpu.OperandMajorMode.K
    tile_k = SCALE_TILE_K

    def __init__(self, gemm):
        self.gemm = gemm
        if gemm.mma_a_dtype != cutlass.BFloat16:
            raise TypeError(f"the MX transform produces BF16 fragments; the GEMM was built for {gemm.mma_a_dtype}")
        tile_m = gemm.cta_tile_shape_mnk[0]
        if tile_m % SCALE_TILE_ROWS:
            raise ValueError(f"tile_M must be a multiple of {SCALE_TILE_ROWS} (blocked scale tiles), got {tile_m}")
        if gemm.pingpong or gemm.gather_A:
            raise ValueError("the MX transform supports the cooperative, non-gather mainloop only")
        if gemm.atom_layout_mnk[1] != 1:
            raise ValueError("the MX transform needs the MMA warp groups stacked along M (atom_layout_n == 1)")
        if gemm.cluster_shape_mnk[0] != 1 or gemm.cluster_shape_mnk[2] != 1:
            raise ValueError("the MX transform supports (1, cluster_n, 1) clusters")
        self.aux = MXScaleTiles(gemm)

    # ---- A layout ownership ---------------------------------------------------------------------------------------

    def _box(self):
        tile_m, _, tile_k = self.gemm.cta_tile_shape_mnk
        return (A_RUN, tile_m, tile_k // A_RUN)

    def a_bytes_per_stage(self) -> int:
        tile_m, _, tile_k = self.gemm.cta_tile_shape_mnk
        return tile_m * tile_k

    def make_a_smem_layout_staged(self, ab_stage):
        return cute.make_ordered_layout((*self._box(), ab_stage), order=(0, 1, 2, 3))

    def make_a_tma(self, mA):
        """mA: the payload view `(16, M, K/16)`, strides `(1, K, 16)`; one `(16, tile_M, tile_K/16)` box per k-tile."""
        gemm = self.gemm
        smem = cute.slice_(gemm.a_smem_layout_staged, (None, None, None, 0))
        return gemm._make_tma_atoms_and_tensors(mA, smem, self._box(), gemm.cluster_shape_mnk[1])

    def a_gmem_slice(self, mA, tile_coord_mnkl, batch_idx):
        # (16, M, K/16) -> (16, tile_M, tile_K/16, k-tiles)
        return cute.local_tile(mA, self._box(), (0, tile_coord_mnkl[0], None))

    # ---- the per-block produce ------------------------------------------------------------------------------------

    @cute.jit
    def make_copy_block(self, tiled_mma, sA, tCrA, tidx, warp_group_idx, sAux=None, mAux=None):
        gemm = self.gemm
        tile_m, _, tile_k = gemm.cta_tile_shape_mnk
        stages = gemm.ab_stage
        # logical (m, k, stage) view of the staged [k // 16][m][k % 16] bytes
        sA_mk = cute.make_tensor(
            sA.iterator,
            cute.make_layout((tile_m, (A_RUN, tile_k // A_RUN), stages),
                             stride=(A_RUN, (1, A_RUN * tile_m), tile_m * tile_k)))
        # 16-bit loads: the two adjacent k of a fragment slot pair
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sA.element_type, num_bits_per_copy=16)
        smem_copy = cute.make_tiled_copy_A(atom, tiled_mma)
        thr_copy = smem_copy.get_slice(tidx)
        tCsA = thr_copy.partition_S(sA_mk)  # (CPY, CPY_M, CPY_K, STAGE)
        frag8 = cute.make_rmem_tensor_like(tCrA, sA.element_type)  # the payload bytes in fragment order
        tCr8 = thr_copy.retile(frag8)
        frag8_i32 = cute.recast_tensor(frag8, Int32)
        frag_i32 = cute.recast_tensor(tCrA, Int32)
        mma_m = const_expr(cute.size(tCrA.shape[1]))
        # tile-relative row of each m atom's first fragment row (the second is 8 below)
        tCcA = tiled_mma.get_slice(tidx).partition_A(cute.make_identity_tensor((tile_m, tile_k)))
        rows = [tCcA[(0, 0, 0), m, 0][0] for m in range(mma_m)]
        # per m atom and 32-k block of the tile: the bf16x2 pair (scale of row r, scale of row r + 8)
        kblocks = const_expr(tile_k // 32)
        pairs = cute.make_rmem_tensor((kblocks, mma_m), Int32)

        def copy_block(stage_idx, b, k_tile=None):
            if const_expr(b == 0):
                for m in cutlass.range_constexpr(mma_m):
                    words = []
                    for v1 in cutlass.range_constexpr(2):
                        r = rows[m] + 8 * v1
                        rr = r % SCALE_TILE_ROWS
                        words.append(sAux[(rr % 32) * 4 + rr // 32, r // SCALE_TILE_ROWS, stage_idx])
                    for j in cutlass.range_constexpr(kblocks):
                        lo = e8m0_to_bf16_bits((words[0] >> (8 * j)) & 0xFF)
                        hi = e8m0_to_bf16_bits((words[1] >> (8 * j)) & 0xFF)
                        pairs[j, m] = lo | (hi << 16)
            cute.copy(smem_copy, tCsA[None, None, b, stage_idx], tCr8[None, None, b])
            for m in cutlass.range_constexpr(mma_m):
                w = frag8_i32[None, m, b]
                r0, r1 = decode_e4m3x4_to_bf16x4(w[0])  # (row r, k 2q..2q+1), (row r+8, same k)
                r2, r3 = decode_e4m3x4_to_bf16x4(w[1])  # the same at k + 8
                pair = pairs[(16 * b) // 32, m]
                frag_i32[(0, 0, 0), m, b] = mul_bf16x2_bcast(r0, pair, False)
                frag_i32[(0, 1, 0), m, b] = mul_bf16x2_bcast(r1, pair, True)
                frag_i32[(0, 0, 1), m, b] = mul_bf16x2_bcast(r2, pair, False)
                frag_i32[(0, 1, 1), m, b] = mul_bf16x2_bcast(r3, pair, True)

        return copy_block
