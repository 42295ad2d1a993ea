"""What the sm_100a MXFP8 attention kernels' MMA warps share: a scale tile's trip from global to shared memory, and
a block-scaled GEMM of one tile, one `tcgen05.mma.kind::mxf8f6f4.block_scale` per 32-element K block."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

# bytes of one 128x4 tile of the blocked scale layout (the scale-factor atom of tcgen05 block-scaled MMA)
SF_TILE_BYTES = 512


@cute.jit
def load_scale_tile(mSF: cute.Tensor, head_idx: Int32, tile: Int32, words: cute.Tensor,
                    clamp: cutlass.Constexpr[bool] = False):
    """Scale tile `tile` of head `head_idx` (`mSF`: `[H, bytes / 4]` Int32) into the shared-memory words `words`
    by the 32 lanes of the calling warp (16 bytes each), made visible to the async proxy (tcgen05.cp and the MMA
    read it there). `clamp`: keep the tile index inside the buffer (the forward: a Q tile whose sequence has no key
    tile still issues its MMAs, their results all masked, with a key tile index one below or past its sequence's)."""
    lane = cute.arch.lane_idx()
    if const_expr(clamp):
        tile = cutlass.min(cutlass.max(tile, 0), mSF.shape[1] // (SF_TILE_BYTES // 4) - 1)
    base = tile * (SF_TILE_BYTES // 4) + lane * 4
    for j in cutlass.range_constexpr(4):
        words[lane * 4 + j] = mSF[head_idx, base + j]
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_warp()


@cute.jit
def block_scaled_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                      tSFA: cute.Tensor, tSFB: cute.Tensor, accumulate, wait_at_k: cutlass.Constexpr[int] = -1,
                      mbar=None, phase=None):
    """acc (+)= A B over the tile's K blocks, the scale factors of K block k at `tSFA[None, None, k]` and
    `tSFB[None, None, k]` (tensor memory). `wait_at_k` >= 0: wait on `mbar` (`phase`) before that K block (an
    operand written in two parts, as FA4's forward P)."""
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its fields are set per call
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        if const_expr(k == wait_at_k):
            cute.arch.mbarrier_wait(mbar, phase)
        if const_expr(k == 0):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate)
        else:
            atom.set(tcgen05.Field.ACCUMULATE, True)
        atom.set(tcgen05.Field.SFA, tSFA[None, None, k].iterator)
        atom.set(tcgen05.Field.SFB, tSFB[None, None, k].iterator)
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
