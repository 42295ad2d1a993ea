"""MXFP8 jagged attention backward on sm_90a: FlashAttention-4's Hopper backward with the LP-FA4 recipe's P, dS.

Operands arrive MX-exact in BF16: Q, K, dO in `square` 32x32 blocks and V in `hdim` (the producer pass), so
S = Q K^T and dP = dO V^T are the recipe's products. FA4's kernel (`FlashAttentionBackwardSm90`: one KV tile per
CTA, S^T = K Q^T and dP^T in registers, dK / dV accumulated in registers, dQ added to an FP32 buffer) is kept
whole; the recipe changes the one step `mma_one_m_block` where P and dS are converted from FP32 to BF16:

* P for dV = P^T dO: `const_p` e4m3(256 p) 2^-8, or `dynamic` 32x32 blocks (rceil) of P;
* dS = P (dP - Δ) from the unrounded P (as the reference), then quantized in 32x32 blocks by its max-abs
  (rceil) for dK = dS^T Q and dQ = dS K.

A 32 (queries) x 32 (keys) block is, in the S^T accumulator of a warpgroup, 16 key rows in each of two
neighbouring warps: each warp reduces its half (registers, then the 32 lanes), and the pair meets in shared
memory (two slots per block, alternating with the Q pipeline stage so one named barrier per step suffices).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.named_barrier import NamedBarrierBwd
from quack import copy_utils, layout_utils

from gem_lp.attention.cute.config import BwdTiles
from gem_lp.attention.cute.mx_device import abs_bits_max, const_p_bf16x2, fmax_bits, mx_bf16x2, mx_scales

MX_BLOCK = 32
WARPS_PER_WG = 4
# Named barriers of the block-max exchange, one per MMA warpgroup, after the ones FA4's backward uses.
_EXCHANGE_BARRIER = max(int(b) for b in NamedBarrierBwd) + 1


class MXAttentionBackwardSm90(FlashAttentionBackwardSm90):
    """`FlashAttentionBackwardSm90` (BF16, varlen, MHA) whose P and dS operands are on the recipe's grids."""

    def __init__(self, head_dim: int, *, is_causal: bool, tiles: BwdTiles, p_quant: str):
        if p_quant not in ("const_p", "dynamic"):
            raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
        if tiles.tile_m % MX_BLOCK or tiles.tile_n % (2 * MX_BLOCK):
            raise ValueError(f"tiles must be multiples of the MX block, got {tiles}")
        super().__init__(
            cutlass.BFloat16, head_dim, head_dim, 1, is_causal, is_local=False, deterministic=False,
            tile_m=tiles.tile_m, tile_n=tiles.tile_n, Q_stage=tiles.q_stages, dO_stage=tiles.do_stages,
            PdS_stage=tiles.pds_stages, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=tiles.dq_swap_ab,
            AtomLayoutMSdP=1, AtomLayoutNdKV=tiles.atom_layout_n_dkv, AtomLayoutMdQ=tiles.atom_layout_m_dq,
            num_threads=384)
        # the override below is written for this schedule: P and dS reach the dK / dV wgmmas from registers
        assert self.mma_dkv_is_rs and self.num_wg_dQ == self.num_wg_mma == 2 and self.Q_stage == 2
        assert _EXCHANGE_BARRIER + self.num_wg_mma <= 16
        self.p_quant = p_quant
        self.n_qblocks = tiles.tile_m // MX_BLOCK

    # ------------------------------------------------------------------ MX rounding of P and dS

    @cute.jit
    def _square_amax(self, src: cute.Tensor, slots: cute.Tensor, slot_set: Int32, parity: Int32,
                     warp_group_idx: Int32):
        """Per 32x32 block: the max-abs bits of this warp's half of the block (registers, then the warp), written
        to this warp's slot; `amax[qb]` is returned before the exchange. The S^T accumulator register 2i + e
        holds key row i % 2 of the thread and query column group i // 2, so query block qb = (i // 2) // 4."""
        amax = cute.make_rmem_tensor(self.n_qblocks, Int32)
        amax.fill(0)
        for i in cutlass.range_constexpr(cute.size(src) // 2):
            qb = (i // 2) // 4
            amax[qb] = abs_bits_max(abs_bits_max(amax[qb], src[2 * i]), src[2 * i + 1])
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % WARPS_PER_WG
        for qb in cutlass.range_constexpr(self.n_qblocks):
            m = amax[qb]
            for s in cutlass.range_constexpr(5):
                m = fmax_bits(m, cute.arch.shuffle_sync_bfly(m, offset=1 << s))
            amax[qb] = m
            if cute.arch.lane_idx() == 0:
                slots[parity, slot_set, warp_group_idx, warp, qb] = m
        return amax

    @cute.jit
    def _square_scales(self, amax: cute.Tensor, slots: cute.Tensor, slot_set: Int32, parity: Int32,
                       warp_group_idx: Int32, single_step: cutlass.Constexpr[bool]):
        """After the exchange barrier: the block max over both warps of the pair, and the block's scales."""
        partner = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) % WARPS_PER_WG) ^ 1
        inv_scale = cute.make_rmem_tensor(self.n_qblocks, Float32)
        dequant = cute.make_rmem_tensor(self.n_qblocks, Int32)
        for qb in cutlass.range_constexpr(self.n_qblocks):
            m = fmax_bits(amax[qb], slots[parity, slot_set, warp_group_idx, partner, qb])
            inv_scale[qb], dequant[qb] = mx_scales(m, single_step=single_step)
        return inv_scale, dequant

    @cute.jit
    def _to_grid(self, src: cute.Tensor, inv_scale: cute.Tensor, dequant: cute.Tensor,
                 signed: cutlass.Constexpr[bool], single_step: cutlass.Constexpr[bool]) -> cute.Tensor:
        dst = cute.make_rmem_tensor(src.shape, self.dtype)
        dst_i32 = cute.recast_tensor(dst, Int32)
        for i in cutlass.range_constexpr(cute.size(dst_i32)):
            qb = (i // 2) // 4
            dst_i32[i] = mx_bf16x2(src[2 * i], src[2 * i + 1], inv_scale[qb], dequant[qb], signed=signed,
                                   single_step=single_step)
        return dst

    @cute.jit
    def _const_p(self, src: cute.Tensor) -> cute.Tensor:
        dst = cute.make_rmem_tensor(src.shape, self.dtype)
        dst_i32 = cute.recast_tensor(dst, Int32)
        for i in cutlass.range_constexpr(cute.size(dst_i32)):
            dst_i32[i] = const_p_bf16x2(src[2 * i], src[2 * i + 1])
        return dst

    # ------------------------------------------------------------------ FA4's step with the recipe's rounding

    @cute.jit
    def mma_one_m_block(self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx, mma_qk_fn, mma_dov_fn,
                        mma_pdo_fn, mma_dsq_fn, mma_dsk_fn, copy_P_r2s, copy_dS_r2s, pipeline_Q, pipeline_dO,
                        tLSEsLSE, tLSEsdPsum, tdQsdQaccum, softmax_scale_log2, PdS_barrier,
                        is_dQ_wg: cutlass.Constexpr[bool] = True, mask_fn=None, score_mod_fn=None,
                        score_mod_bwd_fn=None, dKV_accumulate=True):
        n_sets = const_expr(2 if self.p_quant == "dynamic" else 1)
        slots = cutlass.utils.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout((2, n_sets, self.num_wg_mma, WARPS_PER_WG, self.n_qblocks)), byte_alignment=16)
        # the slots alternate with the Q pipeline stage: consecutive iterations, across tiles too
        parity = consumer_state_Q.index
        consumer_state_dO_cur = (
            consumer_state_Q if const_expr(self.Q_stage == self.dO_stage) else consumer_state_dO
        )
        smem_idx_Q = consumer_state_Q.index
        smem_idx_dO = consumer_state_dO_cur.index if const_expr(self.dO_stage > 1) else 0
        smem_idx_PdS = smem_idx_Q if const_expr(self.PdS_stage > 1) else 0
        # S^T = K Q^T and dP^T = V dO^T
        pipeline_Q.consumer_wait(consumer_state_Q, pipeline_Q.consumer_try_wait(consumer_state_Q))
        acc_S = mma_qk_fn(A_idx=smem_idx_Q, wg_wait=-1)
        tLSErLSE = copy_utils.load_s2r(tLSEsLSE[None, smem_idx_Q])
        pipeline_dO.consumer_wait(consumer_state_dO_cur, pipeline_dO.consumer_try_wait(consumer_state_dO_cur))
        acc_dP = mma_dov_fn(A_idx=smem_idx_Q, wg_wait=1)
        # P = exp(S - LSE)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S, m_block=m_block)
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=self.SdP_swapAB)
        lane_idx = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            lse_val = self._get_stat(tLSErLSE, r, lane_idx, shuffle=self.shuffle_LSE)
            for c in cutlass.range(cute.size(acc_S_mn, mode=[1]), unroll_full=True):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax_scale_log2 - lse_val, fastmath=True)
        tLSErdPsum = copy_utils.load_s2r(tLSEsdPsum[None, smem_idx_dO])
        p_frg = layout_utils.reshape_acc_to_frgA(acc_S)
        if const_expr(self.p_quant == "dynamic"):
            p_amax = self._square_amax(p_frg, slots, 1, parity, warp_group_idx)
        # dS = P (dP - Δ), from the unrounded P
        warpgroup.wait_group(0)
        acc_dP_mn = layout_utils.reshape_acc_to_mn(acc_dP, transpose=self.SdP_swapAB)
        for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
            dpsum_val = self._get_stat(tLSErdPsum, r, lane_idx, shuffle=self.shuffle_dPsum)
            for c in cutlass.range(cute.size(acc_dP_mn, mode=[1]), unroll_full=True):
                acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - dpsum_val)
        ds_frg = layout_utils.reshape_acc_to_frgA(acc_dP)
        ds_amax = self._square_amax(ds_frg, slots, 0, parity, warp_group_idx)
        cute.arch.barrier(barrier_id=_EXCHANGE_BARRIER + warp_group_idx,
                          number_of_threads=self.num_threads_per_warp_group)
        if const_expr(self.p_quant == "dynamic"):
            p_inv, p_dq = self._square_scales(p_amax, slots, 1, parity, warp_group_idx, single_step=True)
            tdVrP = self._to_grid(p_frg, p_inv, p_dq, signed=False, single_step=True)
        else:
            tdVrP = self._const_p(p_frg)
        ds_inv, ds_dq = self._square_scales(ds_amax, slots, 0, parity, warp_group_idx, single_step=False)
        tdKrdS = self._to_grid(ds_frg, ds_inv, ds_dq, signed=True, single_step=False)
        if const_expr(self.PdS_stage == 1):
            cute.arch.fence_view_async_shared()
            PdS_barrier.arrive_and_wait()
        copy_dS_r2s(tdKrdS, dst_idx=smem_idx_PdS)
        # dV += P^T dO
        mma_pdo_fn(tCrA=tdVrP, B_idx=smem_idx_dO, zero_init=not dKV_accumulate, wg_wait=-1)
        cute.arch.fence_view_async_shared()
        PdS_barrier.arrive_and_wait()
        # dQ = dS K
        acc_dQ = mma_dsk_fn(A_idx=smem_idx_PdS, wg_wait=1)
        pipeline_dO.consumer_release(consumer_state_dO_cur)
        # dK += dS^T Q
        mma_dsq_fn(tCrA=tdKrdS, B_idx=smem_idx_Q, zero_init=not dKV_accumulate, wg_wait=1)
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + warp_group_idx,
                          number_of_threads=self.num_threads_per_warp_group + cute.arch.WARP_SIZE)
        tdQrdQaccum_flat = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQaccum.shape))
        cute.autovec_copy(tdQrdQaccum_flat, tdQsdQaccum)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFullWG0) + warp_group_idx,
                                 number_of_threads=self.num_threads_per_warp_group + cute.arch.WARP_SIZE)
        warpgroup.wait_group(0)
        pipeline_Q.consumer_release(consumer_state_Q)
        consumer_state_Q.advance()
        consumer_state_dO.advance()
        return consumer_state_Q, consumer_state_dO
