"""MXFP8 jagged attention forward on sm_90a: FlashAttention-4's Hopper forward with the LP-FA4 recipe's P.

The operands arrive MX-exact in BF16 (Q, K `hdim`, V `seq`, from the producer pass), so S = Q K^T is the recipe's
product. The kernel is FA4's (`FlashAttentionForwardSm90`: TMA producer warp, two consumer warpgroups, intra-
warpgroup overlap of the two GEMMs, P from registers into the P.V wgmma); the one step the recipe changes is where
FA4 converts P from FP32 to BF16: here P is rounded to its E4M3 grid on the way (`const_p`: e4m3(256 p) 2^-8;
`dynamic`: 1x32 blocks along kv, rceil scale of the block max), which BF16 holds exactly.

The row max is snapped up to an integer in the log2 domain, m' = ceil(max_j s_j * scale * log2 e), as the
reference recipe defines it: p = exp2(s * scale * log2 e - m') then differs between the running and the final max
by an exact power of two, which E4M3 rounding (const_p and dynamic alike) and the O rescaling commute with, so
the online kernel rounds the same values as the reference (up to FP32 summation order and exp2's last bits).
LSE = m' ln 2 + ln l uses the unrounded row sum l = sum p; O is normalized by the sum of the rounded P (so a
row's weights sum to one and a query that sees one key gets exactly that value), both as the reference does:
the softmax state (`MXSoftmax`) keeps both sums.
"""
from __future__ import annotations

import math
import operator

from dataclasses import dataclass
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from flash_attn.cute import utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.softmax import Softmax
from quack import layout_utils, sm90_utils

from gem_lp.attention.cute.mx_device import abs_bits_max, ceil_f32, e4m3_bf16x2, fmax_bits, mx_bf16x2, mx_scales, rint_f32

LN2 = math.log(2.0)

MX_BLOCK = 32
# const_p stores e4m3(256 p): the softmax produces 256 p directly (2^8 folded into exp2's offset)
CONST_P_LOG2 = 8


@dataclass
class MXSoftmax(Softmax):
    """FA4's online softmax state with the recipe's two changes: the row max snapped up to an integer in the
    log2 domain, and a second row sum, of the rounded P, that normalizes O (LSE keeps the unrounded sum).

    `row_max` holds m' / scale_log2 (m' recovered by rounding); `row_sum`, `rounded_row_sum`: per-thread partial
    sums, reduced over the 4 lanes of a row in `finalize`.
    """

    rounded_row_sum: cute.Tensor = None
    # P is held as 2^p_log2_offset * p (const_p: 256 p, its E4M3 payload before rounding); sums alike
    p_log2_offset: cutlass.Constexpr[int] = 0

    @staticmethod
    def create(scale_log2: Float32, num_rows: cutlass.Constexpr[int], arch: cutlass.Constexpr[int] = 80,
               softmax_scale: Float32 | None = None, p_log2_offset: cutlass.Constexpr[int] = 0):
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        rounded_row_sum = cute.make_rmem_tensor(num_rows, Float32)
        return MXSoftmax(scale_log2, num_rows, row_max, row_sum, arch, softmax_scale, rounded_row_sum,
                         p_log2_offset)

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool] = False,
                       check_inf: cutlass.Constexpr[bool] = True) -> cute.Tensor:
        """p = exp2(s * scale_log2 - m') in place (times 2^p_log2_offset), the unrounded row sums, and the O
        rescaling factors (exact powers of two)."""
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        scale_log2 = self.scale_log2
        inv_scale_log2 = 1.0 / scale_log2
        for r in cutlass.range(cute.size(self.row_max), unroll_full=True):
            row = acc_S_mn[r, None].load()
            block_max = utils.fmax_reduce(row, init_val=None, arch=self.arch)
            block_max = cute.arch.warp_reduction_max(block_max, threads_in_group=4)
            m_cur = ceil_f32(block_max * scale_log2)
            m_prev = Float32(0.0)
            if const_expr(not is_first):
                m_prev = rint_f32(self.row_max[r] * scale_log2)
                m_cur = cute.arch.fmax(m_cur, m_prev)
            self.row_max[r] = m_cur * inv_scale_log2
            m_exp = 0.0 if m_cur == -Float32.inf else m_cur
            p = cute.math.exp2(row * scale_log2 - (m_exp - self.p_log2_offset), fastmath=True)
            if const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = utils.fadd_reduce(p, init_val=None, arch=self.arch)
            else:
                row_scale[r] = cute.math.exp2(m_prev - m_exp, fastmath=True)
                self.row_sum[r] = utils.fadd_reduce(p, init_val=self.row_sum[r] * row_scale[r], arch=self.arch)
            acc_S_mn[r, None].store(p)
        return row_scale

    @cute.jit
    def add_rounded(self, tile_sum: cute.Tensor, row_scale: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        for r in cutlass.range_constexpr(cute.size(tile_sum)):
            if const_expr(is_first):
                self.rounded_row_sum[r] = tile_sum[r]
            else:
                self.rounded_row_sum[r] = self.rounded_row_sum[r] * row_scale[r] + tile_sum[r]

    @cute.jit
    def finalize(self, final_scale: Float32 = 1.0, sink_val=None) -> cute.Tensor:
        """O's row factors 1 / sum(rounded P) (1 for rows without a visible key); `row_sum` becomes LSE."""
        self.row_sum.store(utils.warp_reduce(self.row_sum.load(), operator.add, width=4))
        self.rounded_row_sum.store(utils.warp_reduce(self.rounded_row_sum.load(), operator.add, width=4))
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        for r in cutlass.range(cute.size(self.row_sum), unroll_full=True):
            l = self.row_sum[r]
            lq = self.rounded_row_sum[r]
            row_scale[r] = cute.arch.rcp_approx(lq if lq != 0.0 else 1.0) * final_scale
            self.row_sum[r] = ((self.row_max[r] * self.scale_log2 - self.p_log2_offset
                                + cute.math.log2(l, fastmath=True)) * LN2 if l != 0.0 else -Float32.inf)
        return row_scale


class MXAttentionForwardSm90(FlashAttentionForwardSm90):
    """`FlashAttentionForwardSm90` (BF16, varlen, no GQA packing) with the recipe's softmax and P operand."""

    def __init__(self, head_dim: int, *, is_causal: bool, tile_m: int, tile_n: int, p_quant: str):
        if p_quant not in ("const_p", "dynamic"):
            raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
        if tile_n % MX_BLOCK:
            raise ValueError(f"tile_n must be a multiple of {MX_BLOCK}, got {tile_n}")
        super().__init__(cutlass.BFloat16, head_dim, head_dim, 1, is_causal=is_causal, is_local=False,
                         pack_gqa=False, tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=384,
                         Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True)
        # the methods below cover FA4's register-P, intra-warpgroup-overlap schedule without score mods
        assert head_dim <= 128
        self.p_quant = p_quant

    @cute.jit
    def p_operand(self, acc_S: cute.Tensor, tOrP: cute.Tensor) -> cute.Tensor:
        """P (FP32 accumulator fragment after the online softmax; 256 p for const_p) -> the BF16 A fragment of the
        P.V wgmma, on the E4M3 grid; returns this thread's partial row sums of the rounded P (two rows).

        The rounding goes through the hardware E4M3 conversion (`mx_device.e4m3_bf16x2`, `mx_bf16x2`), cheaper than
        rounding with FP32 adds on the E4M3 grid before FA4's BF16 conversion.
        Accumulator register 2i + e (e = 0, 1: two adjacent columns) is row i % 2 of the thread, column group
        i // 2 (8 columns wide, 4 lanes across); a 1x32 block is 4 column groups of one row, spread over the 4
        lanes of a quad.
        """
        src = layout_utils.reshape_acc_to_frgA(acc_S)
        dst = cute.recast_tensor(tOrP, Int32)
        n_pairs = const_expr(cute.size(dst))
        sums = cute.make_rmem_tensor(8, Float32)  # four partial sums per row keep the additions independent
        sums.fill(0.0)
        blocks_per_row = const_expr(self.tile_n // MX_BLOCK)
        if const_expr(self.p_quant == "dynamic"):
            n_blocks = const_expr(2 * blocks_per_row)
            amax = cute.make_rmem_tensor(n_blocks, Int32)
            amax.fill(0)
            for i in cutlass.range_constexpr(n_pairs):
                b = (i % 2) * blocks_per_row + (i // 2) // 4
                amax[b] = abs_bits_max(abs_bits_max(amax[b], src[2 * i]), src[2 * i + 1])
            for b in cutlass.range_constexpr(n_blocks):
                m = amax[b]
                m = fmax_bits(m, cute.arch.shuffle_sync_bfly(m, offset=1))
                amax[b] = fmax_bits(m, cute.arch.shuffle_sync_bfly(m, offset=2))
        if const_expr(self.p_quant == "const_p"):
            for i in cutlass.range_constexpr(n_pairs):
                dst[i], pair_sum = e4m3_bf16x2(src[2 * i], src[2 * i + 1], ret_sum=True)
                sums[i % 8] += pair_sum
        else:
            inv_scale = cute.make_rmem_tensor(2 * blocks_per_row, Float32)
            dequant = cute.make_rmem_tensor(2 * blocks_per_row, Int32)
            for b in cutlass.range_constexpr(2 * blocks_per_row):
                inv_scale[b], dequant[b] = mx_scales(amax[b], single_step=True)
            for i in cutlass.range_constexpr(n_pairs):
                b = (i % 2) * blocks_per_row + (i // 2) // 4
                dst[i], pair_sum = mx_bf16x2(src[2 * i], src[2 * i + 1], inv_scale[b], dequant[b], signed=False,
                                             single_step=True, ret_sum=True)
                sums[i % 8] += pair_sum
        tile_sum = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            tile_sum[r] = (sums[r] + sums[r + 2]) + (sums[r + 4] + sums[r + 6])
        return tile_sum

    @cute.jit
    def first_half_block_overlap(self, n_block, mma_qk_fn, kv_consumer_state, pipeline_k, tOrP, smem_copy_params,
                                 softmax, seqlen, scores_scale=None, acc_O=None, mask_fn=None, score_mod_fn=None,
                                 is_first_block: bool = False):
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        acc_S = mma_qk_fn(B_idx=kv_consumer_state.index, wg_wait=0)
        pipeline_k.consumer_release(kv_consumer_state)
        mask_fn(acc_S, n_block=n_block, mask_seqlen=True)
        row_scale = softmax.online_softmax(acc_S, is_first=True)
        softmax.add_rounded(self.p_operand(acc_S, tOrP), row_scale, is_first=True)
        return kv_consumer_state

    @cute.jit
    def mma_one_n_block_intrawg_overlap(self, smem_pipe_read, n_block, mma_qk_fn, mma_pv_fn, pipeline_k,
                                        pipeline_v, acc_O, tOrP, smem_copy_params, softmax, seqlen,
                                        scores_scale=None, score_mod_fn=None, mask_fn=None,
                                        check_inf: cutlass.Constexpr = True):
        smem_pipe_read_v = smem_pipe_read.clone()
        smem_pipe_read.advance()
        pipeline_k.consumer_wait(smem_pipe_read, pipeline_k.consumer_try_wait(smem_pipe_read))
        self.warp_scheduler_barrier_sync()
        acc_S = mma_qk_fn(B_idx=smem_pipe_read.index, wg_wait=-1)  # S = Q K^T of this block
        pipeline_v.consumer_wait(smem_pipe_read_v, pipeline_v.consumer_try_wait(smem_pipe_read_v))
        mma_pv_fn(B_idx=smem_pipe_read_v.index, wg_wait=-1)  # O += P V of the previous block
        self.warp_scheduler_barrier_arrive()
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(smem_pipe_read)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(smem_pipe_read_v)
        softmax.add_rounded(self.p_operand(acc_S, tOrP), row_scale, is_first=False)
        softmax.rescale_O(acc_O, row_scale)
        return smem_pipe_read

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx, softmax_scale_log2, softmax_scale,
            block_info, SeqlenInfoCls, AttentionMaskCls, TileSchedulerCls, blocksparse_tensors, aux_data=None,
            fastdiv_mods=None):
        """FA4's consumer warpgroups (`FlashAttentionForwardSm90.mma`) for this kernel's case: varlen, causal or
        not, no sinks, score mods or block sparsity; the softmax state is `MXSoftmax`."""
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)
        warp_group_thread_layout = cute.make_layout(self.num_wg_mma, stride=self.num_threads_per_warp_group)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(warp_group_thread_layout(warp_group_idx))
        wg_mma_pv = tiled_mma_pv.get_slice(warp_group_thread_layout(warp_group_idx))
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
            wg_mma_qk, (self.tile_m, self.tile_n, self.tile_hdim), sQ, sK)
        mma_qk_fn = partial(sm90_utils.gemm_zero_init, tiled_mma_qk, (self.tile_m, self.tile_n), tSrQ, tSrK)
        acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
            wg_mma_pv, (self.tile_m, self.tile_hdimv, self.tile_n), sP, sVt)
        mma_pv_fn = partial(sm90_utils.gemm_w_idx, tiled_mma_pv, acc_O, tOrP, tOrVt)
        self.mma_init()
        q_consumer_phase = Int32(0)
        kv_consumer_state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Consumer, self.num_stages)
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        softmax = MXSoftmax.create(softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1],
                                   softmax_scale=softmax_scale,
                                   p_log2_offset=CONST_P_LOG2 if const_expr(self.p_quant == "const_p") else 0)
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            mask = AttentionMaskCls(seqlen)
            mask_fn = partial(mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx, m_block=m_block,
                              thr_mma=thr_mma_qk, mask_causal=self.is_causal, mask_local=False, aux_data=aux_data,
                              fastdiv_mods=fastdiv_mods)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            pipeline_q.consumer_wait_w_index_phase(0, q_consumer_phase)
            # the last KV block first (it holds the sequence end, and under causal the diagonal)
            kv_consumer_state = self.first_half_block_overlap(
                n_block_max - 1, mma_qk_fn, kv_consumer_state, pipeline_k, tOrP, None, softmax, seqlen,
                mask_fn=partial(mask_fn, mask_mod=None))
            n_block_max -= 1
            O_should_accumulate = False
            if const_expr(self.is_causal):
                n_block_min_causal = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
                for n_tile in cutlass.range(n_block_max - n_block_min_causal, unroll=1):
                    kv_consumer_state = self.mma_one_n_block_intrawg_overlap(
                        kv_consumer_state, n_block_max - 1 - n_tile, mma_qk_fn,
                        partial(mma_pv_fn, zero_init=not O_should_accumulate), pipeline_k, pipeline_v, acc_O,
                        tOrP, None, softmax, seqlen,
                        mask_fn=partial(mask_fn, mask_mod=None, mask_seqlen=False))
                    O_should_accumulate = True
                n_block_max = cutlass.min(n_block_max, n_block_min_causal)
            for n_tile in cutlass.range(n_block_max - n_block_min, unroll=1):
                kv_consumer_state = self.mma_one_n_block_intrawg_overlap(
                    kv_consumer_state, n_block_max - 1 - n_tile, mma_qk_fn,
                    partial(mma_pv_fn, zero_init=not O_should_accumulate), pipeline_k, pipeline_v, acc_O, tOrP,
                    None, softmax, seqlen)
                O_should_accumulate = True
            pipeline_q.consumer_release_w_index(0)
            kv_consumer_state = self.last_half_block_overlap(
                kv_consumer_state, pipeline_v, mma_pv_fn, zero_init=not O_should_accumulate)
            q_consumer_phase ^= 1
            softmax.rescale_O(acc_O, softmax.finalize())
            self.epilogue(acc_O, softmax.row_sum, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma_pv,
                          tidx, m_block, head_idx, batch_idx)
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
