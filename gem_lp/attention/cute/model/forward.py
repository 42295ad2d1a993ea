"""CPU model of the sm_100a MXFP8 forward (`fwd_sm100.MXAttentionForwardSm100`), executing its schedule.

Per work tile of FA4's varlen scheduler (`scheduler.py`; one 128-query tile, q_stage 1) the model runs what the
kernel's warps do, in the MMA warp's order (`MXAttentionForwardSm100.mma`): S = Q K(n)^T for the key tiles
n = n_block_max - 1 down to n_block_min, each block-scaled (Q's and K's `hdim` scale tiles `q_tiles[b] + m_block`
and `k_tiles[b] + n`), then FA4's softmax step with the recipe's state (`MXSoftmaxSm100`), the correction warps'
rescale of O, and O += P V(n) (P's scale tile: const_p's constant byte 127, or dynamic P's per-32-key bytes; V's
`seq` scale tile `k_tiles[b] + n` along the keys); the correction epilogue then writes O / row_sum and the LSE.

Where the model follows a formula of the kernel or of FA4 (file: function):
* tile map, grid, LPT order: flash_attn/cute/tile_scheduler.py: SingleTileVarlenScheduler, VarlenDecoder.decode
* key-tile range: block_info.py: BlockInfo.get_n_block_min_max; which steps mask: flash_fwd_sm100.py: softmax_loop
  (the first step with the seqlen mask, then causal steps down to get_n_block_min_causal_local_mask)
* masks: mask.py: AttentionMask.apply_mask_sm100 (col >= seqlen_k - n * 128, col >= row + seqlen_k - n * 128 -
  seqlen_q + 1); rows past seqlen_q are computed and not written
* thread layout: thread t of the softmax warpgroup holds row t, register i key i (tcgen05.make_tmem_copy of
  Ld32x32bOp x32; P's bytes go to column 64 + i / 4, byte i % 4, the P.V MMA's A operand), so a dynamic-P block is
  keys 32 j .. 32 j + 31 of one row (MXSoftmaxSm100.apply_exp2_convert)
* softmax state: fwd_sm100.py: MXSoftmaxSm100 (_update_snapped_max, scale_subtract_rowmax, apply_exp2_convert,
  update_row_sum); correction: flash_fwd_sm100.py: correction_loop (rescale, rcp of row_sum, LSE)
* const_p's exp2: FA4's SoftmaxSm100.apply_exp2_convert with the build's ex2_emu_freq / ex2_emu_start_frg
  (flash_fwd_sm100.py: __call__): a polynomial (utils.ex2_emulation_2) on some keys of key blocks 1 and 2, so P
  there is FA4's polynomial 2^t, not 2^t, before its E4M3 rounding
* scale addresses: sm100_mma.py: load_scale_tile; fwd_sm100.py: mma (tile_q0 = q_tiles[b] + m_block * q_stage,
  tile_k0 = k_tiles[b]); scale-factor atom: blockscaled_utils.make_smem_layout_sfa/sfb (mma.py here)
* tensor memory: flash_fwd_sm100.py __init__ (S at 0, P at S + 64, O at 256) and fwd_sm100.py mma (the four scale
  tiles from tmem_total)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gem_lp.attention.cute.model.common import (LN2, MX_BLOCK, TILE, check_payloads, e4m3, fp32_fma, kernel_e8m0,
                                                 mx_payload, offsets_list, rceil_bytes, tma_rows,
                                                 warn_out_of_bounds)
from gem_lp.attention.cute.model.mma import TmemLedger, block_scaled_mma, scale_tile
from gem_lp.attention.cute.model.scheduler import Tile, ceil_div, make_scheduler

FA4_FP8_P_LOG2 = 8  # FA4's FP8 P is 2^8 p; its correction warps take the 8 out of the LSE
P_SF_BYTE = 127  # const_p: the P.V MMA's scale byte for P (its payload already holds 256 p)
TMEM_ALLOC = 512
SF_TILE_COLS = 4


@dataclass
class ForwardTrace:
    """What the forward model did: outputs, the tiles in grid order, every scale tile read (name, tile, in
    bounds), the tensor-memory ledger of the last tile (columns are reused per tile in the same order)."""

    out: torch.Tensor
    lse: torch.Tensor
    tiles: list[Tile] = field(default_factory=list)
    scale_reads: list = field(default_factory=list)
    tmem: TmemLedger | None = None


def tmem_columns(dim: int, dynamic_p: bool) -> dict[str, tuple[int, int]]:
    """(first column, columns) of each tensor-memory region with one Q stage (FA4's __init__ and MXAttentionForward
    Sm100.mma: the scale tiles q0, k, p0, v after tmem_total = O's end)."""
    s_offset, o_offset = 0, 2 * TILE  # FA4's tmem_s_offset [0, 128] and tmem_o_offset 256
    cols = {"S": (s_offset, TILE), "P": (s_offset + TILE // 2, TILE // 4), "O": (o_offset, dim)}
    col = o_offset + dim
    for name in ("sfQ", "sfK", "sfP", "sfV"):
        cols[name] = (col, SF_TILE_COLS)
        col += SF_TILE_COLS
    assert col <= TMEM_ALLOC, f"the forward's scale tiles need tensor-memory columns up to {col}"
    return cols


class _RowState:
    """MXSoftmaxSm100's per-row state for the 128 rows of a tile (FP32, one row per thread)."""

    def __init__(self, scale_log2: torch.Tensor, dynamic_p: bool):
        rows = TILE
        self.scale_log2 = scale_log2
        self.p_log2_offset = 0 if dynamic_p else FA4_FP8_P_LOG2
        self.max_log2 = torch.full((rows,), -math.inf)
        self.unrounded_sum = torch.zeros(rows)
        self.row_sum = torch.zeros(rows)
        self.row_max = torch.full((rows,), -math.inf)

    def update_max(self, s: torch.Tensor, is_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """_update_snapped_max: m' = ceil(tile max * scale_log2) (maxed with the old m'); (m' or 0, 2^(m'_old - m'))."""
        m_new = torch.ceil(s.amax(dim=1) * self.scale_log2)
        acc_scale = torch.zeros(TILE)
        if not is_first:
            m_new = torch.maximum(m_new, self.max_log2)
        m_safe = torch.where(m_new == -math.inf, torch.zeros(()), m_new)
        if not is_first:
            acc_scale = exp2_int(self.max_log2 - m_safe)
        self.max_log2 = m_new
        return m_safe, acc_scale

    def update_sum(self, p: torch.Tensor, rounded: torch.Tensor, acc_scale: torch.Tensor, is_first: bool) -> None:
        """update_row_sum: l, lq rescaled plus this tile's sums; FA4's row-max slot from them."""
        if is_first:
            l, lq = p.sum(dim=1), rounded
        else:
            l = self.unrounded_sum * acc_scale + p.sum(dim=1)
            lq = self.row_sum * acc_scale + rounded
        self.unrounded_sum, self.row_sum = l, lq
        slot = (self.max_log2 + (torch.log2(l) - torch.log2(lq))
                + float(FA4_FP8_P_LOG2 - self.p_log2_offset)) * (1.0 / self.scale_log2)
        self.row_max = torch.where(lq > 0, slot, torch.full((), -math.inf))


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """mx_device.exp2_int: 2^k for integer-valued k from exponent bits; 0 below -126 (and for -inf), NaN -> 1."""
    e = torch.nan_to_num(k, nan=0.0, posinf=2.0**31, neginf=-2.0**31).round().clamp(-127, 127).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def _mask(s: torch.Tensor, *, m_block: int, n_block: int, seqlen_q: int, seqlen_k: int, causal: bool,
          seqlen: bool) -> torch.Tensor:
    """AttentionMask.apply_mask_sm100 (rows are this tile's queries, columns its keys); n_block < 0 counts as 0."""
    n_block = max(n_block, 0)
    col = torch.arange(TILE)[None, :]
    seqlenk_col_limit = seqlen_k - n_block * TILE
    if not causal:
        return s.masked_fill(col >= seqlenk_col_limit, -math.inf) if seqlen else s
    row = torch.arange(TILE)[:, None] + m_block * TILE
    limit = row + (seqlen_k - n_block * TILE - seqlen_q) + 1
    if seqlen:
        limit = torch.clamp(limit, max=seqlenk_col_limit)
    return s.masked_fill(col >= limit, -math.inf)


# FA4's degree-3 polynomial for 2^f on [0, 1) (utils.POLY_EX2[3]), in FP32
EX2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)
EMU_RES = 4  # SoftmaxSm100.apply_exp2_convert's ex2_emu_res


def ex2_emu_config(dim: int, causal: bool) -> tuple[int, int]:
    """(ex2_emu_freq, ex2_emu_start_frg) FA4's forward builds with E4M3 operands and one CTA on sm_100
    (flash_fwd_sm100.py: __call__ with _TUNING_CONFIG / _FP8_TUNING_CONFIG): 8 and 1 for causal D = 128 (its FP8
    entry), else the defaults 16 and 1 (emulation is on for head dims up to 128)."""
    return (8, 1) if (causal and dim == 128) else (16, 1)


def ex2_emulated_keys(freq: int, start_frg: int) -> torch.Tensor:
    """`[128]` bool: the registers (keys) whose exp2 FA4's apply_exp2_convert takes from `utils.ex2_emulation_2`
    (pairs k, k + 1 with k % freq >= freq - 4, in 32-key fragments start_frg .. 2), the rest from MUFU ex2."""
    k = torch.arange(TILE) % MX_BLOCK
    frg = torch.arange(TILE) // MX_BLOCK
    return ((k - k % 2) % freq >= freq - EMU_RES) & (frg >= start_frg) & (frg < TILE // MX_BLOCK - 1)


def ex2_emulation(x: torch.Tensor) -> torch.Tensor:
    """`utils.ex2_emulation_2`: 2^floor(x) times the polynomial at x - floor(x) (x clamped at -127), FP32 FMAs."""
    x = torch.clamp(x, min=-127.0)
    whole = torch.floor(x)  # add.rm of 1.5 * 2^23, then the subtraction back: exact
    frac = (x - whole).to(torch.float64)
    out = torch.full_like(frac, EX2_POLY[3])
    for c in EX2_POLY[2::-1]:
        out = (out * frac + c).to(torch.float32).to(torch.float64)  # fma.rn.f32 (the product is exact in FP64)
    return (out * torch.exp2(whole.to(torch.float64))).to(torch.float32)  # the exponent added as an integer


def _softmax_p(t: torch.Tensor, dynamic_p: bool, emulated: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_exp2_convert on t = s * scale_log2 - m' (+8): (p, the P.V MMA's A payload values, its scale bytes
    `[128, 4]` by key block, the row's sum of the rounded P). const_p keeps FA4's exp2, polynomial on the keys of
    `emulated`; dynamic takes MUFU ex2 everywhere."""
    p = torch.exp2(t)
    if not dynamic_p:
        if emulated is not None:
            p = torch.where(emulated[None, :], ex2_emulation(t), p)
        payload = e4m3(p)
        return p, payload, torch.full((TILE, 4), P_SF_BYTE, dtype=torch.uint8), payload.sum(dim=1)
    blocks = p.reshape(TILE, TILE // MX_BLOCK, MX_BLOCK)
    byte = rceil_bytes(blocks.amax(dim=2))  # p >= 0
    payload = mx_payload(blocks, byte[:, :, None])
    rounded = (payload.sum(dim=2) * kernel_e8m0(byte)).sum(dim=1)
    return p, payload.reshape(TILE, TILE), byte, rounded


def forward_trace(q, k, v, scales, cu_q, cu_k, *, causal: bool, scale: float, p_quant: str) -> ForwardTrace:
    """The forward model with its trace (see `forward`)."""
    if p_quant not in ("const_p", "dynamic"):
        raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
    heads, dim = check_payloads((("q", q), ("k", k), ("v", v)))
    tq = q.shape[0]
    out = torch.zeros(tq, heads, dim, dtype=torch.bfloat16)
    lse = torch.full((heads, tq), -math.inf, dtype=torch.float32)
    if tq == 0 or k.shape[0] == 0:
        return ForwardTrace(out, lse)
    cq, ck = offsets_list(cu_q, "cu_q"), offsets_list(cu_k, "cu_k")
    q_tiles, k_tiles = offsets_list(scales.q_tiles, "q_tiles"), offsets_list(scales.k_tiles, "k_tiles")
    dynamic_p = p_quant == "dynamic"
    scale_log2 = torch.tensor(scale * math.log2(math.e), dtype=torch.float32)  # FA4's softmax_scale_log2 (FP32)
    sched = make_scheduler(cq, num_head=heads, tile_m=TILE, tile_n=TILE, head_dim=dim, lpt=causal)
    trace = ForwardTrace(out, lse, tiles=sched.tiles())
    cols = tmem_columns(dim, dynamic_p)
    emulated = ex2_emulated_keys(*ex2_emu_config(dim, causal))
    reads = trace.scale_reads
    for tile in trace.tiles:
        m_block, head, b = tile.block, tile.head, tile.batch
        seqlen_q, seqlen_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        n_block_min, n_block_max = 0, ceil_div(seqlen_k, TILE)
        if causal:
            n_block_max = min(n_block_max, ceil_div((m_block + 1) * TILE + seqlen_k - seqlen_q, TILE))
        ledger = TmemLedger(TMEM_ALLOC)
        qv = tma_rows(q, head, cq[b] + m_block * TILE)
        sfq = scale_tile(scales.q, head, q_tiles[b] + m_block, reads, "q", clamp=True)
        ledger.write("sfQ", *cols["sfQ"])
        state = _RowState(scale_log2, dynamic_p)
        o_acc = None
        # the softmax steps: the last key tile first (seqlen mask), then causal masking down to
        # get_n_block_min_causal_local_mask, then no mask (FA4's softmax_loop); the MMA warp walks the same tiles
        causal_until = max(n_block_min, (m_block * TILE + seqlen_k - seqlen_q) // TILE) if causal else n_block_max
        # S(n) and P V(n) pair up over n_block_max - 1 .. n_block_min; without a key tile (n_block_max <= 0) the MMA
        # warp still runs S(n_block_max - 1) and P V(n_block_min), all masked
        steps = [(n, n) for n in range(n_block_max - 1, n_block_min - 1, -1)] or [(n_block_max - 1, n_block_min)]
        for i, (n, n_v) in enumerate(steps):
            is_first = i == 0
            sfk = scale_tile(scales.k, head, k_tiles[b] + n, reads, "k", clamp=True)
            ledger.write("sfK", *cols["sfK"])
            ledger.read("sfQ", *cols["sfQ"])
            ledger.read("sfK", *cols["sfK"])
            s = block_scaled_mma(qv, sfq, tma_rows(k, head, ck[b] + n * TILE), sfk)
            ledger.write("S", *cols["S"])
            ledger.read("S", *cols["S"])
            if is_first or (causal and n >= causal_until):
                s = _mask(s, m_block=m_block, n_block=n, seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
                          seqlen=is_first)
            m_safe, acc_scale = state.update_max(s, is_first)
            t = fp32_fma(s, scale_log2, float(state.p_log2_offset) - m_safe[:, None])
            p, p_payload, p_bytes, rounded = _softmax_p(t, dynamic_p, emulated)
            ledger.write("P", *cols["P"])
            state.update_sum(p, rounded, acc_scale, is_first)
            if not is_first:  # correction warps: O *= 2^(m'_old - m') before this P.V accumulates
                ledger.read("O", *cols["O"])
                o_acc = o_acc * acc_scale[:, None]
                ledger.write("O", *cols["O"])
            sfv = scale_tile(scales.v, head, k_tiles[b] + n_v, reads, "v", clamp=True)[:dim]  # rows: V's features
            ledger.write("sfV", *cols["sfV"])
            ledger.write("sfP", *cols["sfP"])
            for name in ("P", "sfP", "sfV") + (("O",) if not is_first else ()):
                ledger.read(name, *cols[name])
            # O += P V: A = P [rows, keys], B = V^T [features, keys] (MN-major V), SFB = V's `seq` tile
            o_acc = block_scaled_mma(p_payload, p_bytes, tma_rows(v, head, ck[b] + n_v * TILE).T, sfv, o_acc)
            ledger.write("O", *cols["O"])
        # correction epilogue
        ledger.read("O", *cols["O"])
        lq = state.row_sum
        empty = (lq == 0) | torch.isnan(lq)
        inv = 1.0 / torch.where(empty, torch.ones(()), lq)
        o_tile = (o_acc * inv[:, None]).to(torch.bfloat16)
        if seqlen_k == 0:  # zero_fill: the fully masked dummy key tile's O is not scaled
            o_tile = torch.zeros_like(o_tile)
        lse_tile = torch.where(empty, torch.full((), -math.inf),
                               (state.row_max * scale_log2 + (torch.log2(lq) - FA4_FP8_P_LOG2)) * LN2)
        rows = min(TILE, seqlen_q - m_block * TILE)
        start = cq[b] + m_block * TILE
        out[start:start + rows, head] = o_tile[:rows]
        lse[head, start:start + rows] = lse_tile[:rows]
        trace.tmem = ledger
    warn_out_of_bounds(reads, "the forward")
    return trace


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales, cu_q: torch.Tensor, cu_k: torch.Tensor, *,
            causal: bool, scale: float, p_quant: str = "const_p") -> tuple[torch.Tensor, torch.Tensor]:
    """`launch._mx_forward_sm100` on CPU tensors: O `[Tq, H, D]` BF16 and LSE `[H, Tq]` FP32 of the kernel's
    schedule. q, k, v: E4M3 payloads `[T, H, D]`; `scales`: `launch.MXScales` (Q, K `hdim`, V `seq` blocked scales
    `[H, bytes]` uint8, q_tiles / k_tiles int32 `[B+1]`); cu_q, cu_k int32 `[B+1]`."""
    trace = forward_trace(q, k, v, scales, cu_q, cu_k, causal=causal, scale=scale, p_quant=p_quant)
    return trace.out, trace.lse
