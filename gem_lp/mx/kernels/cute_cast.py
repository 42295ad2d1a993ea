"""RMSNorm + both MX casts (or the dual MX cast alone) of `x [M, K]` in one CuTe DSL kernel, x read once.

One CTA owns a 32-row block (one colwise MX block) and `tile_k` columns; a cluster of `cluster_n` CTAs along K covers
rows wider than one CTA holds, and shares the rows' partial sums of squares through distributed shared memory.

1. The CTA copies its x tile into shared memory with 16-byte `cp.async` (quack's `copy_utils`); rows past M and
   columns past K are zero-filled instead, so they add nothing to the sums of squares.
2. Each thread owns one strip of 8 rows x 8 columns; in a warp, lanes `kq + 4 kh + 8 mq` cover 32 rows (mq: 8-row
   strips) x 64 columns (kh: 32-column MX blocks, kq: 8 columns of a block), and a quarter warp reads 128 contiguous
   bytes of one row (no bank conflicts). Warps follow each other along K.
3. RMSNorm: per-row sums of squares over the strip, summed over the 8 lanes of a row (quack's `warp_reduce`), over the
   warps (shared memory) and over the cluster (`st.async` into every peer, quack's `store_shared_remote`), each step
   in a fixed order, so every CTA of a cluster holds the same sum; then `rstd = 1 / sqrt(sum / K + eps)` correctly
   rounded, and `y = (fp32(x) * rstd) * fp32(w)` in the reference's operation order.
4. Both casts from the strip in registers: rowwise block maxima over 8 columns then over the 4 lanes of a block
   (shuffles), colwise maxima over 8 rows then over the 4 strips of the 32 rows (shuffles). Maxima keep NaN
   (`max.NaN.xorsign.abs`). Rowwise payload: 8 bytes per row of the strip; colwise payload (`y^T [K, M]`, rows
   `col_stride` bytes apart, a multiple of 16): 8 bytes per column (the strip's 8 rows are consecutive in `y^T`).
   The dequantized casts, the operands a BF16 GEMM multiplies exactly on Hopper (which has no block-scaled MMA),
   come from the same payload words: E4M3 -> FP16 by the hardware conversion, times the block's scale in FP32,
   rounded to BF16; both laid out as y, 16 bytes per row of the strip (the colwise one's 8x8 strip turned by
   `prmt`). Each output is compiled in or out (`rowwise`, `colwise`, `row_operand`, `col_operand`; without the
   norm also x's column sums, atomically per 32-row block, and y = SiLU(x) computed on the fly).
5. Scales: the row scales through shared memory, so that they leave as 4-byte words (single-byte stores from the
   lanes were a third of the kernel's L2 requests): in the 128x4 blocked layout a row's 4 scales of a 128-column
   group (zero padding included: the grid rounds the row blocks up to 128 rows, CTAs past M cast zero rows), in the
   plain `[M, K/32]` matrix the CTA's run of each row. Column scales are one byte per column of the CTA's row block:
   blocked, through shared memory; plain, the `[K, ceil(M/32)]` matrix stored row block by row block (`[ceil(M/32),
   K]` in memory, its transpose the matrix), so that a row block's bytes are contiguous and leave the lanes as
   8-byte words (column-major, each byte would be a 32-byte sector of its own). No output needs a fill launch.

The bytes equal `gem_lp.mx.reference`'s for the same FP32 y; rstd equals the reference's whenever the FP32 sum of
squares is exact (the summation order differs from torch's otherwise).
"""
from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, Int64, const_expr

import quack.copy_utils as copy_utils
import quack.utils as quack_utils
from quack.reduce import warp_reduce
from quack.reduction_base import ReductionBase

from gem_lp.mx.kernels.cute_numerics import (abs_max_nan, byte_perm, dequantized_bf16x2, div_rn, inv_scale, payload_word,
                               red_add_f32x2, rstd_of, scale_byte, store_u8, store_u32, store_v2_u32, store_v4_u32)

BLOCK = 32
STRIP_ROWS = 8
STRIP_COLS = 8


class NormMXCast(ReductionBase):
    """The kernel for one configuration (all compile-time): x dtype, K, the CTA's `tile_k` columns, `cluster_n`
    CTAs along K, and what it computes (`normalize`: RMSNorm, else y = x; `rceil` or floor scales; `blocked` or
    plain scale layouts) and writes: the `rowwise` and `colwise` MX casts, and their dequantized BF16 values, the
    operands a BF16 GEMM takes (`row_operand`: `deq(rowwise) [M, K]`; `col_operand`: `deq(colwise)` laid out as
    y, `[M, K]`, which a GEMM contracting over M reads transposed); `column_sums` (without the norm): x's FP32
    column sums added into `mSums [K]` (a linear layer's bias gradient from the pass that casts its dY). `silu`
    (without the norm): y = SiLU(x) as torch's CUDA kernel computes it (`x / (1 + expf(-x))` in FP32, libdevice's
    expf, IEEE division, rounded to x's dtype), an MLP's hidden activation cast without being stored. `tile_k` is a
    multiple of 128 with `tile_k / 64` warps; `cluster_n * tile_k >= K`."""

    def __init__(self, dtype, K: int, tile_k: int, cluster_n: int, normalize: bool, rceil: bool, blocked: bool,
                 rowwise: bool = True, colwise: bool = True, row_operand: bool = False, col_operand: bool = False,
                 column_sums: bool = False, silu: bool = False):
        super().__init__(dtype, K, stage=1)
        assert K % BLOCK == 0 and tile_k % 128 == 0 and cluster_n * tile_k >= K > (cluster_n - 1) * tile_k
        assert rowwise or colwise or row_operand or col_operand
        assert not ((column_sums or silu) and normalize) and not (column_sums and silu)
        self.K, self.tile_k, self.cluster_n_cfg = K, tile_k, cluster_n
        self.normalize, self.rceil, self.blocked = normalize, rceil, blocked
        self.rowwise, self.colwise, self.row_operand, self.col_operand = rowwise, colwise, row_operand, col_operand
        self.column_sums, self.silu = column_sums, silu
        self.num_warps = tile_k // 64
        self.num_threads = 32 * self.num_warps
        self.scale_cols = tile_k // BLOCK  # row-scale columns of one CTA
        self.vec = 128 // dtype.width  # elements of one 16-byte copy
        self.k_blocks = K // BLOCK
        # the blocked row-scale matrix [M, K/32] has ceil(K/128) tiles of 4 columns
        self.row_scale_tiles = (self.k_blocks + 3) // 4
        self.k_pad128 = (K + 127) // 128 * 128
        self.even_k = cluster_n * tile_k == K

    def _threads_per_row(self):
        return self.tile_k // self.vec

    def _num_threads(self):
        return self.num_threads

    def _set_cluster_n(self):
        self.cluster_n = self.cluster_n_cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor | None, mRowQ: cute.Tensor | None, mRowS: cute.Tensor | None,
                 mColQ: cute.Tensor | None, mColS: cute.Tensor | None, mRstd: cute.Tensor | None,
                 mRowOp: cute.Tensor | None, mColOp: cute.Tensor | None, mSums: cute.Tensor | None,
                 col_stride: Int32, eps: Float32, stream: cuda.CUstream):
        self._set_cluster_n()
        M = mX.shape[0]
        row_blocks = cute.ceil_div(M, BLOCK)
        if const_expr(self.blocked):  # padding rows of the blocked layouts up to a multiple of 128
            row_blocks = cute.ceil_div(M, 128) * 4
        tiled_copy = copy_utils.tiled_copy_2d(self.dtype, self._threads_per_row(), self.num_threads, self.vec,
                                              is_async=True)
        self.kernel(mX, mW, mRowQ, mRowS, mColQ, mColS, mRstd, mRowOp, mColOp, mSums, col_stride, eps,
                    tiled_copy).launch(
            grid=[row_blocks, self.cluster_n, 1], block=[self.num_threads, 1, 1],
            cluster=[1, self.cluster_n, 1] if const_expr(self.cluster_n > 1 and self.normalize) else None,
            stream=stream)

    # ------------------------------------------------------------------ kernel

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor | None, mRowQ: cute.Tensor | None, mRowS: cute.Tensor | None,
               mColQ: cute.Tensor | None, mColS: cute.Tensor | None, mRstd: cute.Tensor | None,
               mRowOp: cute.Tensor | None, mColOp: cute.Tensor | None, mSums: cute.Tensor | None,
               col_stride: Int32, eps: Float32, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cta_k, _ = cute.arch.block_idx()
        M = mX.shape[0]
        col_blocks = cute.ceil_div(M, BLOCK)
        m0 = bidx * BLOCK
        k0 = cta_k * self.tile_k
        self._tile(mX, mW, mRowQ, mRowS, mColQ, mColS, mRstd, mRowOp, mColOp, mSums, col_stride, eps, tiled_copy, M,
                   m0, k0, bidx, cta_k, col_blocks, tidx)

    @cute.jit
    def _tile(self, mX, mW, mRowQ, mRowS, mColQ, mColS, mRstd, mRowOp, mColOp, mSums, col_stride, eps, tiled_copy,
              M, m0, k0, bidx, cta_k, col_blocks, tidx):
        K, tile_k = self.K, self.tile_k
        smem = cutlass.utils.SmemAllocator()
        sX = smem.allocate_tensor(self.dtype, cute.make_ordered_layout((BLOCK, tile_k), order=(1, 0)),
                                  byte_alignment=128)
        if const_expr(self.normalize):
            sSums = smem.allocate_tensor(Float32, cute.make_ordered_layout((self.num_warps, BLOCK), order=(1, 0)),
                                         byte_alignment=16)
            sRstd = smem.allocate_tensor(Float32, cute.make_layout(BLOCK), byte_alignment=16)
            mbar = None
            if const_expr(self.cluster_n > 1):
                sPeer = smem.allocate_tensor(Float32, cute.make_ordered_layout((self.cluster_n, BLOCK), order=(1, 0)),
                                             byte_alignment=16)
                mbar = smem.allocate_array(Int64, num_elems=1)
                self._initialize_cluster(tidx, mbar, self.num_warps)
        sRowS = sColS = None
        if const_expr(self.rowwise):  # the CTA's row-scale bytes, gathered before they are stored
            sRowS = smem.allocate_tensor(cutlass.Uint8,
                                         cute.make_ordered_layout((BLOCK, self.scale_cols), order=(1, 0)),
                                         byte_alignment=16)
        if const_expr(self.blocked and self.colwise):
            sColS = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(tile_k), byte_alignment=16)

        # 1. x tile -> shared memory (zeros past M and past K)
        gX = cute.local_tile(mX, (BLOCK, tile_k), (bidx, cta_k))
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (BLOCK, tile_k), (bidx, cta_k))
        thr_copy = tiled_copy.get_slice(tidx)
        tXgX = thr_copy.partition_S(gX)
        tXsX = thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cX)
        zeros = cute.make_rmem_tensor_like(tXsX[None, 0, 0])
        zeros.fill(0.0)
        copy_atom = copy_utils.get_copy_atom(self.dtype, self.vec, is_async=True)
        for i in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tXgX, mode=[2])):
                coord = tXcX[(0, 0), i, j]
                inside = coord[0] < M
                if const_expr(not self.even_k):
                    inside = inside and coord[1] < K
                if inside:
                    cute.copy(copy_atom, tXgX[None, i, j], tXsX[None, i, j])
                else:
                    cute.autovec_copy(zeros, tXsX[None, i, j])
        cute.arch.cp_async_commit_group()

        # the thread's strip: rows m0 + 8 mq + r, columns k0 + c0 + v
        lane = tidx % 32
        warp = tidx // 32
        kq = lane % 4
        kh = (lane // 4) % 2
        mq = lane // 8
        c0 = warp * 64 + kh * BLOCK + kq * STRIP_COLS
        row0 = mq * STRIP_ROWS  # the strip's first row in the tile
        k = k0 + c0
        k_ok = True
        if const_expr(not self.even_k):
            k_ok = k < K
        w = cute.make_rmem_tensor(cute.make_layout(STRIP_COLS), Float32)
        if const_expr(self.normalize):
            if k_ok:
                for v in cutlass.range_constexpr(STRIP_COLS):
                    w[v] = mW[k + v].to(Float32)
            else:
                w.fill(0.0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        xs = cute.make_rmem_tensor(cute.make_layout((STRIP_COLS, STRIP_ROWS)), self.dtype)
        sXv = cute.zipped_divide(sX, (1, STRIP_COLS))  # ((1, 8), (32, tile_k / 8))
        for r in cutlass.range_constexpr(STRIP_ROWS):
            cute.autovec_copy(sXv[(0, None), (row0 + r, c0 // STRIP_COLS)], xs[None, r])

        # 2. RMSNorm: rstd of the strip's rows
        rstd = cute.make_rmem_tensor(cute.make_layout(STRIP_ROWS), Float32)
        if const_expr(self.normalize):
            for r in cutlass.range_constexpr(STRIP_ROWS):
                s = Float32(0.0)
                for v in cutlass.range_constexpr(STRIP_COLS):
                    xv = xs[v, r].to(Float32)
                    s = s + xv * xv
                rstd[r] = warp_reduce(s, operator.add, threads_in_group=8)
            if lane % 8 == 0:
                for r in cutlass.range_constexpr(STRIP_ROWS):
                    sSums[warp, row0 + r] = rstd[r]
            if const_expr(self.cluster_n > 1):
                cute.arch.cluster_wait()  # every peer's barrier is initialized
            cute.arch.barrier()
            if tidx < BLOCK:
                total = Float32(0.0)
                for wi in cutlass.range_constexpr(self.num_warps):
                    total = total + sSums[wi, tidx]
                if const_expr(self.cluster_n > 1):
                    total = self._cluster_sum(total, sPeer, mbar, tidx)
                if const_expr(K & (K - 1) == 0):
                    mean = total * Float32(1.0 / K)
                else:
                    mean = div_rn(total, Float32(K))
                row_rstd = rstd_of(mean, eps)
                if m0 + tidx < M:
                    if cta_k == 0:
                        mRstd[m0 + tidx] = row_rstd
                else:
                    row_rstd = Float32(0.0)  # rows past M: y = 0 (x is 0 there; eps = 0 would give 0 * inf)
                sRstd[tidx] = row_rstd
            cute.arch.barrier()
            for r in cutlass.range_constexpr(STRIP_ROWS):
                rstd[r] = sRstd[row0 + r]

        # 3. y of the strip, FP32
        y = cute.make_rmem_tensor(cute.make_layout((STRIP_COLS, STRIP_ROWS)), Float32)
        for r in cutlass.range_constexpr(STRIP_ROWS):
            for v in cutlass.range_constexpr(STRIP_COLS):
                if const_expr(self.normalize):
                    y[v, r] = (xs[v, r].to(Float32) * rstd[r]) * w[v]
                elif const_expr(self.silu):
                    xv = xs[v, r].to(Float32)
                    y[v, r] = div_rn(xv, Float32(1.0) + cute.math.exp(-xv)).to(self.dtype).to(Float32)
                else:
                    y[v, r] = xs[v, r].to(Float32)

        if const_expr(self.column_sums):
            # over the strip's 8 rows, then the 4 strips of the block (mq; every lane ends with the sums of its
            # 8 columns); the lanes of strip mq add columns 2 mq, 2 mq + 1 with one vector reduction, so a warp's
            # single instruction adds 64 contiguous columns (one scalar reduction per column from the lanes of one
            # strip would be 8 instructions of 8 lanes each)
            sums = cute.make_rmem_tensor(cute.make_layout(STRIP_COLS), Float32)
            for v in cutlass.range_constexpr(STRIP_COLS):
                c = y[v, 0]
                for r in cutlass.range_constexpr(1, STRIP_ROWS):
                    c = c + y[v, r]
                for step in cutlass.range_constexpr(2):
                    c = c + cute.arch.shuffle_sync_bfly(c, offset=8 << step)
                sums[v] = c
            lo, hi = sums[0], sums[1]
            for j in cutlass.range_constexpr(1, STRIP_COLS // 2):
                pick = mq == j
                lo = Float32(cutlass.select_(pick, sums[2 * j], lo))
                hi = Float32(cutlass.select_(pick, sums[2 * j + 1], hi))
            ok = Int32(1)
            if const_expr(not self.even_k):
                ok = Int32(k_ok)
            red_add_f32x2(mSums.iterator.toint() + Int64(k + 2 * mq) * 4, 0, lo, hi, ok)

        # 4. block maxima: rows over the block's 4 lanes (kq), columns over the 4 strips (mq)
        row_amax = cute.make_rmem_tensor(cute.make_layout(STRIP_ROWS), Float32)
        col_amax = cute.make_rmem_tensor(cute.make_layout(STRIP_COLS), Float32)
        for r in cutlass.range_constexpr(STRIP_ROWS):
            a = abs_max_nan(y[0, r], y[1, r])
            for v in cutlass.range_constexpr(2, STRIP_COLS):
                a = abs_max_nan(a, y[v, r])
            row_amax[r] = a
        for v in cutlass.range_constexpr(STRIP_COLS):
            a = abs_max_nan(y[v, 0], y[v, 1])
            for r in cutlass.range_constexpr(2, STRIP_ROWS):
                a = abs_max_nan(a, y[v, r])
            col_amax[v] = a
        for r in cutlass.range_constexpr(STRIP_ROWS):
            for step in cutlass.range_constexpr(2):
                row_amax[r] = abs_max_nan(row_amax[r], cute.arch.shuffle_sync_bfly(row_amax[r], offset=1 << step))
        for v in cutlass.range_constexpr(STRIP_COLS):
            for step in cutlass.range_constexpr(2):
                col_amax[v] = abs_max_nan(col_amax[v], cute.arch.shuffle_sync_bfly(col_amax[v], offset=8 << step))

        # 5. rowwise cast: 8 payload bytes per row of the strip (a base per thread plus constant offsets: rows are K
        # bytes apart); the block's scale byte from its first lane (kq 0) to shared memory.
        strip_m = m0 + row0
        valid_rows = M - strip_m  # rows r < valid_rows exist
        k_ok_i = Int32(1)
        if const_expr(not self.even_k):
            k_ok_i = Int32(k_ok)
        row_q = row_op = None
        if const_expr(self.rowwise):
            row_q = mRowQ.iterator.toint() + Int64(strip_m) * K + Int64(k)
        if const_expr(self.row_operand):  # BF16 [M, K]: 16 bytes per row of the strip
            row_op = mRowOp.iterator.toint() + (Int64(strip_m) * K + Int64(k)) * 2
        for r in cutlass.range_constexpr(STRIP_ROWS):
            byte = scale_byte(row_amax[r], rceil=self.rceil)
            inv = inv_scale(byte)
            lo = payload_word(y[0, r], y[1, r], y[2, r], y[3, r], inv, byte)
            hi = payload_word(y[4, r], y[5, r], y[6, r], y[7, r], inv, byte)
            row_ok = Int32(r < valid_rows) * k_ok_i
            if const_expr(self.rowwise):
                store_v2_u32(row_q, r * K, lo, hi, row_ok)
                if kq == 0:  # 0 past M and past K: the blocked layout's padding (the plain one stores none of it)
                    sRowS[row0 + r, c0 // BLOCK] = (byte * row_ok).to(cutlass.Uint8)
            if const_expr(self.row_operand):
                store_v4_u32(row_op, r * K * 2, dequantized_bf16x2(lo, byte, False), dequantized_bf16x2(lo, byte, True),
                             dequantized_bf16x2(hi, byte, False), dequantized_bf16x2(hi, byte, True), row_ok)

        # 6. colwise cast: y^T rows k + v, bytes strip_m .. + 8 (inside the 16-byte aligned row when strip_m < M);
        # the column's scale byte from the first strip (mq 0), to the plain layout or to shared memory.
        col_q = col_s = lead_m = col_words = None
        if const_expr(self.colwise):
            col_q = mColQ.iterator.toint() + Int64(k) * Int64(col_stride) + Int64(strip_m)
            col_s = mColS.iterator.toint() + Int64(bidx) * K + Int64(k)  # plain: stored [col_blocks, K]
        strip_ok = Int32(strip_m < M) * k_ok_i
        if const_expr(self.colwise):
            lead_m = Int32(mq == 0) * Int32(bidx < col_blocks)
        if const_expr(self.col_operand):  # the strip's BF16 pairs of rows (2 i, 2 i + 1) of column v: [v, i]
            col_words = cute.make_rmem_tensor(cute.make_layout((STRIP_COLS, STRIP_ROWS // 2)), Int32)
        col_scale_words = [Int32(0), Int32(0)]  # plain layout: the strip's 8 column-scale bytes, columns k .. k + 7
        if const_expr(self.colwise or self.col_operand):
            for v in cutlass.range_constexpr(STRIP_COLS):
                byte = scale_byte(col_amax[v], rceil=self.rceil)
                inv = inv_scale(byte)
                lo = payload_word(y[v, 0], y[v, 1], y[v, 2], y[v, 3], inv, byte)
                hi = payload_word(y[v, 4], y[v, 5], y[v, 6], y[v, 7], inv, byte)
                if const_expr(self.colwise):
                    store_v2_u32(col_q + Int64(v) * Int64(col_stride), 0, lo, hi, strip_ok)
                    if const_expr(self.blocked):  # blocks past M hold zeros (y is 0 there); columns past K: 0
                        if mq == 0:
                            sColS[c0 + v] = (byte * k_ok_i).to(cutlass.Uint8)
                    else:
                        col_scale_words[v // 4] = col_scale_words[v // 4] | (byte << (8 * (v % 4)))
                if const_expr(self.col_operand):
                    col_words[v, 0] = dequantized_bf16x2(lo, byte, False)
                    col_words[v, 1] = dequantized_bf16x2(lo, byte, True)
                    col_words[v, 2] = dequantized_bf16x2(hi, byte, False)
                    col_words[v, 3] = dequantized_bf16x2(hi, byte, True)
        if const_expr(self.colwise and not self.blocked):  # 8-byte aligned: K a multiple of 32, k of 8
            store_v2_u32(col_s, 0, col_scale_words[0], col_scale_words[1], lead_m * k_ok_i)
        if const_expr(self.col_operand):  # laid out as y: 16 bytes per row of the strip, columns paired by `prmt`
            col_op = mColOp.iterator.toint() + (Int64(strip_m) * K + Int64(k)) * 2
            for i in cutlass.range_constexpr(STRIP_ROWS // 2):
                even = [byte_perm(col_words[2 * j, i], col_words[2 * j + 1, i], 0x5410) for j in range(4)]
                odd = [byte_perm(col_words[2 * j, i], col_words[2 * j + 1, i], 0x7632) for j in range(4)]
                store_v4_u32(col_op, 2 * i * K * 2, *even, Int32(2 * i < valid_rows) * k_ok_i)
                store_v4_u32(col_op, (2 * i + 1) * K * 2, *odd, Int32(2 * i + 1 < valid_rows) * k_ok_i)
        if const_expr(self.rowwise or (self.blocked and self.colwise)):
            cute.arch.barrier()
            if const_expr(self.blocked):
                self._store_blocked_scales(sRowS, sColS, mRowS, mColS, m0, k0, bidx, col_blocks, tidx)
            else:
                self._store_plain_row_scales(sRowS, mRowS, M, m0, k0, tidx)

    @cute.jit
    def _store_plain_row_scales(self, sRowS, mRowS, M, m0, k0, tidx):
        """The tile's row-scale bytes from shared memory into the plain `[M, K/32]` matrix, consecutive threads on
        consecutive units: 4-byte words when K/32 is a multiple of 4 (every word then aligned), else bytes. Stored
        from the lanes, one byte each, they were as many L2 requests as the rowwise payload's."""
        unit = 4 if self.k_blocks % 4 == 0 else 1
        units = cute.recast_tensor(sRowS, Int32) if const_expr(unit == 4) else sRowS  # (32, scale_cols / unit)
        store = store_u32 if const_expr(unit == 4) else store_u8
        per_row = self.scale_cols // unit
        n_units = BLOCK * per_row
        row_s = mRowS.iterator.toint()
        for it in cutlass.range_constexpr(cute.ceil_div(n_units, self.num_threads)):
            idx = tidx + it * self.num_threads
            inside = Int32(idx < n_units)
            idx = cutlass.min(idx, n_units - 1)
            rr = idx // per_row
            cb = k0 // BLOCK + (idx % per_row) * unit
            ok = inside * Int32(m0 + rr < M) * Int32(cb < self.k_blocks)
            store(row_s + Int64(m0 + rr) * self.k_blocks + Int64(cb), 0, Int32(units[rr, idx % per_row]), ok)

    @cute.jit
    def _store_blocked_scales(self, sRowS, sColS, mRowS, mColS, m0, k0, bidx, col_blocks, tidx):
        """The tile's scale bytes from shared memory into the 128x4 blocked layouts. A row's 4 scales of one
        128-column group are one 4-byte word of its 512-byte tile: stored as words, not bytes (single-byte stores
        were a third of the kernel's L2 requests). A column's scale byte shares its word with 3 other CTAs' row
        blocks: one byte. Nothing past the layouts' 128-column padding is stored."""
        if const_expr(self.rowwise):
            self._store_blocked_row_scales(sRowS, mRowS, m0, k0, tidx)
        if const_expr(self.colwise):
            self._store_blocked_col_scales(sColS, mColS, k0, bidx, col_blocks, tidx)

    @cute.jit
    def _store_blocked_row_scales(self, sRowS, mRowS, m0, k0, tidx):
        row_words = cute.recast_tensor(sRowS, Int32)  # (32, scale_cols / 4)
        per_row = self.scale_cols // 4
        n_row_words = BLOCK * per_row
        row_s = mRowS.iterator.toint()
        for it in cutlass.range_constexpr(cute.ceil_div(n_row_words, self.num_threads)):
            idx = tidx + it * self.num_threads
            inside = Int32(idx < n_row_words)
            idx = cutlass.min(idx, n_row_words - 1)
            rr = idx // per_row
            group = (k0 >> 7) + idx % per_row
            row = m0 + rr
            offset = (Int64(row >> 7) * self.row_scale_tiles + Int64(group)) * 512 \
                + Int64((row & 31) * 16 + ((row >> 5) & 3) * 4)
            store_u32(row_s + offset, 0, row_words[rr, idx % per_row], inside * Int32(group < self.row_scale_tiles))

    @cute.jit
    def _store_blocked_col_scales(self, sColS, mColS, k0, bidx, col_blocks, tidx):
        col_s = mColS.iterator.toint()
        col_tiles = (col_blocks + 3) >> 2
        for it in cutlass.range_constexpr(cute.ceil_div(self.tile_k, self.num_threads)):
            t = tidx + it * self.num_threads  # tile_k is a multiple of the thread count
            k = k0 + t
            offset = (Int64(k >> 7) * Int64(col_tiles) + Int64(bidx >> 2)) * 512 \
                + Int64((k & 31) * 16 + ((k >> 5) & 3) * 4 + (bidx & 3))
            store_u8(col_s + offset, 0, Int32(sColS[t]), Int32(k < self.k_pad128))

    @cute.jit
    def _cluster_sum(self, partial: Float32, sPeer: cute.Tensor, mbar, tidx: Int32) -> Float32:
        """Sum of `partial` (row `tidx` of this CTA's block) over the CTAs of the cluster, in rank order."""
        rank = cute.arch.block_idx_in_cluster()
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.cluster_n * BLOCK * 4)
        for peer in cutlass.range_constexpr(self.cluster_n):
            quack_utils.store_shared_remote(partial, quack_utils.elem_pointer(sPeer, (rank, tidx)), mbar, peer)
        cute.arch.mbarrier_wait(mbar, phase=0)
        total = Float32(0.0)
        for peer in cutlass.range_constexpr(self.cluster_n):
            total = total + sPeer[peer, tidx]
        return total
