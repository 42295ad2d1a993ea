"""MXFP8 jagged attention backward on sm_100a: FlashAttention-4's Blackwell backward on block-scaled tcgen05.mma.

Operands are the MXFP8 tensors themselves: Q, K, dO E4M3 payloads `[T, H, D]` quantized in `square` 32x32 blocks,
V in `hdim` blocks, each square operand with TWO blocked scale tensors holding the same values (docs/jagged.md,
`gem_lp.jagged.quantize_jagged`): the `hdim`-shaped one (row = token, column = 32-feature block) for the products
that reduce over D, and the `seq`-shaped one (row = feature, column = 32-token block) for the products that reduce
over tokens. The payload bytes serve both orientations (FA4 already reads Q, K, dO from one shared-memory buffer
K-major for one MMA and MN-major for the other; 8-bit operands may be MN-major on tcgen05).

FA4's `FlashAttentionBackwardSm100` (1-CTA, one 128-key tile per CTA, 128-query steps) is kept with these changes:

* All five GEMMs are `tcgen05.mma.kind::mxf8f6f4.block_scale` (`MmaMXF8Op`, UE8M0, 32-element blocks), issued by
  this class's `mma` (FA4's 1-CTA schedule, written again with the scale copies; FA4's aliased P / dS layout):
  S^T = K Q^T (SFA K `hdim`, SFB Q `hdim`), dP^T = V dO^T (V `hdim`, dO `hdim`), dV += P^T dO (P's scales, dO
  `seq`; A = P from tensor memory, B = dO MN-major), dK += dS^T Q (dS's key-major scales, Q `seq`; A = dS^T from
  tensor memory, B = Q MN-major), dQ = dS K (dS's query-major scales, K `seq`; A = dS MN-major from shared memory,
  B = K MN-major). Every scale operand of one 128-token tile is one 512-byte 128x4 tile of the blocked layout:
  the MMA warp copies it global -> shared memory (its 32 lanes, 16 bytes each) and `tcgen05.cp` -> tensor memory
  (as `fwd_sm100`). K's, V's and K `seq` tiles once per CTA; Q's and dO's (both layouts) per query step (at D =
  128 every tile is copied on to tensor memory again before each MMA that reads it: below).
* P (recomputed from S and the LSE, FP32, unchanged FA4 code) goes to tensor memory as E4M3 (4 to a column):
  `const_p` e4m3(256 p) with the constant scale byte 119 (2^-8, written once); `dynamic` per 32x32 block the rceil
  byte of the block max. dS = P (dP - Δ) from the unrounded P (FA4's code), then per 32x32 block its max-abs, the
  rceil byte and the E4M3 payload, to tensor memory (dK) and shared memory (dQ) as FA4 stores its 16-bit dS; the
  byte goes to two 128x4 scale tiles: key-major (row = key, column = query block: SFA of dK) and query-major
  (row = query, column = key block: SFA of dQ). In FA4's compute warps each thread holds one key row of S^T / dP^T
  and per `stage` 32 consecutive query columns (tcgen05.ld 32x32b x32; warpgroup g holds query block 2 * stage + g),
  so a 32x32 block is one warp's 32 lanes x one stage: a block max is 32 register maxima and 5 shuffles.
  These steps run in a copy of FA4's `compute_loop` (`_jit_copy`) whose `utils.cvt_f16` (FA4's 16-bit conversion of
  P and dS, the only place they are rounded) is `_MXRounding.cvt_f16`, and whose tensor-memory store atom carries
  8 columns per stage instead of FA4's 16 (8-bit P / dS: 32 values are 8 columns).
* Tensor memory (512 columns), D = 64: S^T 0-127 (P's E4M3 in 0-31), dV 128-191, dP^T 192-319 (dS 192-223, dQ
  192-255), dK 320-383, the ten scale tiles (4 columns each) from 384. FA4's D = 64 "split P / dS" layout (P and dS
  in columns of their own, a P pipeline) is replaced by its aliased one: its dedicated columns are where the scales
  go. The MMA warp runs FA4's 1-CTA schedule (prologue S^T(0), dP^T(0), dV(0); per step t+1: S^T(t+1), dK(t),
  dQ(t), dP^T(t+1), dV(t+1); tail dK, dQ), K's, V's and K `seq` scale tiles copied to tensor memory once per CTA.
* D = 128: FA4's aliased plan takes all 512 columns: S^T 0-127 (E4M3 P 0-31), dV 128-255, dP^T 256-383 (E4M3 dS
  256-287, dQ 256-383), dK 384-511. The scale tiles go to columns of S^T and dP^T while these hold nothing live,
  and the MMA warp issues the GEMMs in an order where that holds (`_mma_serial`): per query step t, once the compute
  warps signal P(t) ready (FA4's S-consumed barrier): dP^T(t) = V dO^T, dV(t) += P^T dO; once dS(t) is ready:
  dK(t), dQ(t); once the dQ reduce warps have read dQ(t) into registers (FA4's dQ-empty barrier): S^T(t+1). The
  scale tiles of the dP^T, dV, dK and dQ MMAs (V, dO `hdim`, P, dO `seq`, dS^T, Q `seq`, dS, K `seq`) are in S^T's
  columns 32-63, past P: after P(t) is ready nothing reads S^T but the dV MMA (P, columns 0-31), and the next
  write there is S^T(t+1), issued after those MMAs by the same thread. The S^T MMA's (K, Q `hdim`) are in dP^T's
  columns 288-295, past dS: after dQ(t) has been read nothing is live in dP^T / dQ until dP^T(t+1), issued after
  S^T(t+1). Each scale tile is copied (tcgen05.cp, from its shared-memory tile) right before each MMA that reads
  it, K's, V's and K `seq` too (their shared tiles are written once per CTA). What this costs: FA4 issues
  S^T(t+1) before dK(t) / dQ(t) and dP^T(t) right after S^T(t), so the tensor cores work while the compute warps
  compute P and dS; here each MMA waits for the compute (or dQ reduce) step before it, and the compute warps wait
  for S^T(t+1) (behind dK(t), dQ(t) and the dQ read) and for dP^T(t) (behind P(t)): the step is serial. Other
  plans need FA4 changes beyond the MMA warp: 64-query steps (S^T, dP^T 64 columns) need the dQ MMA at M = 64,
  which block-scaled tcgen05.mma does not have with one CTA (M = 128 only), or dQ^T = K^T dS^T with a transposed
  dQ reduce; dQ in two 64-feature halves needs two dQ handshakes per step in FA4's reduce warps.
* The rest is FA4's: load warp (TMA of the E4M3 payloads, LSE, Δ), dQ reduce warps (FP32 dQ accumulator to global,
  FA4's postprocess converts), dK / dV epilogues (BF16; dK times the softmax scale), preprocess (Δ = rowsum(dO O)).
* One shared-memory and one tensor-memory tile per scale operand, no stages. A shared tile is rewritten only after
  the tcgen05.commit that follows its last copy has been observed: the MMA warp rewrites Q's / dO's tiles after the
  compute warps' S-consumed / dS-ready / P-ready signals (at D = 128 Q's `hdim` tile after the dQ reduce warps'
  dQ-read signal), which come after commits issued after the copies; the compute warps rewrite P's / dS's tiles
  after waiting for the next S / dP, committed after the copies. A tensor tile is rewritten by tcgen05.cp issued
  after the MMAs that read it (same thread, issue order).
* Registers, D = 64: the MMA warp 112 per thread (FA4: 88, the load warp's): it also holds the scale tiles'
  addresses and copy descriptors, and at 88 or 96 ptxas kept FA4's warp index in local memory (8 bytes of stack) in
  some builds. The dQ reduce warps give up the difference (128 non-causal, 112 causal; they hold 64 FP32 of dQ a
  thread at D = 64), so reduce + 2 compute + max(MMA, load) stays at the 512 FA4's assert keeps for the warps that
  share a sub-partition (asserted; ptxas: no local memory). FA4's fourth warpgroup already runs different
  setmaxnreg values per warp (MMA and load 88, relay and empty 24), which the PTX ISA's rule (one setmaxnreg for all
  warps of a warpgroup) does not describe; this adds a third value there. D = 128: dQ reduce 152, compute 136, MMA
  and load 88 (FA4's non-causal budget, for causal too), 152 + 2 x 136 + 88 = 512 as FA4's assert wants: the
  reduce warps hold the whole 128-feature dQ row (at FA4's causal 136 they spilled); the compute warps fit 136 here. With these ptxas
  still kept one warp index in local memory through the compute warps' role (8 bytes of stack): the value FA4's
  kernel body reads once and compares in every role's `if`, and the one the dQ reduce warps read, which LLVM merged
  into one value read at the kernel's entry. At D = 128 the body and `dQacc_reduce` run with `cute.arch` bound so
  that each of these reads is a volatile `%tid.x` read where it is used (`_WarpIdxAtEachUse`, `_warp_idx_here`).

What is compiled and checked (on a machine without a GPU, `python -m gem_lp.compile_check --arch sm_100a`): the
kernel builds for sm_100a at D = 64 and D = 128, causal and not, const_p and dynamic, few and many sequences; its
PTX holds only `tcgen05.mma.kind::mxf8f6f4.block_scale` MMAs, one per 32-wide K block of each GEMM in each of its
two issue sites: 32 at D = 64 (S^T, dP^T 2 K blocks each, dV, dK, dQ 4 each), 40 at D = 128 (all 4); P / dS go
out by `tcgen05.st.32x32b.x8`, the scale tiles by `tcgen05.cp`. ptxas (CUDA 13.0, the PTX's `.version` lowered
from 9.4 to 9.0 since no newer ptxas is installed) reports 128 registers per thread at launch, no stack and no
spills for all sixteen builds. Tensor-memory addresses in the PTX were read back. D = 64: D of S^T 0, dV 128, dP^T
and dQ 192, dK 320; A of dV (P) column 0, of dK (dS) column 192, 8 columns per 32-wide K block; the scale tiles at
384-420, 4 columns each. D = 128: D of S^T 0, dV 128, dP^T and dQ 256, dK 384; A of dV columns 0-24, of dK
256-280; SFA / SFB of S^T 288 / 292, dP^T 32 / 36, dV 40 / 44, dK 48 / 52, dQ 56 / 60, each copied just before
its MMA. UNVERIFIED: never run, no Blackwell GPU. In particular unverified on hardware: at D = 64 the ordering
this relies on between a scale tile's tcgen05.cp into tensor memory and the earlier MMA of the same thread still
reading the previous tile there (tcgen05.cp and tcgen05.mma of one thread execute in issue order, as `fwd_sm100`
also relies on); at D = 128 each copy into S^T / dP^T columns comes after the MMA warp has observed (P-ready,
dS-ready or dQ-read barrier, each behind a tcgen05.commit) the completion of every earlier MMA that wrote or read
those columns (only dV(t), using other columns, may still run at dK(t)'s copies), so what it relies on without a
commit is an MMA (S^T(t+1), dP^T(t+1)) overwriting scale columns that MMAs issued just before it read, the
MMA-after-MMA order FA4's aliased layout relies on for S^T(t+1) over P(t); that FA4's store of dS through
its epilogue-layout view of the dQ MMA's A buffer lands where the MN-major 8-bit dQ MMA reads it (the two layouts
were compared: same swizzle S<3,4,3>, same key-row / query-column offsets); the numerics against
`gem_lp.attention.reference`; D = 128's serial schedule's speed. Left: the scale tiles go global -> registers ->
shared memory in the MMA warp, on the MMA issue path (a TMA load in the load warp is the next step); D = 128
without the serial schedule (above); dK / dV as MXFP8 outputs; no sm_100 producer of the operands (payloads with
both scale layouts) in the public API.
"""
from __future__ import annotations

import types

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils_basic
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa4_utils
from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100
from quack import copy_utils

from gem_lp.attention.cute.fwd_sm100 import _jit_copy
from gem_lp.attention.cute.mx_device import abs_bits_max, fmax_bits, rceil_scale
from gem_lp.attention.cute.sm100_mma import SF_TILE_BYTES, block_scaled_gemm, load_scale_tile

MX_BLOCK = 32
HEAD_DIMS = (64, 128)
# const_p: P's payload is e4m3(256 p) and its scale 2^-8, the E8M0 byte 127 - 8
CONST_P_LOG2 = 8
P_SF_BYTE = 127 - CONST_P_LOG2
# the scale tiles: (name, MMA, operand). K, V and K `seq` are per CTA; Q, dO per query step; P, dS^T, dS are
# written by the compute warps (P only for dynamic; const_p's is written once).
SF_TILES = (("Kh", "S", "a"), ("Qh", "S", "b"), ("Vh", "dP", "a"), ("dOh", "dP", "b"), ("P", "dV", "a"),
            ("dOs", "dV", "b"), ("dSt", "dK", "a"), ("Qs", "dK", "b"), ("dS", "dQ", "a"), ("Ks", "dQ", "b"))
# tensor-memory columns of one 128x4 scale tile (32 lanes x 16 bytes, copied to all four lane quarters)
SF_TILE_COLS = 4
# registers per thread of the MMA warp (FA4: 88, the load warp's)
MMA_WARP_REGS = 112
# D = 128: registers per thread of the dQ reduce, compute and MMA (and load) warps
D128_REGS = (152, 136, 88)
# the global scale tensors the MMA warp reads, by tile name
SF_GLOBAL = ("Qh", "Qs", "Kh", "Ks", "Vh", "dOh", "dOs")


class _MXRounding:
    """Stands for FA4's `utils` module in this kernel's copy of `compute_loop`: `cvt_f16` (FA4's FP32 -> 16-bit
    conversion, called once per stage for P and then once per stage for dS) rounds to the recipe's MXFP8 instead;
    every other name is FA4's. The calls are told apart by their order at trace time (P's stages, then dS's)."""

    def __init__(self, kernel):
        self._kernel = kernel
        self._calls = 0

    def __getattr__(self, name):
        return getattr(fa4_utils, name)

    def cvt_f16(self, src, dst):
        stages = self._kernel.cvt_stages
        i = self._calls
        self._calls += 1
        stage, is_ds = i % stages, (i // stages) % 2 == 1
        assert cute.size(src) == cute.size(dst) == MX_BLOCK, "one 32-value stage (one 32x32 block row) per call"
        if is_ds:
            return self._kernel._round_ds(src, dst, stage)
        return self._kernel._round_p(src, dst, stage)


class _Copy8bit:
    """`tcgen05.copy` for the copy of `compute_loop`: its store of P / dS to tensor memory moves 8-bit values, 4 to
    a column, so one stage (32 values) is 8 columns where FA4's 16-bit one is 16."""

    def __getattr__(self, name):
        return getattr(tcgen05.copy, name)

    @staticmethod
    def St32x32bOp(repetition, *args, **kwargs):
        return tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(repetition.value // 2), *args, **kwargs)


class _Tcgen05_8bit:
    copy = _Copy8bit()

    def __getattr__(self, name):
        return getattr(tcgen05, name)


class _ExtraSmemLaunch:
    """FA4's backward launches with `smem=` its shared-storage size: add the scale tiles allocated before it."""

    def __init__(self, launcher, extra_bytes: int):
        self._launcher = launcher
        self._extra = extra_bytes

    def launch(self, *args, smem: int = 0, **kwargs):
        return self._launcher.launch(*args, smem=smem + self._extra, **kwargs)


@dsl_user_op
def _warp_idx_here(*, loc=None, ip=None) -> Int32:
    """The warp index from a `%tid.x` read that the compiler may not merge with another (a volatile asm): a value
    computed where it is compared, never held across a warp role."""
    warp = Int32(llvm.inline_asm(T.i32(), [], "{\n\tmov.u32 $0, %tid.x;\n\tshr.b32 $0, $0, 5;\n\t}", "=r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))
    return cute.arch.make_warp_uniform(warp, loc=loc, ip=ip)


class _WarpIdxAtEachUse:
    """FA4's kernel body reads the warp index once and compares it in each warp role's `if`; this stands for that
    value and reads it again at each comparison, so it is not live through the roles (at D = 128 ptxas kept the
    one value in local memory across the compute warps' role: 8 bytes of stack)."""

    def __eq__(self, other):
        return _warp_idx_here() == other

    def __ne__(self, other):
        return _warp_idx_here() != other

    def __ge__(self, other):
        return _warp_idx_here() >= other

    def __le__(self, other):
        return _warp_idx_here() <= other

    def __gt__(self, other):
        return _warp_idx_here() > other

    def __lt__(self, other):
        return _warp_idx_here() < other

    __hash__ = None


class _ArchWarpIdxAtEachUse:
    """`cute.arch` for the kernel body: `make_warp_uniform(warp_idx())` gives `_WarpIdxAtEachUse`."""

    _marker = object()

    def __getattr__(self, name):
        return getattr(cute.arch, name)

    def warp_idx(self, **kwargs):
        return self._marker

    def make_warp_uniform(self, value, **kwargs):
        if value is self._marker:
            return _WarpIdxAtEachUse()
        return cute.arch.make_warp_uniform(value, **kwargs)


class _CuteWarpIdxAtEachUse:
    arch = _ArchWarpIdxAtEachUse()

    def __getattr__(self, name):
        return getattr(cute, name)


class _ArchWarpIdxHere:
    """`cute.arch` whose `warp_idx()` is `_warp_idx_here()`."""

    def __getattr__(self, name):
        return getattr(cute.arch, name)

    @staticmethod
    def warp_idx(**kwargs):
        return _warp_idx_here()


class _CuteWarpIdxHere:
    arch = _ArchWarpIdxHere()

    def __getattr__(self, name):
        return getattr(cute, name)


_fa4_bwd_kernel_body = _jit_copy(FlashAttentionBackwardSm100.kernel)
# D = 128: the same body with the warp index read at each role's comparison
_fa4_bwd_kernel_body_fresh_warp_idx = _jit_copy(FlashAttentionBackwardSm100.kernel, cute=_CuteWarpIdxAtEachUse())


class MXAttentionBackwardSm100(FlashAttentionBackwardSm100):
    """`FlashAttentionBackwardSm100` (1-CTA, varlen, MHA; no score/mask mods, block sparsity, 2-CTA) with E4M3
    Q, K, V, dO and all five GEMMs on block-scaled MXFP8 MMAs (module docstring)."""

    def __init__(self, head_dim: int, *, is_causal: bool, p_quant: str = "const_p", tile_m: int = 128,
                 tile_n: int = 128):
        if p_quant not in ("const_p", "dynamic"):
            raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if tile_m != 128 or tile_n != 128:
            raise ValueError(f"tiles must be 128 x 128 (one scale tile per query and key tile), got {tile_m} x "
                             f"{tile_n}")
        super().__init__(head_dim, head_dim, is_causal=is_causal, tile_m=tile_m, tile_n=tile_n)
        self.p_quant = p_quant
        if head_dim == 64:
            # the MMA warp keeps the scale tiles' copy descriptors and addresses too: at FA4's 88 registers the
            # kernel spilled. The reduce warps give it theirs (at D = 64 they hold 64 FP32 of dQ a thread, not 128),
            # so that each sub-partition's warps (one reduce, two compute and one of the fourth warpgroup) stay
            # within FA4's 512 registers a thread
            self.num_regs_mma = MMA_WARP_REGS
            self.num_regs_reduce = 512 - 2 * self.num_regs_compute - self.num_regs_mma
        else:
            # D = 128 (dQ reduce warps hold 128 FP32 per thread): FA4's non-causal budget for causal too, within
            # FA4's own assert (reduce + 2 compute + max(load, MMA) = 512); at FA4's causal one (reduce 136) the
            # reduce warps spilled
            self.num_regs_reduce, self.num_regs_compute, self.num_regs_mma = D128_REGS
            self.num_regs_load = self.num_regs_mma
        assert self.num_regs_reduce + 2 * self.num_regs_compute + max(self.num_regs_mma, self.num_regs_load) <= 512
        pool = (len(self.reduce_warp_ids) * self.num_regs_reduce + len(self.compute_warp_ids) * self.num_regs_compute
                + self.num_regs_mma + self.num_regs_load + 2 * self.num_regs_empty)
        assert pool <= 65536 // cute.arch.WARP_SIZE, f"registers: {pool} per-thread units over the 64K pool"
        # FA4's aliased P / dS layout (P over S, dS over dP); 8-bit P and dS take a quarter of S's / dP's columns
        self.split_P_dS = False
        self.tmem_P_offset = self.tmem_S_offset
        self.tmem_dS_offset = self.tmem_dP_offset
        self.tmem_cols_P = self.tmem_cols_S // 4
        self.tmem_cols_dS = self.tmem_cols_dP // 4
        acc_end = max(self.tmem_S_offset + self.tmem_cols_S, self.tmem_dV_offset + self.tmem_cols_dV,
                      self.tmem_dP_offset + self.tmem_cols_dP, self.tmem_dK_offset + self.tmem_cols_dK)
        # the scale tiles' tensor-memory columns (4 each). D = 64: columns of their own after the accumulators. D =
        # 128 (the accumulators take all 512): columns of S^T and dP^T while those hold nothing live (module
        # docstring), with the MMA warp's serial schedule: K's and Q's `hdim` tiles (the S^T MMA) in dP^T past the
        # 8-bit dS, the other eight in S^T past the 8-bit P.
        self.sf_serial = acc_end + len(SF_TILES) * SF_TILE_COLS > self.tmem_alloc_cols
        if self.sf_serial:
            in_dP = ("Kh", "Qh")
            in_S = [name for name, _, _ in SF_TILES if name not in in_dP]
            self.tmem_sf_cols = {name: self.tmem_dP_offset + self.tmem_cols_dS + SF_TILE_COLS * i
                                 for i, name in enumerate(in_dP)}
            self.tmem_sf_cols.update({name: self.tmem_S_offset + self.tmem_cols_P + SF_TILE_COLS * i
                                      for i, name in enumerate(in_S)})
            assert self.tmem_dP_offset + self.tmem_cols_dS + SF_TILE_COLS * len(in_dP) <= (
                self.tmem_dP_offset + self.tmem_cols_dP)
            assert self.tmem_S_offset + self.tmem_cols_P + SF_TILE_COLS * len(in_S) <= (
                self.tmem_S_offset + self.tmem_cols_S)
        else:
            self.tmem_sf_cols = {name: acc_end + SF_TILE_COLS * i for i, (name, _, _) in enumerate(SF_TILES)}
        self.tmem_sf_offset = min(self.tmem_sf_cols.values())
        # FA4's compute loop converts P and dS in stages of 32 query columns per thread, 2 warpgroups
        self.cvt_stages = tile_m // (2 * MX_BLOCK)
        self._kernel_body = _fa4_bwd_kernel_body_fresh_warp_idx if self.sf_serial else _fa4_bwd_kernel_body
        if self.sf_serial:
            self.dQacc_reduce = types.MethodType(
                _jit_copy(FlashAttentionBackwardSm100.dQacc_reduce, cute=_CuteWarpIdxHere()), self)
        self.compute_loop = types.MethodType(
            _jit_copy(FlashAttentionBackwardSm100.compute_loop, utils=_MXRounding(self), tcgen05=_Tcgen05_8bit()),
            self)

    # ---------------------------------------------------------------------------------------------------------
    # the block-scaled MMAs and their scale-factor layouts
    # ---------------------------------------------------------------------------------------------------------
    def _get_tiled_mma(self):
        """FA4's five tiled MMAs (same operand majorness and sources) as kind::mxf8f6f4 block-scaled ones."""
        e4m3, e8m0, one = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU, tcgen05.CtaGroup.ONE
        K, MN, TMEM = OperandMajorMode.K, OperandMajorMode.MN, tcgen05.OperandSource.TMEM

        def mma(a_major, b_major, tiler, *src):
            return sm100_utils_basic.make_blockscaled_trivial_tiled_mma(e4m3, e4m3, a_major, b_major, e8m0, MX_BLOCK,
                                                                        one, tiler[:2], *src)

        mma_S = mma(K, K, self.mma_tiler_kq)  # S^T = K Q^T
        mma_dP = mma(K, K, self.mma_tiler_vdo)  # dP^T = V dO^T
        mma_dK = mma(K, MN, self.mma_tiler_dsq, TMEM)  # dK += dS^T Q, dS^T from tensor memory
        mma_dV = mma(K, MN, self.mma_tiler_pdo, TMEM)  # dV += P^T dO, P^T from tensor memory
        mma_dQ = mma(MN, MN, self.mma_tiler_dsk)  # dQ = dS K
        return mma_S, mma_dP, mma_dK, mma_dV, mma_dQ

    def _sf_layouts(self) -> dict:
        """Per scale tile: (its MMA, shared-memory layout (one stage), tensor-memory layout)."""
        mmas = dict(S=(self.tiled_mma_S, self.mma_tiler_kq), dP=(self.tiled_mma_dP, self.mma_tiler_vdo),
                    dV=(self.tiled_mma_dV, self.mma_tiler_pdo), dK=(self.tiled_mma_dK, self.mma_tiler_dsq),
                    dQ=(self.tiled_mma_dQ, self.mma_tiler_dsk))
        out = {}
        for name, which, operand in SF_TILES:
            mma, tiler = mmas[which]
            if operand == "a":
                smem = blockscaled_utils.make_smem_layout_sfa(mma, tiler, MX_BLOCK, 1)
                tmem = blockscaled_utils.make_tmem_layout_sfa(mma, tiler, MX_BLOCK,
                                                              cute.slice_(smem, (None, None, None, 0)))
            else:
                smem = blockscaled_utils.make_smem_layout_sfb(mma, tiler, MX_BLOCK, 1)
                tmem = blockscaled_utils.make_tmem_layout_sfb(mma, tiler, MX_BLOCK,
                                                              cute.slice_(smem, (None, None, None, 0)))
            assert cute.cosize(smem) == SF_TILE_BYTES, f"scale tile {name}: {cute.cosize(smem)} bytes, not 512"
            out[name] = (smem, tmem)
        return out

    # ---------------------------------------------------------------------------------------------------------
    # host entry: the scale tensors ride along to the kernel
    # ---------------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 softmax_scale: Float32, mSFQh: cute.Tensor, mSFQs: cute.Tensor, mSFKh: cute.Tensor,
                 mSFKs: cute.Tensor, mSFVh: cute.Tensor, mSFdOh: cute.Tensor, mSFdOs: cute.Tensor,
                 mSFTileQ: cute.Tensor, mSFTileK: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                 mCuTotalMBlocks: cute.Tensor | None = None, stream=None):
        """mSF*: `[H, bytes/4]` Int32 views of the blocked scales (`h` the `hdim`-shaped, `s` the `seq`-shaped
        tensor of a square operand); mSFTileQ, mSFTileK `[B+1]` int32: each sequence's first 128-row scale tile."""
        self._mx_host_args = (mSFQh, mSFQs, mSFKh, mSFKs, mSFVh, mSFdOh, mSFdOs, mSFTileQ, mSFTileK)
        FlashAttentionBackwardSm100.__call__(
            self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
            None, None, None, None, None, None, None, fa4_utils.AuxData(), None, mCuTotalMBlocks, stream)

    def kernel(self, *args):
        """FA4's `__call__` launches `self.kernel(...)`: this class's entry point with the scales added, launched
        with their shared memory added to FA4's."""
        # the tiles, and the padding FA4's storage (1024-byte aligned buffers) may need after them
        extra = len(SF_TILES) * SF_TILE_BYTES + 1024
        return _ExtraSmemLaunch(self._mx_kernel(*self._mx_host_args, *args), extra)

    @cute.kernel
    def _mx_kernel(self, mSFQh: cute.Tensor, mSFQs: cute.Tensor, mSFKh: cute.Tensor, mSFKs: cute.Tensor,
                   mSFVh: cute.Tensor, mSFdOh: cute.Tensor, mSFdOs: cute.Tensor, mSFTileQ: cute.Tensor,
                   mSFTileK: cute.Tensor, mQ, mQt, mK, mKt, mV, mLSE, mdPsum, mdO, mdOt, mdV, mdK, mdQaccum,
                   mdV_tma_tensor, mdK_tma_tensor, mdQ_semaphore, mdK_semaphore, mdV_semaphore, mCuSeqlensQ,
             mCuSeqlensK, mSeqUsedQ, mSeqUsedK, tma_atom_Q, tma_atom_Qt, tma_atom_K, tma_atom_Kt, tma_atom_V,
             tma_atom_dO, tma_atom_dOt, tma_atom_dV, tma_atom_dK, sQ_layout, sQt_layout, sK_layout,
             sKt_layout, sV_layout, sLSE_layout, sdPsum_layout, sdO_layout, sdOt_layout, sdSt_layout,
             sdS_layout, sdS_xchg_layout, sdQaccum_layout, sdK_layout, sdV_layout, tP_layout, tdS_layout,
             tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tiled_copy_r2s_dKV,
             softmax_scale, softmax_scale_log2, window_size_left, window_size_right, tile_sched_params,
             aux_data, fastdiv_mods, blocksparse_tensors):
        # the scale tiles (shared memory), allocated at the kernel's top level for every warp
        smem = cutlass.utils.SmemAllocator()
        sSF = {name: smem.allocate_tensor(cutlass.Float8E8M0FNU, layouts[0], byte_alignment=128)
               for name, layouts in self._sf_layouts().items()}
        self._mx_dev = dict(sSF=sSF, tile_q=mSFTileQ, tile_k=mSFTileK,
                            mSF=dict(zip(SF_GLOBAL, (mSFQh, mSFQs, mSFKh, mSFKs, mSFVh, mSFdOh, mSFdOs))))
        body = self._kernel_body
        body(self, mQ, mQt, mK, mKt, mV, mLSE, mdPsum, mdO, mdOt, mdV, mdK, mdQaccum,
             mdV_tma_tensor, mdK_tma_tensor, mdQ_semaphore, mdK_semaphore, mdV_semaphore,
             mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, tma_atom_Q, tma_atom_Qt, tma_atom_K,
             tma_atom_Kt, tma_atom_V, tma_atom_dO, tma_atom_dOt, tma_atom_dV, tma_atom_dK,
             sQ_layout, sQt_layout, sK_layout, sKt_layout, sV_layout, sLSE_layout, sdPsum_layout,
             sdO_layout, sdOt_layout, sdSt_layout, sdS_layout, sdS_xchg_layout, sdQaccum_layout,
             sdK_layout, sdV_layout, tP_layout, tdS_layout, tiled_mma_S, tiled_mma_dP,
             tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tiled_copy_r2s_dKV, softmax_scale,
             softmax_scale_log2, window_size_left, window_size_right, tile_sched_params, aux_data,
             fastdiv_mods, blocksparse_tensors)

    # ---------------------------------------------------------------------------------------------------------
    # compute warps: P and dS on the recipe's grids (called from the copy of FA4's compute_loop)
    # ---------------------------------------------------------------------------------------------------------
    @cute.jit
    def _block_position(self, stage: cutlass.Constexpr[int]):
        """(lane, key block, query block) of this thread's 32 values of `stage`: key row 32 * (warp % 4) + lane,
        queries 32 * (2 * stage + warpgroup) + [0, 32) (warpgroup 1 = warps 4-7). All from the thread index (kept
        out of long-lived registers: the warp index held across the loop was spilled)."""
        tidx = cute.arch.thread_idx()[0]
        return tidx % 32, (tidx // 32) % 4, 2 * stage + (tidx % 256) // 128

    @cute.jit
    def _block_amax_bits(self, src: cute.Tensor) -> Int32:
        """max |x| bits over the 32x32 block: this thread's 32 values, then the warp's 32 key rows."""
        m = Int32(0)
        for i in cutlass.range_constexpr(cute.size(src)):
            m = abs_bits_max(m, src[i])
        for s in cutlass.range_constexpr(5):
            m = fmax_bits(m, cute.arch.shuffle_sync_bfly(m, offset=1 << s))
        return m

    @cute.jit
    def _put_sf(self, name: cutlass.Constexpr[str], row_in_block: Int32, row_block: Int32, col: Int32,
                byte: Int32):
        """Scale byte of row 32 * row_block + row_in_block, column `col` of the 128x4 tile `name`."""
        tile = self._mx_dev["sSF"][name]
        view = cute.make_tensor(cute.recast_ptr(tile.iterator, dtype=cutlass.Uint8), cute.make_layout(SF_TILE_BYTES))
        view[row_in_block * 16 + row_block * 4 + col] = byte.to(cutlass.Uint8)

    @cute.jit
    def _round_p(self, src: cute.Tensor, dst: cute.Tensor, stage: cutlass.Constexpr[int]):
        """P (FP32, 32 queries of one key row) -> E4M3 payload in `dst`; dynamic: the block's scale byte too."""
        if const_expr(self.p_quant == "const_p"):
            dst.store((src.load() * Float32(2.0 ** CONST_P_LOG2)).to(dst.element_type))
        else:
            lane, kb, qb = self._block_position(stage)
            inv_scale, byte = rceil_scale(self._block_amax_bits(src))
            dst.store((src.load() * inv_scale).to(dst.element_type))
            self._put_sf("P", lane, kb, qb, byte)

    @cute.jit
    def _round_ds(self, src: cute.Tensor, dst: cute.Tensor, stage: cutlass.Constexpr[int]):
        """dS (FP32, 32 queries of one key row) -> E4M3 payload in `dst`, the block's scale byte to the key-major
        tile (dK's SFA) and the query-major tile (dQ's SFA)."""
        lane, kb, qb = self._block_position(stage)
        inv_scale, byte = rceil_scale(self._block_amax_bits(src))
        dst.store((src.load() * inv_scale).to(dst.element_type))
        self._put_sf("dSt", lane, kb, qb, byte)
        self._put_sf("dS", lane, qb, kb, byte)

    # ---------------------------------------------------------------------------------------------------------
    # MMA warp
    # ---------------------------------------------------------------------------------------------------------
    @cute.jit
    def _load_sf(self, name: cutlass.Constexpr[str], head_idx: Int32, tile: Int32, cp):
        """One scale tile global -> shared memory by the MMA warp, then -> tensor memory (tcgen05.cp, ordered before
        the MMAs issued after it) unless `cp` is None."""
        sSF = self._mx_dev["sSF"][name]
        words = cute.make_tensor(cute.recast_ptr(sSF.iterator, dtype=Int32), cute.make_layout(SF_TILE_BYTES // 4))
        load_scale_tile(self._mx_dev["mSF"][name], head_idx, tile, words)
        if const_expr(cp is not None):
            cp(0)

    @cute.jit
    def mma(self, tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, sQ, sQt, sK, sKt, sV, sdO,
            sdOt, tP, sdSt, sdS, tdS, sP, sdS_dK, tStS, tdPtdP, tdVtdV, tdKtdK, tdQtdQ, dS_cluster_full_mbar_ptr,
            dS_cluster_empty_mbar_ptr, dS_cluster_leader_mbar_ptr, pipeline_Q, pipeline_Qt, pipeline_Kt,
            pipeline_dO, pipeline_S_P, pipeline_dS, pipeline_dKV, pipeline_dP, pipeline_dQ, pipeline_P, block_info,
            SeqlenInfoCls, TileSchedulerCls, is_leader_cta, blocksparse_tensors=None):
        """The MMA warp (aliased P / dS): the operand fragments and the scale tiles' tensor-memory views and
        copies, then the schedule: FA4's (`_mma_overlapped`, D = 64) or the serial one (`_mma_serial`, D = 128;
        the module docstring says why each is safe)."""
        tSrK, tSrQ = tiled_mma_S.make_fragment_A(sK), tiled_mma_S.make_fragment_B(sQ)
        tdPrV, tdPrdOt = tiled_mma_dP.make_fragment_A(sV), tiled_mma_dP.make_fragment_B(sdOt)
        tdQrdS, tdQrK = tiled_mma_dQ.make_fragment_A(sdS), tiled_mma_dQ.make_fragment_B(sKt)
        tdVrdO, tdKrQ = tiled_mma_dV.make_fragment_B(sdO), tiled_mma_dK.make_fragment_B(sQt)
        # A from tensor memory: fragments at column 0, moved by the column offset in 8-bit units (as FA4's forward
        # addresses its FP8 P)
        width_ratio = const_expr(Float32.width // cutlass.Float8E4M3FN.width)
        tdVrP = tiled_mma_dV.make_fragment_A(cute.make_tensor(tStS.iterator, tP.layout))
        tdVrP = cute.make_tensor(tdVrP.iterator + self.tmem_P_offset * width_ratio, tdVrP.layout)
        tdKrdS = tiled_mma_dK.make_fragment_A(cute.make_tensor(tStS.iterator, tdS.layout))
        tdKrdS = cute.make_tensor(tdKrdS.iterator + self.tmem_dS_offset * width_ratio, tdKrdS.layout)

        # the scale tiles in tensor memory (columns `tmem_sf_cols`), and their shared -> tensor memory copies
        layouts = self._sf_layouts()
        sSF = self._mx_dev["sSF"]
        tSF, cp = {}, {}
        for name, _, _ in SF_TILES:
            col = self.tmem_sf_cols[name] - self.tmem_S_offset
            ptr = cute.recast_ptr(tStS.iterator + col, dtype=cutlass.Float8E8M0FNU)
            tSF[name] = cute.make_tensor(ptr, layouts[name][1])
            assert tcgen05.find_tmem_tensor_col_offset(tSF[name]) == SF_TILE_COLS, name
            assert self.tmem_sf_cols[name] + SF_TILE_COLS <= self.tmem_alloc_cols, name
            cp[name] = copy_utils.s2t_get_copy_fn(sSF[name], tSF[name], tcgen05.CtaGroup.ONE)

        if const_expr(self.sf_serial):
            self._mma_serial(tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tSrK, tSrQ, tdPrV,
                             tdPrdOt, tdQrdS, tdQrK, tdVrdO, tdKrQ, tdVrP, tdKrdS, tSF, cp, tStS, tdPtdP, tdVtdV,
                             tdKtdK, tdQtdQ, pipeline_Q, pipeline_S_P, pipeline_dS, pipeline_dKV, pipeline_dP,
                             pipeline_dQ, pipeline_dO, block_info, SeqlenInfoCls, TileSchedulerCls, is_leader_cta)
        else:
            self._mma_overlapped(tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tSrK, tSrQ,
                                 tdPrV, tdPrdOt, tdQrdS, tdQrK, tdVrdO, tdKrQ, tdVrP, tdKrdS, tSF, cp, tStS,
                                 tdPtdP, tdVtdV, tdKtdK, tdQtdQ, pipeline_Q, pipeline_S_P, pipeline_dS,
                                 pipeline_dKV, pipeline_dP, pipeline_dQ, pipeline_dO, block_info, SeqlenInfoCls,
                                 TileSchedulerCls, is_leader_cta)

    @cute.jit
    def _const_p_sf(self, cp):
        """const_p: P's scale tile (the constant 2^-8) written to shared memory; `cp` (when given) copies it on."""
        words = cute.make_tensor(cute.recast_ptr(self._mx_dev["sSF"]["P"].iterator, dtype=Int32),
                                 cute.make_layout(SF_TILE_BYTES // 4))
        lane = cute.arch.lane_idx()
        for j in cutlass.range_constexpr(4):
            words[lane * 4 + j] = Int32(P_SF_BYTE * 0x01010101)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if const_expr(cp is not None):
            cp(0)

    @cute.jit
    def _mma_overlapped(self, tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tSrK, tSrQ,
                        tdPrV, tdPrdOt, tdQrdS, tdQrK, tdVrdO, tdKrQ, tdVrP, tdKrdS, tSF, cp, tStS, tdPtdP, tdVtdV,
                        tdKtdK, tdQtdQ, pipeline_Q, pipeline_S_P, pipeline_dS, pipeline_dKV, pipeline_dP,
                        pipeline_dQ, pipeline_dO, block_info, SeqlenInfoCls, TileSchedulerCls, is_leader_cta):
        """D = 64: FA4's 1-CTA schedule: prologue S^T(0), dP^T(0), dV(0); per further query step t+1: S^T(t+1),
        dK(t), dQ(t), dP^T(t+1), dV(t+1); tail dK(last), dQ(last). Each MMA block-scaled, each scale tile (in
        columns of its own) copied to tensor memory just before the MMA that reads it."""
        if const_expr(self.p_quant == "const_p"):
            # P's scale is the constant 2^-8: its tile once for the kernel
            self._const_p_sf(cp["P"])

        pipeline_Q_consumer = pipeline_Q.make_consumer()
        consumer_state_dO = cutlass.pipeline.make_pipeline_state(cutlass.pipeline.PipelineUserType.Consumer,
                                                                 self.dO_stage)
        consumer_state_dS = cutlass.pipeline.make_pipeline_state(cutlass.pipeline.PipelineUserType.Consumer, 1)
        producer_phase_acc = Int32(1)  # S & P, dP, dQ
        producer_phase_dKV = Int32(1)
        cta_group = pipeline_S_P.cta_group
        tile_q, tile_k = self._mx_dev["tile_q"], self._mx_dev["tile_k"]

        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            n_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block // self.cluster_shape_mnk[0])
            process_tile = const_expr(not self.is_local and not self.is_varlen_q) or m_block_min < m_block_max
            if is_leader_cta and process_tile:
                q_tile0 = tile_q[batch_idx]
                k_tile = tile_k[batch_idx] + n_block
                # this CTA's key tile: K, V (`hdim`) and K (`seq`) scales
                self._load_sf("Kh", head_idx, k_tile, cp["Kh"])
                self._load_sf("Vh", head_idx, k_tile, cp["Vh"])
                self._load_sf("Ks", head_idx, k_tile, cp["Ks"])
                # prologue: S^T(0), dP^T(0), dV(0)
                handle_Q = pipeline_Q_consumer.wait_and_advance()
                pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                self._load_sf("Qh", head_idx, q_tile0 + m_block_min, cp["Qh"])
                block_scaled_gemm(tiled_mma_S, tStS, tSrK, tSrQ[None, None, None, handle_Q.index], tSF["Kh"], tSF["Qh"],
                                  False)
                pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                pipeline_dO.consumer_wait(consumer_state_dO)
                pipeline_dP.sync_object_empty.wait(0, producer_phase_acc)
                pipeline_dQ.sync_object_empty.wait(0, producer_phase_acc)
                self._load_sf("dOh", head_idx, q_tile0 + m_block_min, cp["dOh"])
                block_scaled_gemm(tiled_mma_dP, tdPtdP, tdPrV, tdPrdOt[None, None, None, consumer_state_dO.index],
                                  tSF["Vh"], tSF["dOh"], False)
                pipeline_dP.sync_object_full.arrive(0, pipeline_dP.producer_mask, cta_group)
                producer_phase_acc ^= 1
                pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                self._load_sf("dOs", head_idx, q_tile0 + m_block_min, cp["dOs"])
                if const_expr(self.p_quant == "dynamic"):
                    cp["P"](0)
                block_scaled_gemm(tiled_mma_dV, tdVtdV, tdVrP, tdVrdO[None, None, None, consumer_state_dO.index],
                                  tSF["P"], tSF["dOs"], False)
                pipeline_dO.consumer_release(consumer_state_dO)
                consumer_state_dO.advance()
                # main loop: the step before is t, this one t + 1
                accumulate_dK = Boolean(False)
                for i in cutlass.range(m_block_max - m_block_min - 1, unroll=1):
                    q_tile = q_tile0 + m_block_min + i
                    # S^T(t+1) = K Q^T
                    handle_Q_next = pipeline_Q_consumer.wait_and_advance()
                    self._load_sf("Qh", head_idx, q_tile + 1, cp["Qh"])
                    block_scaled_gemm(tiled_mma_S, tStS, tSrK, tSrQ[None, None, None, handle_Q_next.index], tSF["Kh"],
                                      tSF["Qh"], False)
                    pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                    # dK(t) += dS^T Q, dQ(t) = dS K
                    pipeline_dS.consumer_wait(consumer_state_dS)
                    self._load_sf("Qs", head_idx, q_tile, cp["Qs"])
                    cp["dSt"](0)
                    cp["dS"](0)
                    block_scaled_gemm(tiled_mma_dK, tdKtdK, tdKrdS, tdKrQ[None, None, None, handle_Q.index], tSF["dSt"],
                                      tSF["Qs"], accumulate_dK)
                    accumulate_dK = Boolean(True)
                    handle_Q.release()
                    block_scaled_gemm(tiled_mma_dQ, tdQtdQ, tdQrdS, tdQrK, tSF["dS"], tSF["Ks"], False)
                    pipeline_dQ.sync_object_full.arrive(0, pipeline_dQ.producer_mask, cta_group)
                    pipeline_dS.consumer_release(consumer_state_dS)
                    consumer_state_dS.advance()
                    # dP^T(t+1) = V dO^T
                    pipeline_dO.consumer_wait(consumer_state_dO)
                    pipeline_dQ.sync_object_empty.wait(0, producer_phase_acc)
                    self._load_sf("dOh", head_idx, q_tile + 1, cp["dOh"])
                    block_scaled_gemm(tiled_mma_dP, tdPtdP, tdPrV, tdPrdOt[None, None, None, consumer_state_dO.index],
                                      tSF["Vh"], tSF["dOh"], False)
                    pipeline_dP.sync_object_full.arrive(0, pipeline_dP.producer_mask, cta_group)
                    # dV(t+1) += P^T dO
                    producer_phase_acc ^= 1
                    pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                    self._load_sf("dOs", head_idx, q_tile + 1, cp["dOs"])
                    if const_expr(self.p_quant == "dynamic"):
                        cp["P"](0)
                    block_scaled_gemm(tiled_mma_dV, tdVtdV, tdVrP, tdVrdO[None, None, None, consumer_state_dO.index],
                                      tSF["P"], tSF["dOs"], True)
                    pipeline_dO.consumer_release(consumer_state_dO)
                    consumer_state_dO.advance()
                    handle_Q = handle_Q_next
                pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                # dV is ready for the epilogue
                pipeline_dKV.sync_object_empty.wait(0, producer_phase_dKV)
                pipeline_dKV.sync_object_full.arrive(0, pipeline_dKV.producer_mask, cta_group)
                pipeline_dKV.sync_object_empty.wait(1, producer_phase_dKV)
                # tail: dK(last), dQ(last)
                pipeline_dS.consumer_wait(consumer_state_dS)
                self._load_sf("Qs", head_idx, q_tile0 + m_block_max - 1, cp["Qs"])
                cp["dSt"](0)
                cp["dS"](0)
                block_scaled_gemm(tiled_mma_dK, tdKtdK, tdKrdS, tdKrQ[None, None, None, handle_Q.index], tSF["dSt"],
                                  tSF["Qs"], accumulate_dK)
                pipeline_dKV.sync_object_full.arrive(1, pipeline_dKV.producer_mask, cta_group)
                producer_phase_dKV ^= 1
                block_scaled_gemm(tiled_mma_dQ, tdQtdQ, tdQrdS, tdQrK, tSF["dS"], tSF["Ks"], False)
                pipeline_dQ.sync_object_full.arrive(0, pipeline_dQ.producer_mask, cta_group)
                handle_Q.release()
                pipeline_dS.consumer_release(consumer_state_dS)
                consumer_state_dS.advance()
                producer_phase_acc ^= 1
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()

    @cute.jit
    def _mma_serial(self, tiled_mma_S, tiled_mma_dP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, tSrK, tSrQ, tdPrV,
                    tdPrdOt, tdQrdS, tdQrK, tdVrdO, tdKrQ, tdVrP, tdKrdS, tSF, cp, tStS, tdPtdP, tdVtdV, tdKtdK,
                    tdQtdQ, pipeline_Q, pipeline_S_P, pipeline_dS, pipeline_dKV, pipeline_dP, pipeline_dQ,
                    pipeline_dO, block_info, SeqlenInfoCls, TileSchedulerCls, is_leader_cta):
        """D = 128: the scale tiles live in accumulator columns that hold nothing live, so each tile is copied to
        tensor memory just before every MMA that reads it and the MMAs are issued in an order where those columns
        are free: per query step t, after P(t) is ready: dP^T(t), dV(t) (their scales in S^T past P); after dS(t)
        is ready: dK(t), dQ(t) (scales in S^T past P); after the dQ reduce warps have read dQ(t): S^T(t+1) (scales
        in dP^T past dS). FA4 issues S^T(t+1) before dK(t) / dQ(t) and dP^T(t) right after S^T(t); here the
        tensor cores wait for the compute warps (module docstring)."""
        if const_expr(self.p_quant == "const_p"):
            self._const_p_sf(None)

        pipeline_Q_consumer = pipeline_Q.make_consumer()
        consumer_state_dO = cutlass.pipeline.make_pipeline_state(cutlass.pipeline.PipelineUserType.Consumer,
                                                                 self.dO_stage)
        consumer_state_dS = cutlass.pipeline.make_pipeline_state(cutlass.pipeline.PipelineUserType.Consumer, 1)
        producer_phase_acc = Int32(1)  # S & P, dP, dQ
        producer_phase_dKV = Int32(1)
        cta_group = pipeline_S_P.cta_group
        tile_q, tile_k = self._mx_dev["tile_q"], self._mx_dev["tile_k"]

        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            n_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block // self.cluster_shape_mnk[0])
            process_tile = const_expr(not self.is_local and not self.is_varlen_q) or m_block_min < m_block_max
            if is_leader_cta and process_tile:
                q_tile0 = tile_q[batch_idx]
                k_tile = tile_k[batch_idx] + n_block
                # this CTA's key tile: K, V (`hdim`) and K (`seq`) scales to shared memory, copied on per MMA
                self._load_sf("Kh", head_idx, k_tile, None)
                self._load_sf("Vh", head_idx, k_tile, None)
                self._load_sf("Ks", head_idx, k_tile, None)
                # prologue: S^T(0); once P(0) is ready dP^T(0), dV(0)
                handle_Q = pipeline_Q_consumer.wait_and_advance()
                pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                cp["Kh"](0)
                self._load_sf("Qh", head_idx, q_tile0 + m_block_min, cp["Qh"])
                block_scaled_gemm(tiled_mma_S, tStS, tSrK, tSrQ[None, None, None, handle_Q.index], tSF["Kh"], tSF["Qh"],
                                  False)
                pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                pipeline_dO.consumer_wait(consumer_state_dO)
                pipeline_dP.sync_object_empty.wait(0, producer_phase_acc)
                pipeline_dQ.sync_object_empty.wait(0, producer_phase_acc)
                producer_phase_acc ^= 1
                pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                cp["Vh"](0)
                self._load_sf("dOh", head_idx, q_tile0 + m_block_min, cp["dOh"])
                block_scaled_gemm(tiled_mma_dP, tdPtdP, tdPrV, tdPrdOt[None, None, None, consumer_state_dO.index],
                                  tSF["Vh"], tSF["dOh"], False)
                pipeline_dP.sync_object_full.arrive(0, pipeline_dP.producer_mask, cta_group)
                self._load_sf("dOs", head_idx, q_tile0 + m_block_min, cp["dOs"])
                cp["P"](0)
                block_scaled_gemm(tiled_mma_dV, tdVtdV, tdVrP, tdVrdO[None, None, None, consumer_state_dO.index],
                                  tSF["P"], tSF["dOs"], False)
                pipeline_dO.consumer_release(consumer_state_dO)
                consumer_state_dO.advance()
                # main loop: the step before is t, this one t + 1
                accumulate_dK = Boolean(False)
                for i in cutlass.range(m_block_max - m_block_min - 1, unroll=1):
                    q_tile = q_tile0 + m_block_min + i
                    # dK(t) += dS^T Q, dQ(t) = dS K
                    pipeline_dS.consumer_wait(consumer_state_dS)
                    self._load_sf("Qs", head_idx, q_tile, cp["Qs"])
                    cp["dSt"](0)
                    cp["dS"](0)
                    block_scaled_gemm(tiled_mma_dK, tdKtdK, tdKrdS, tdKrQ[None, None, None, handle_Q.index], tSF["dSt"],
                                      tSF["Qs"], accumulate_dK)
                    accumulate_dK = Boolean(True)
                    handle_Q.release()
                    cp["Ks"](0)
                    block_scaled_gemm(tiled_mma_dQ, tdQtdQ, tdQrdS, tdQrK, tSF["dS"], tSF["Ks"], False)
                    pipeline_dQ.sync_object_full.arrive(0, pipeline_dQ.producer_mask, cta_group)
                    pipeline_dS.consumer_release(consumer_state_dS)
                    consumer_state_dS.advance()
                    # S^T(t+1) = K Q^T, once the reduce warps have read dQ(t) (its scales go where dQ was)
                    handle_Q_next = pipeline_Q_consumer.wait_and_advance()
                    pipeline_dQ.sync_object_empty.wait(0, producer_phase_acc)
                    cp["Kh"](0)
                    self._load_sf("Qh", head_idx, q_tile + 1, cp["Qh"])
                    block_scaled_gemm(tiled_mma_S, tStS, tSrK, tSrQ[None, None, None, handle_Q_next.index], tSF["Kh"],
                                      tSF["Qh"], False)
                    pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                    # dP^T(t+1) = V dO^T, dV(t+1) += P^T dO, once P(t+1) is ready (their scales go past it)
                    pipeline_dO.consumer_wait(consumer_state_dO)
                    producer_phase_acc ^= 1
                    pipeline_S_P.sync_object_empty.wait(0, producer_phase_acc)
                    cp["Vh"](0)
                    self._load_sf("dOh", head_idx, q_tile + 1, cp["dOh"])
                    block_scaled_gemm(tiled_mma_dP, tdPtdP, tdPrV, tdPrdOt[None, None, None, consumer_state_dO.index],
                                      tSF["Vh"], tSF["dOh"], False)
                    pipeline_dP.sync_object_full.arrive(0, pipeline_dP.producer_mask, cta_group)
                    self._load_sf("dOs", head_idx, q_tile + 1, cp["dOs"])
                    cp["P"](0)
                    block_scaled_gemm(tiled_mma_dV, tdVtdV, tdVrP, tdVrdO[None, None, None, consumer_state_dO.index],
                                      tSF["P"], tSF["dOs"], True)
                    pipeline_dO.consumer_release(consumer_state_dO)
                    consumer_state_dO.advance()
                    handle_Q = handle_Q_next
                pipeline_S_P.sync_object_full.arrive(0, pipeline_S_P.producer_mask, cta_group)
                # dV is ready for the epilogue
                pipeline_dKV.sync_object_empty.wait(0, producer_phase_dKV)
                pipeline_dKV.sync_object_full.arrive(0, pipeline_dKV.producer_mask, cta_group)
                pipeline_dKV.sync_object_empty.wait(1, producer_phase_dKV)
                # tail: dK(last), dQ(last)
                pipeline_dS.consumer_wait(consumer_state_dS)
                self._load_sf("Qs", head_idx, q_tile0 + m_block_max - 1, cp["Qs"])
                cp["dSt"](0)
                cp["dS"](0)
                block_scaled_gemm(tiled_mma_dK, tdKtdK, tdKrdS, tdKrQ[None, None, None, handle_Q.index], tSF["dSt"],
                                  tSF["Qs"], accumulate_dK)
                pipeline_dKV.sync_object_full.arrive(1, pipeline_dKV.producer_mask, cta_group)
                producer_phase_dKV ^= 1
                cp["Ks"](0)
                block_scaled_gemm(tiled_mma_dQ, tdQtdQ, tdQrdS, tdQrK, tSF["dS"], tSF["Ks"], False)
                pipeline_dQ.sync_object_full.arrive(0, pipeline_dQ.producer_mask, cta_group)
                handle_Q.release()
                pipeline_dS.consumer_release(consumer_state_dS)
                consumer_state_dS.advance()
                producer_phase_acc ^= 1
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
