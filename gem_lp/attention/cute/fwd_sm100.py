"""MXFP8 jagged attention forward on sm_100a: FlashAttention-4's Blackwell forward on block-scaled tcgen05.mma.

Operands are the MXFP8 tensors themselves, not dequantized copies: Q, K E4M3 payloads `[T, H, D]` with `hdim`
scales, V the E4M3 payload with `seq` scales, the scales in the per-sequence 128-padded blocked layout of
`gem_lp.jagged.quantize_jagged` (docs/jagged.md). Every scale operand of one 128-token tile of one head is then
one contiguous 512-byte tile of that layout (D <= 128: one 128x4 tile per 128 padded token rows, or per 128
features x 4 token blocks for `seq`), which is the shared-memory scale-factor atom of the block-scaled MMA.

What differs from `FlashAttentionForwardSm100` (its FP8 path: E4M3 Q, K, V, P = exp2(s - m + 8) in E4M3 in tensor
memory, O divided by the row sum of the unrounded P, LSE with the 2^8 taken out):

* S = Q K^T is `tcgen05.mma.kind::mxf8f6f4.block_scale` (`MmaMXF8Op`, UE8M0 scales, 32-element blocks along D):
  per Q tile and per K tile the MMA warp copies the tile's scales (512 bytes) from global to shared memory and
  then with `tcgen05.cp` (quack's `copy_utils.s2t_get_copy_fn`) into tensor memory, columns FA4 leaves free after
  S, P and O (which is why D = 128 runs with one Q stage: two would fill all 512 columns).
* The softmax is the recipe's (docs/numerics.md 4.1; `MXSoftmaxSm100`, a state FA4's softmax and correction warps
  run unchanged): the running row max snapped up to an integer in the log2 domain, m' = ceil(max s * scale_log2),
  so O's rescale factors are exact powers of two; P = exp2(t - m') rounded to E4M3 (`const_p`: FA4's 2^8 p,
  `dynamic`: 32-key MX blocks, rceil); O divided by the row sum of the rounded P (summed from the E4M3 values the
  MMA reads); LSE = (m' + log2 l) ln 2 from the unrounded row sum l, passed through FA4's row-max slot so that
  FA4's correction warps write it.
* O = P V is the same block-scaled kind with A = P from tensor memory. `const_p`: P's scale factors are the
  constant byte 127 (2^0: P is 256 p, the `const_p` payload, and the 2^-8 cancels in the normalization by the row
  sum of the same P), written once. `dynamic`: the softmax warps write each row's 4 scale bytes (one 32-bit word)
  to shared memory in the 128x4 blocked layout before FA4's P-full arrive, and the MMA warp copies them to tensor
  memory (`tcgen05.cp`) before each P V. V's `seq` scales (32 keys x 1 feature) are SFB along the key dim. P's
  second part is waited for on FA4's `P_full_lastsplit` barrier as in FA4 (`split_P_arrive`).
* Registers (`_setup_attributes`): with one Q stage FA4's second softmax warpgroup is idle, so the softmax
  warpgroup takes its share (setmaxnreg 256, the MMA / load / epilogue warps 80, the correction warps FA4's):
  with FA4's budgets the recipe's softmax spilled.
* The rest is FA4's: load warp (TMA of payloads), correction warpgroup, epilogue.

What is compiled and checked (on a machine without a GPU, `python -m gem_lp.compile_check --arch sm_100a`): the
kernel builds for sm_100a, const_p and dynamic, and its PTX holds the block-scaled `tcgen05.mma` for both GEMMs
and no other MMA. The softmax state's algebra is checked on the CPU against the reference by a model
(tests/attention/test_sm100_softmax_model.py), not the device code. Numerics on Blackwell are UNVERIFIED: no
sm_100 GPU was available, nothing here has run. Left: `dynamic` uses the MUFU exp2 for every element (FA4's
partial polynomial exp2 emulation is kept for const_p only); the scale tiles of Q, K, V go global -> registers
-> shared memory in the MMA warp, on the MMA issue path (a TMA load in the load warp is the next step); no
backward.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils_basic
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from flash_attn.cute import utils
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100
from flash_attn.cute.softmax import SoftmaxSm100
from flash_attn.cute.utils import AuxData
from quack import copy_utils

from gem_lp.attention.cute.mx_device import abs_bits_max, ceil_f32, e4m3x4_sum, e8m0_value, exp2_int, rceil_scale
from gem_lp.attention.cute.sm100_mma import SF_TILE_BYTES, block_scaled_gemm, load_scale_tile

MX_BLOCK = 32
# the E8M0 byte of 2^0, P's scale factor (FA4's P already holds 2^8 p, the const_p payload)
P_SF_BYTE = 127
# FA4's FP8 P is 2^8 p (its `max_offset`; its correction warps take the 8 out of the LSE)
FA4_FP8_P_LOG2 = 8
# const_p keeps it: 2^8 p is the E4M3 payload of const_p
CONST_P_LOG2 = 8
HEAD_DIMS = (64, 128)


def _jit_copy(fn, **globals_override):
    """A `cute.jit` function running the body of an FA4 `@cute.jit`/`@cute.kernel` method inline.

    FA4's kernel entry point builds everything inside one `@cute.kernel` (`FlashAttentionForwardSm100.kernel`);
    this kernel runs that body unchanged inside its own entry point, which takes the scale tensors too. The copy is
    a new function object over the same code, so the DSL's decoration state of FA4's method is left alone.
    `globals_override` rebinds module-level names the body uses (the DSL's preprocessor executes the re-parsed
    source in the function's globals): `softmax_loop` runs with `SoftmaxSm100` bound to `MXSoftmaxSm100`.
    """
    raw = fn.__wrapped__
    fn_globals = raw.__globals__
    if globals_override:
        fn_globals = dict(fn_globals)
        fn_globals.update(globals_override)
    # same name: the DSL's preprocessor finds the function's source by it
    copy = types.FunctionType(raw.__code__, fn_globals, raw.__name__, raw.__defaults__, raw.__closure__)
    copy.__kwdefaults__ = raw.__kwdefaults__
    copy.__qualname__ = raw.__qualname__
    copy.__module__ = raw.__module__
    copy.__dict__.update({k: v for k, v in raw.__dict__.items() if not k.startswith("_")})
    return cute.jit(copy)


_fa4_kernel_body = _jit_copy(FlashAttentionForwardSm100.kernel)


@dataclass
class MXSoftmaxSm100(SoftmaxSm100):
    """FA4's sm100 online softmax state (one query row per thread) with the recipe's changes (docs/numerics.md
    4.1): the running row max snapped up to an integer in the log2 domain, m' = ceil(max_j s_j * scale_log2), so
    O's rescale factors 2^(m'_old - m'_new) are exact powers of two (built from exponent bits, `exp2_int`); P on
    its E4M3 grid; O normalized by the row sum of the rounded P and the LSE from the row sum of the unrounded P.

    * `const_p`: P = e4m3(2^(t - m' + 8)) as in FA4's FP8 path (`max_offset` 8: the const_p payload; the P.V MMA
      takes P's scale byte 127, and the 2^8 cancels in the normalization).
    * `dynamic`: p = 2^(t - m') and per 32 keys of a row (one MX block) the rceil scale byte of the block max; the
      payload e4m3(p * 2^(127 - byte)) goes to tensor memory as FA4's P, and the row's 4 bytes (one 32-bit word,
      tile_n = 128) to shared memory in the 128x4 blocked scale layout (`sSFP`, this stage's 512 bytes), from
      where the MMA warp copies them to tensor memory as the P.V MMA's SFA. The exp2 is the MUFU one throughout
      (FA4's partial polynomial emulation of exp2 is not used here).

    FA4's softmax steps (`softmax_step`) and its correction warps (`correction_loop`) run unchanged on this state;
    the state keeps what they read in FA4's meaning:
    * `row_sum[0]`: lq, the sum of the rounded P (times 2^8 for const_p): the correction warps divide O by it;
    * `row_max[0]`: (m' + log2(l / lq) + 8 - p_log2_offset) / scale_log2, with l the unrounded sum: the correction
      warps' LSE, (row_max * scale_log2 + log2(row_sum) - 8) ln 2, is then (m' + log2(l 2^-p_log2_offset)) ln 2,
      the recipe's (FA4's row_max is an "unscaled" max, which it multiplies by scale_log2, and its 8 is the FP8
      P offset);
    * `max_log2[0]`: m' (-inf before the first visible key), `unrounded_sum[0]`: l.
    The value `update_row_max` returns (and `scale_subtract_rowmax` takes) is m' itself, 0 for a row without a
    visible key yet. The rounded sum of a step is taken in `apply_exp2_convert` from the E4M3 P it wrote (summing
    there, while those registers are live anyway for FA4's store of P, keeps the softmax warps free of spills;
    deferring it past the store spilled) and added in `update_row_sum`.
    """

    max_log2: cute.Tensor = None
    unrounded_sum: cute.Tensor = None
    # dynamic P: the shared-memory scale words of P (all stages)
    sSFP_words: cute.Tensor = None
    p_log2_offset: cutlass.Constexpr[int] = CONST_P_LOG2
    dynamic_p: cutlass.Constexpr[bool] = False

    @staticmethod
    def create(scale_log2: Float32, rescale_threshold: cutlass.Constexpr[float] = 0.0,
               softmax_scale: Float32 | None = None, max_offset: cutlass.Constexpr[int] = 0,
               sSFP: cute.Tensor | None = None):
        """`SoftmaxSm100.create`'s arguments as FA4's softmax warps pass them, plus (dynamic P) `sSFP`, P's
        shared-memory scale buffer."""
        # FA4's rescale threshold (16-bit inputs) would keep a stale max: P would leave the recipe's grid
        assert rescale_threshold == 0.0, "the snapped max takes no rescale threshold"
        assert max_offset == FA4_FP8_P_LOG2, "FA4's FP8 P offset is 2^8"
        dynamic_p = sSFP is not None
        new = lambda: cute.make_rmem_tensor(1, Float32)  # noqa: E731
        words = None
        if dynamic_p:
            words = cute.make_tensor(cute.recast_ptr(sSFP.iterator, dtype=Int32), cute.make_layout(cute.cosize(
                sSFP.layout) // 4))
        p_log2_offset = 0 if dynamic_p else CONST_P_LOG2
        return MXSoftmaxSm100(scale_log2, 1, new(), new(), 100, softmax_scale, rescale_threshold=rescale_threshold,
                              max_offset=p_log2_offset, max_log2=new(), unrounded_sum=new(),
                              sSFP_words=words, p_log2_offset=p_log2_offset, dynamic_p=dynamic_p)

    def reset(self) -> None:
        super().reset()
        self.max_log2.fill(-Float32.inf)
        self.unrounded_sum.fill(0.0)

    @cute.jit
    def _update_snapped_max(self, tile_max: Float32, is_first: cutlass.Constexpr[bool]):
        """m' = max(m'_old, ceil(tile_max * scale_log2)); returns (m' or 0 when -inf, 2^(m'_old - m'))."""
        m_new = ceil_f32(tile_max * self.scale_log2)
        acc_scale = Float32(0.0)
        if const_expr(not is_first):
            m_new = cute.arch.fmax(m_new, self.max_log2[0])
        m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
        if const_expr(not is_first):
            acc_scale = exp2_int(self.max_log2[0] - m_safe)  # exact; 0 when m'_old = -inf
        self.max_log2[0] = m_new
        return m_safe, acc_scale

    @cute.jit
    def update_row_max(self, acc_S_row: cute.TensorSSA, is_first: cutlass.Constexpr[bool]):
        return self._update_snapped_max(self._compute_row_max(acc_S_row), is_first)

    @cute.jit
    def update_row_max_precomputed(self, hw_row_max: Float32, is_first: cutlass.Constexpr[bool]):
        return self._update_snapped_max(hw_row_max, is_first)

    @cute.jit
    def scale_subtract_rowmax(self, acc_S_row: cute.Tensor, row_max: Float32):
        """t - m' + p_log2_offset in place, t = s * scale_log2 (one FMA, as FA4); `row_max` is m' (log2 domain)."""
        bias = Float32(self.p_log2_offset) - row_max
        for i in cutlass.range(0, cute.size(acc_S_row.shape), 2, unroll_full=True):
            acc_S_row[i], acc_S_row[i + 1] = cute.arch.fma_packed_f32x2(
                (acc_S_row[i], acc_S_row[i + 1]), (self.scale_log2, self.scale_log2), (bias, bias))

    @cute.jit
    def apply_exp2_convert(self, acc_S_row: cute.Tensor, acc_S_row_converted: cute.Tensor,
                           ex2_emu_freq: cutlass.Constexpr[int] = 0, ex2_emu_res: cutlass.Constexpr[int] = 4,
                           ex2_emu_start_frg: cutlass.Constexpr[int] = 0):
        """const_p: FA4's exp2 and E4M3 conversion. dynamic: exp2, then per 32 keys the block's scale byte and
        payload; the row's scale word to shared memory (made visible to the MMA warp's tcgen05.cp before FA4's
        P-full arrive). Both: this step's sum of the rounded P."""
        words = cute.recast_tensor(acc_S_row_converted, Int32)  # the E4M3 P four to a 32-bit word
        if const_expr(not self.dynamic_p):
            SoftmaxSm100.apply_exp2_convert(self, acc_S_row, acc_S_row_converted, ex2_emu_freq=ex2_emu_freq,
                                            ex2_emu_res=ex2_emu_res, ex2_emu_start_frg=ex2_emu_start_frg)
            parts = [Float32(0.0)] * 4  # four running partial sums
            for i in cutlass.range_constexpr(cute.size(words)):
                parts[i % 4] = parts[i % 4] + e4m3x4_sum(words[i])
            rounded = (parts[0] + parts[1]) + (parts[2] + parts[3])
        else:
            n_blocks = const_expr(cute.size(acc_S_row) // MX_BLOCK)
            assert n_blocks == 4, "one 32-bit scale word per row: tile_n = 128"
            words_per_block = const_expr(MX_BLOCK // 4)
            frg = cute.logical_divide(acc_S_row, cute.make_layout(MX_BLOCK))
            frg_out = cute.logical_divide(acc_S_row_converted, cute.make_layout(MX_BLOCK))
            sf_word = Int32(0)
            block_sums = [Float32(0.0)] * n_blocks
            for j in cutlass.range_constexpr(n_blocks):
                for k in cutlass.range_constexpr(MX_BLOCK):
                    frg[k, j] = cute.math.exp2(frg[k, j], fastmath=True)
                block = frg[None, j].load()
                amax = utils.fmax_reduce(block, arch=100)  # p >= 0
                inv_scale, byte = rceil_scale(abs_bits_max(Int32(0), amax))
                frg_out[None, j].store((block * inv_scale).to(acc_S_row_converted.element_type))
                sf_word = sf_word | (byte << (8 * j))
                # the block's rounded sum: payload sum times 2^(byte - 127), exact
                payload_sum = Float32(0.0)
                for i in cutlass.range_constexpr(words_per_block):
                    payload_sum = payload_sum + e4m3x4_sum(words[j * words_per_block + i])
                block_sums[j] = payload_sum * e8m0_value(byte)
            rounded = (block_sums[0] + block_sums[1]) + (block_sums[2] + block_sums[3])
            # row r of this stage's 128: its 4 bytes at byte (r % 32) * 16 + (r // 32) * 4 of the 128x4 atom
            tidx = cute.arch.thread_idx()[0]
            row = tidx % 128
            stage = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
            self.sSFP_words[stage * (SF_TILE_BYTES // 4) + (row % 32) * 4 + row // 32] = sf_word
            cute.arch.fence_proxy("async.shared", space="cta")
        # this step's rounded sum, a trace-time value read by update_row_sum (same softmax step)
        self._tile_rounded_sum = rounded

    @cute.jit
    def update_row_sum(self, acc_S_row_exp: cute.TensorSSA, row_scale: Float32,
                       is_first: cutlass.Constexpr[bool] = False) -> None:
        """l and lq rescaled by 2^(m'_old - m') plus this tile's unrounded / rounded P; then FA4's row_sum, row_max
        slots as the class docstring says."""
        rounded = self._tile_rounded_sum
        if const_expr(is_first):
            l = self._compute_row_sum(acc_S_row_exp)
            lq = rounded
        else:
            l = self._compute_row_sum(acc_S_row_exp, init_val=self.unrounded_sum[0] * row_scale)
            lq = self.row_sum[0] * row_scale + rounded
        self.unrounded_sum[0] = l
        self.row_sum[0] = lq
        lse_max = -Float32.inf
        if lq > 0.0:
            lse_max = (self.max_log2[0] + (cute.math.log2(l, fastmath=True) - cute.math.log2(lq, fastmath=True))
                       + Float32(FA4_FP8_P_LOG2 - self.p_log2_offset)) * (1.0 / self.scale_log2)
        self.row_max[0] = lse_max


class _MXSoftmaxFactory:
    """Stands for `SoftmaxSm100` in this kernel's copy of FA4's `softmax_loop` (its only use there is `create`):
    builds `MXSoftmaxSm100` with the kernel's P quantization (and, for dynamic P, P's scale buffer)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def create(self, *args, **kwargs):
        sSFP = self.kernel._mx_dev["sSFP"] if self.kernel.p_quant == "dynamic" else None
        return MXSoftmaxSm100.create(*args, sSFP=sSFP, **kwargs)


def sf_stage_count(head_dim: int, q_stage: int, kv_stage_bytes: int, q_o_bytes: int, budget: int = 224 * 1024,
                   p_tiles: int = 1) -> int:
    """K/V pipeline stages that fit FA4's shared-memory budget with one scale tile per K/V stage, per Q stage and
    `p_tiles` for P (`_setup_attributes`: const_p's constant tile, or dynamic P's tile per Q stage)."""
    del head_dim
    fixed = q_o_bytes + (q_stage + p_tiles) * SF_TILE_BYTES
    return min((budget - fixed) // (kv_stage_bytes + SF_TILE_BYTES), 32)


# registers per thread of the MMA, load and epilogue warps (and idle warps) with one Q stage: FA4's FP8 D = 64
# choice (its D = 128 budget, 120, is what its two softmax warpgroups leave)
OTHER_REGS = 80


def softmax_regs(fa4_softmax: int, correction: int, other: int) -> int:
    """Registers per thread of the one softmax warpgroup with one Q stage: the rest of setmaxnreg's 512 per
    thread-of-a-warpgroup after the correction warpgroup and two warpgroups at `other` (FA4's idle second softmax
    warpgroup, and the MMA / load / epilogue one), a multiple of 8, at most 256, never below FA4's."""
    return max(fa4_softmax, min(256, (512 - correction - 2 * other) // 8 * 8))


class MXAttentionForwardSm100(FlashAttentionForwardSm100):
    """`FlashAttentionForwardSm100` (E4M3 Q, K, V; varlen; no GQA packing, split-KV, paging, 2-CTA or S ping-pong)
    with both GEMMs on block-scaled MXFP8 MMAs."""

    def __init__(self, head_dim: int, *, is_causal: bool, tile_m: int = 128, tile_n: int = 128, q_stage: int = 1,
                 p_quant: str = "const_p"):
        if p_quant not in ("const_p", "dynamic"):
            raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if tile_m != 128 or tile_n != 128:
            raise ValueError(f"tiles must be 128 x 128 (one scale tile per Q and K/V tile), got {tile_m} x {tile_n}")
        if q_stage not in (1, 2) or (head_dim == 128 and q_stage != 1):
            raise ValueError(f"q_stage must be 1 for D = 128 (tensor memory) and 1 or 2 for D = 64, got {q_stage}")
        super().__init__(head_dim, head_dim, 1, is_causal=is_causal, is_local=False, pack_gqa=False,
                         m_block_size=tile_m, n_block_size=tile_n, q_stage=q_stage, is_static_persistent=False,
                         is_varlen_q=True, use_2cta_instrs=False, use_s_ping_pong=False)
        self.p_quant = p_quant
        # P's scale tiles: const_p's constant one, or one per Q stage written by the softmax warps (dynamic)
        self.p_sf_stages = q_stage if p_quant == "dynamic" else 1
        # tensor-memory columns of the scale factors, after FA4's S, P, O
        self.tmem_sf_offset = self.tmem_total
        # FA4's softmax warps with the recipe's softmax state (FA4's `softmax_step` calls its methods): a copy of
        # FA4's `softmax_loop` per kernel, its `SoftmaxSm100.create` building `MXSoftmaxSm100` for this p_quant
        self.softmax_loop = types.MethodType(
            _jit_copy(FlashAttentionForwardSm100.softmax_loop, SoftmaxSm100=_MXSoftmaxFactory(self)), self)

    def _setup_attributes(self):
        super()._setup_attributes()
        q_o = self.q_stage * self.m_block_size * (self.head_dim_padded * self.q_dtype.width
                                                  + self.epi_head_dim_v * self.o_dtype.width) // 8
        kv = self.n_block_size * max(self.head_dim_padded, self.head_dim_v_padded) * self.k_dtype.width // 8
        self.kv_stage = min(self.kv_stage, sf_stage_count(self.head_dim_padded, self.q_stage, kv, q_o,
                                                          p_tiles=self.p_sf_stages))
        # FA4 runs (__call__, just before this) with registers per thread set for its usual two softmax
        # warpgroups; with one Q stage the second is idle at num_regs_other (`softmax1_warp_ids` become empty
        # warps), so the softmax warpgroup takes what the four warpgroups leave of the 512 (setmaxnreg's budget
        # with 512 threads), up to 256: the recipe's softmax keeps more live than FA4's (D = 64: 168 -> 256).
        if self.q_stage == 1:
            self.num_regs_other = min(self.num_regs_other, OTHER_REGS)
            self.num_regs_softmax = softmax_regs(self.num_regs_softmax, self.num_regs_correction,
                                                 self.num_regs_other)

    # ---------------------------------------------------------------------------------------------------------
    # host entry: the scale tensors ride along to the kernel
    # ---------------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: cutlass.Float32, mSFQ: cute.Tensor, mSFK: cute.Tensor, mSFV: cute.Tensor,
                 mSFTileQ: cute.Tensor, mSFTileK: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                 mCuTotalMBlocks: cute.Tensor | None = None, stream=None):
        """mSFQ, mSFK `[H, bytes/4]` Int32 views of the `hdim` blocked scales of Q, K; mSFV the same of V's `seq`
        scales; mSFTileQ, mSFTileK `[B+1]` int32: each sequence's first 128-row scale tile (scale_offsets / 128)."""
        self._mx_host_args = (mSFQ, mSFK, mSFV, mSFTileQ, mSFTileK)
        FlashAttentionForwardSm100.__call__(
            self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, None, None, None, None, None,
            None, None, None, AuxData(), None, None, None, None, mCuTotalMBlocks, None, None, None, stream)

    def kernel(self, *args):
        """FA4's `__call__` launches `self.kernel(...)`: launch this class's entry point with the scales added."""
        return self._mx_kernel(*self._mx_host_args, *args)

    @cute.kernel
    def _mx_kernel(self, mSFQ: cute.Tensor, mSFK: cute.Tensor, mSFV: cute.Tensor, mSFTileQ: cute.Tensor,
                   mSFTileK: cute.Tensor, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                   mPageTable, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2, softmax_scale,
                   window_size_left, window_size_right, learnable_sink, descale_tensors, blocksparse_tensors,
                   sQ_layout, sK_layout, tP_layout, sV_layout, sO_layout, gmem_tiled_copy_Q, gmem_tiled_copy_O,
                   tiled_mma_qk, tiled_mma_pv, tile_sched_params, num_splits, num_splits_dynamic_ptr,
                   tile_count_semaphore, virtual_batch_idx_ptr, num_nheads_in_l2_ptr, aux_data, fastdiv_mods,
                   head_divmod):
        # the scale buffers (shared memory), allocated at the kernel's top level for every warp
        mx = self._mx_mmas()
        smem = cutlass.utils.SmemAllocator()
        sSFQ = smem.allocate_tensor(cutlass.Float8E8M0FNU, mx["sfq_smem"], byte_alignment=128)
        sSFKV = smem.allocate_tensor(cutlass.Float8E8M0FNU, mx["sfkv_smem"], byte_alignment=128)
        sSFP = smem.allocate_tensor(cutlass.Float8E8M0FNU, mx["sfp_smem"], byte_alignment=128)
        self._mx_dev = dict(mSFQ=mSFQ, mSFK=mSFK, mSFV=mSFV, mSFTileQ=mSFTileQ, mSFTileK=mSFTileK, sSFQ=sSFQ,
                            sSFKV=sSFKV, sSFP=sSFP)
        _fa4_kernel_body(self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable,
                         tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2, softmax_scale,
                         window_size_left, window_size_right, learnable_sink, descale_tensors, blocksparse_tensors,
                         sQ_layout, sK_layout, tP_layout, sV_layout, sO_layout, gmem_tiled_copy_Q,
                         gmem_tiled_copy_O, tiled_mma_qk, tiled_mma_pv, tile_sched_params, num_splits,
                         num_splits_dynamic_ptr, tile_count_semaphore, virtual_batch_idx_ptr, num_nheads_in_l2_ptr,
                         aux_data, fastdiv_mods, head_divmod)

    # ---------------------------------------------------------------------------------------------------------
    # the block-scaled MMAs and their scale-factor layouts
    # ---------------------------------------------------------------------------------------------------------
    def _mx_mmas(self) -> dict:
        """Tiled MMAs (kind::mxf8f6f4, UE8M0, 32-element blocks) and the shared/tensor-memory layouts of their
        scale factors, one 512-byte atom per operand tile."""
        e4m3, e8m0, one = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU, tcgen05.CtaGroup.ONE
        mma_qk = sm100_utils_basic.make_blockscaled_trivial_tiled_mma(
            e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, e8m0, MX_BLOCK, one, self.mma_tiler_qk[:2])
        mma_pv = sm100_utils_basic.make_blockscaled_trivial_tiled_mma(
            e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.MN, e8m0, MX_BLOCK, one, self.mma_tiler_pv[:2],
            tcgen05.OperandSource.TMEM)
        return dict(
            mma_qk=mma_qk, mma_pv=mma_pv,
            sfq_smem=blockscaled_utils.make_smem_layout_sfa(mma_qk, self.mma_tiler_qk, MX_BLOCK, self.q_stage),
            sfkv_smem=blockscaled_utils.make_smem_layout_sfb(mma_qk, self.mma_tiler_qk, MX_BLOCK, self.kv_stage),
            sfv_smem=blockscaled_utils.make_smem_layout_sfb(mma_pv, self.mma_tiler_pv, MX_BLOCK, self.kv_stage),
            sfp_smem=blockscaled_utils.make_smem_layout_sfa(mma_pv, self.mma_tiler_pv, MX_BLOCK, self.p_sf_stages),
        )

    @cute.jit
    def _load_sf(self, mSF: cute.Tensor, head_idx: Int32, tile: Int32, sSF: cute.Tensor, stage: Int32,
                 stage_words: cutlass.Constexpr[int], cp):
        """One scale tile of head `head_idx`, tile `tile`, global -> shared memory stage `stage` by the MMA warp,
        then shared -> tensor memory (tcgen05.cp, ordered before the MMAs issued after it)."""
        words = cute.make_tensor(cute.recast_ptr(sSF.iterator, dtype=Int32) + stage * stage_words,
                                 cute.make_layout(SF_TILE_BYTES // 4))
        load_scale_tile(mSF, head_idx, tile, words, clamp=True)
        cp(stage)

    def _p_split_k(self) -> int:
        """The K block of O = P V before which the MMA waits for the second part of P (FA4's `split_P_arrive`:
        the softmax warps arrive twice per P), or -1."""
        return self.split_P_arrive // MX_BLOCK if self.split_P_arrive > 0 else -1

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tStS, tOtO, tOrP, pipeline_q, pipeline_kv,
            pipeline_s_p_o, pipeline_p_lastsplit, pipeline_o_acc, is_leader_cta, block_info, num_splits,
            SeqlenInfoCls, blocksparse_tensors, tile_scheduler=None):
        """FA4's MMA warp (`FlashAttentionForwardSm100.mma`, its schedule without S ping-pong: S0 = Q K0^T; then per
        K/V block O += P V(i), S = Q K(i+1)^T; O += P V(last)) with block-scaled MMAs and their scale copies."""
        d = self._mx_dev
        mx = self._mx_mmas()
        mma_qk, mma_pv = mx["mma_qk"], mx["mma_pv"]
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        tSrQ = thr_qk.make_fragment_A(sQ)
        tSrK = thr_qk.make_fragment_B(sK)
        tOrV = thr_pv.make_fragment_B(sV)
        # tensor memory: the scale factors after FA4's S / P / O columns (FA4's allocation starts at column 0)
        col = self.tmem_sf_offset
        tmem_layouts = dict(
            q=blockscaled_utils.make_tmem_layout_sfa(mma_qk, self.mma_tiler_qk, MX_BLOCK,
                                                     cute.slice_(mx["sfq_smem"], (None, None, None, 0))),
            k=blockscaled_utils.make_tmem_layout_sfb(mma_qk, self.mma_tiler_qk, MX_BLOCK,
                                                     cute.slice_(mx["sfkv_smem"], (None, None, None, 0))),
            p=blockscaled_utils.make_tmem_layout_sfa(mma_pv, self.mma_tiler_pv, MX_BLOCK,
                                                     cute.slice_(mx["sfp_smem"], (None, None, None, 0))),
            v=blockscaled_utils.make_tmem_layout_sfb(mma_pv, self.mma_tiler_pv, MX_BLOCK,
                                                     cute.slice_(mx["sfv_smem"], (None, None, None, 0))),
        )
        tmem_sf = {}
        for name in ("q0", "q1", "k", "p0", "p1", "v"):
            if const_expr((name != "q1" or self.q_stage == 2) and (name != "p1" or self.p_sf_stages == 2)):
                ptr = cute.recast_ptr(tStS.iterator + col, dtype=cutlass.Float8E8M0FNU)
                tmem_sf[name] = cute.make_tensor(ptr, tmem_layouts[name[0]])
                col += tcgen05.find_tmem_tensor_col_offset(tmem_sf[name])
        assert col <= self.tmem_alloc_cols, f"the scale factors need tensor-memory columns up to {col}"
        sSFQ, sSFKV, sSFP = d["sSFQ"], d["sSFKV"], d["sSFP"]
        sSFV = cute.make_tensor(sSFKV.iterator, mx["sfv_smem"])
        cp_q = [copy_utils.s2t_get_copy_fn(sSFQ, tmem_sf["q0"], tcgen05.CtaGroup.ONE)]
        if const_expr(self.q_stage == 2):
            cp_q.append(copy_utils.s2t_get_copy_fn(sSFQ, tmem_sf["q1"], tcgen05.CtaGroup.ONE))
        cp_k = copy_utils.s2t_get_copy_fn(sSFKV, tmem_sf["k"], tcgen05.CtaGroup.ONE)
        cp_v = copy_utils.s2t_get_copy_fn(sSFV, tmem_sf["v"], tcgen05.CtaGroup.ONE)
        cp_p = [copy_utils.s2t_get_copy_fn(sSFP, tmem_sf[f"p{stage}"], tcgen05.CtaGroup.ONE)
                for stage in range(self.p_sf_stages)]
        sfkv_stage_words = const_expr(cute.cosize(cute.slice_(mx["sfkv_smem"], (None, None, None, 0))) // 4)
        sfq_stage_words = const_expr(cute.cosize(cute.slice_(mx["sfq_smem"], (None, None, None, 0))) // 4)

        # const_p: P's scale factors are the constant byte, once for the kernel (dynamic: the softmax warps write
        # them to shared memory per K/V tile and they are copied below before each P.V)
        if const_expr(self.p_quant == "const_p"):
            sSFP_words = cute.make_tensor(cute.recast_ptr(sSFP.iterator, dtype=Int32), cute.make_layout(128))
            lane = cute.arch.lane_idx()
            p_word = Int32(P_SF_BYTE * 0x01010101)
            for j in cutlass.range_constexpr(4):
                sSFP_words[lane * 4 + j] = p_word
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            cp_p[0](0)

        mSFQ, mSFK, mSFV = d["mSFQ"], d["mSFK"], d["mSFV"]
        mSFTileQ, mSFTileK = d["mSFTileQ"], d["mSFTileK"]
        tSFQ = [tmem_sf["q0"]] + ([tmem_sf["q1"]] if const_expr(self.q_stage == 2) else [])
        tSFK, tSFV = tmem_sf["k"], tmem_sf["v"]
        tSFP = [tmem_sf[f"p{stage}"] for stage in range(self.p_sf_stages)]
        mbar_lastsplit = [pipeline_p_lastsplit.sync_object_full.get_barrier(stage) for stage in range(self.q_stage)]

        mma_q_consumer_phase = Int32(0)
        kv_state = cutlass.pipeline.make_pipeline_state(cutlass.pipeline.PipelineUserType.Consumer, self.kv_stage)
        P_full_O_rescaled_phase = Int32(0)
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, split_idx = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block, split_idx=split_idx,
                                                                      num_splits=num_splits)
            process_tile = self.process_work_tile(block_info, seqlen, n_block_min, n_block_max)
            # the first scale tiles of this Q tile and of this sequence's keys
            tile_q0 = mSFTileQ[batch_idx] + m_block * self.q_stage
            tile_k0 = mSFTileK[batch_idx]
            if process_tile and is_leader_cta:
                # S = Q K(n_max - 1)^T for each Q stage
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipeline_q.consumer_wait_w_index_phase(stage, mma_q_consumer_phase)
                    self._load_sf(mSFQ, head_idx, tile_q0 + stage, sSFQ, stage, sfq_stage_words, cp_q[stage])
                    if const_expr(stage == 0):
                        pipeline_kv.consumer_wait(kv_state)
                        self._load_sf(mSFK, head_idx, tile_k0 + n_block_max - 1, sSFKV, kv_state.index,
                                      sfkv_stage_words, cp_k)
                    block_scaled_gemm(mma_qk, tStS[None, None, None, stage], tSrQ[None, None, None, stage],
                                      tSrK[None, None, None, kv_state.index], tSFQ[stage], tSFK, False)
                    pipeline_s_p_o.producer_commit_w_index(stage)
                mma_q_consumer_phase ^= 1
                pipeline_kv.consumer_release(kv_state)
                kv_state.advance()
                O_should_accumulate = Boolean(False)
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    n_block = n_block_max - 1 - i
                    # O += P V(n_block)
                    pipeline_kv.consumer_wait(kv_state)
                    release_state = kv_state.clone()
                    v_index = kv_state.index
                    self._load_sf(mSFV, head_idx, tile_k0 + n_block, sSFKV, v_index, sfkv_stage_words, cp_v)
                    for stage in cutlass.range_constexpr(self.q_stage):
                        pipeline_s_p_o.producer_acquire_w_index_phase(stage, P_full_O_rescaled_phase)
                        if const_expr(self.p_quant == "dynamic"):
                            cp_p[stage](stage)  # P's scales, written with P (before the P-full arrive)
                        block_scaled_gemm(mma_pv, tOtO[None, None, None, stage], tOrP[None, None, None, stage],
                                          tOrV[None, None, None, v_index], tSFP[stage % self.p_sf_stages], tSFV,
                                          O_should_accumulate, self._p_split_k(), mbar_lastsplit[stage],
                                          P_full_O_rescaled_phase)
                        if const_expr(stage == self.q_stage - 1):
                            pipeline_kv.consumer_release(release_state)
                        # S = Q K(n_block - 1)^T
                        if const_expr(stage == 0):
                            kv_state.advance()
                            pipeline_kv.consumer_wait(kv_state)
                            self._load_sf(mSFK, head_idx, tile_k0 + n_block - 1, sSFKV, kv_state.index,
                                          sfkv_stage_words, cp_k)
                        block_scaled_gemm(mma_qk, tStS[None, None, None, stage], tSrQ[None, None, None, stage],
                                          tSrK[None, None, None, kv_state.index], tSFQ[stage], tSFK, False)
                        pipeline_s_p_o.producer_commit_w_index(stage)
                    pipeline_kv.consumer_release(kv_state)
                    kv_state.advance()
                    P_full_O_rescaled_phase ^= 1
                    O_should_accumulate = Boolean(True)
                for stage in cutlass.range(self.q_stage):
                    pipeline_q.consumer_release_w_index(stage)
                # O += P V(n_min)
                pipeline_kv.consumer_wait(kv_state)
                self._load_sf(mSFV, head_idx, tile_k0 + n_block_min, sSFKV, kv_state.index, sfkv_stage_words, cp_v)
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipeline_s_p_o.producer_acquire_w_index_phase(stage, P_full_O_rescaled_phase)
                    if const_expr(self.p_quant == "dynamic"):
                        cp_p[stage](stage)
                    block_scaled_gemm(mma_pv, tOtO[None, None, None, stage], tOrP[None, None, None, stage],
                                      tOrV[None, None, None, kv_state.index], tSFP[stage % self.p_sf_stages], tSFV,
                                      O_should_accumulate, self._p_split_k(), mbar_lastsplit[stage],
                                      P_full_O_rescaled_phase)
                    pipeline_o_acc.producer_commit_w_index(stage)
                P_full_O_rescaled_phase ^= 1
                pipeline_kv.consumer_release(kv_state)
                kv_state.advance()
            work_tile = tile_scheduler.advance_to_next_work()
