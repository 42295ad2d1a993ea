"""CPU model of the sm_100a MXFP8 backward (`bwd_sm100.MXAttentionBackwardSm100`) and of what `launch._mx_backward_sm100`
runs around it (FA4's preprocess and dQ postprocess), executing the kernel's schedule.

Per work tile of FA4's varlen scheduler over key tiles (`scheduler.py`, no LPT) the model runs the CTA's query steps
m_block_min .. m_block_max - 1 as the warps do: S^T = K Q^T (K's and Q's `hdim` scale tiles), the mask, P = exp2(S^T
* scale_log2 - LSE_log2) and its E4M3 rounding (`_round_p`), dP^T = V dO^T (V's and dO's `hdim` tiles), dS = P (dP - Δ)
and its rounding (`_round_ds`), then dV += P^T dO (P's tile, dO's `seq` tile), dK += dS^T Q (dS's key-major tile, Q's
`seq` tile) and dQ = dS K (dS's query-major tile, K's `seq` tile), dQ added into FA4's FP32 accumulator; then the
dK / dV epilogue (dK times the softmax scale) and FA4's postprocess (dQ accumulator times the softmax scale).

Where the model follows a formula of the kernel or of FA4 (file: function):
* tile map: tile_scheduler.py: SingleTileVarlenScheduler over cu_seqlens_k (flash_bwd_sm100.py: __call__, spt off)
* query-step range: block_info.py: BlockInfo.get_m_block_min_max; empty tiles zero dK / dV (compute_loop)
* mask: mask.py: AttentionMask.apply_mask_sm100_transposed (swap_AB): a key past seqlen_k masks its whole row;
  causal: row_limit_top = (seqlen_q - m * 128 - 32 g) - (seqlen_k - n * 128 - key), applied through
  row_to_r2p_idx to the thread's 64 registers
* thread layout: FA4's thread t (thread index mod 256) holds key t % 128 and, per stage s, queries 64 s + 32 (t //
  128) + [0, 32) (copy_utils.make_tmem_copy(Ld32x32bOp x32, 2 warpgroups)), so one warp's stage is one 32x32 block:
  key block (t % 128) // 32, query block 2 s + t // 128 (bwd_sm100.py: _block_position); P's and dS's E4M3 go to the
  tensor-memory column of their query (the x8 store of the same layout)
* P, dS roundings and their scale bytes: bwd_sm100.py: _round_p, _round_ds, _put_sf (byte row_in_block * 16 +
  row_block * 4 + col of a 128x4 tile)
* Δ, LSE_log2, padded rows, the dQ accumulator: flash_bwd_preprocess.py (Δ = rowsum(O dO) - dLSE, 0 past seqlen_q;
  LSE * log2 e, 0 for -inf, +inf past seqlen_q), SeqlenInfoQK.padded_offset_q, bwd_accum_tile.py:
  accum_tile_layout(TMEM_FRAG_1CTA), flash_bwd_sm100.py: _check_accum_tile_orders (the reduce's addresses)
* scale addresses: bwd_sm100.py: _mma_overlapped / _mma_serial (q_tile0 = q_tiles[b], k_tile = k_tiles[b] + n)
* tensor memory: bwd_sm100.py: __init__ (accumulator offsets, tmem_sf_cols) and the two MMA schedules' issue order
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gem_lp.attention.cute.model.common import (LOG2E, MX_BLOCK, TILE, check_payloads, e4m3, fp32_fma, mx_payload,
                                                 offsets_list, rceil_bytes, tma_rows, warn_out_of_bounds)
from gem_lp.attention.cute.model.mma import SF_TILE_BYTES, TmemLedger, block_scaled_mma, scale_tile, sf_atom_offset
from gem_lp.attention.cute.model.scheduler import Tile, ceil_div, make_scheduler
from gem_lp.attention.reference import accumulate_dq, finish_dq

CONST_P_LOG2 = 8
P_SF_BYTE = 127 - CONST_P_LOG2  # const_p: P's payload is e4m3(256 p), its scale 2^-8
TMEM_ALLOC = 512
SF_TILE_COLS = 4
# bwd_sm100.SF_TILES: the scale tiles in tensor-memory column order
SF_TILES = ("Kh", "Qh", "Vh", "dOh", "P", "dOs", "dSt", "Qs", "dS", "Ks")
DQ_REDUCE_NCOL = 32  # FA4's 1-CTA dQ_reduce_ncol
BLOCKS = TILE // MX_BLOCK  # 32x32 blocks per tile side


@dataclass
class BackwardTrace:
    """What the backward model did: dQ, dK, dV, the tiles in grid order, every scale tile read (name, tile, in
    bounds), the tensor-memory ledger of the last processed tile, the tensor-memory column map."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    tiles: list[Tile] = field(default_factory=list)
    scale_reads: list = field(default_factory=list)
    tmem: TmemLedger | None = None
    columns: dict = field(default_factory=dict)


def tmem_columns(dim: int) -> dict[str, tuple[int, int]]:
    """(first column, columns) of every tensor-memory region, as bwd_sm100.__init__ places them on FA4's 1-CTA
    aliased plan: S^T 0, dV after it, dP^T after dV, dQ over dP^T, dK after dP^T; the 8-bit P over S^T and dS over
    dP^T (a quarter of their columns); the ten 4-column scale tiles after the accumulators when they fit, else
    (D = 128) K's and Q's `hdim` tiles in dP^T past dS and the other eight in S^T past P."""
    cols_s = cols_dp = TILE
    s_off = 0
    dv_off = s_off + cols_s
    dp_off = dv_off + dim
    dk_off = dp_off + cols_dp
    cols = {"S": (s_off, cols_s), "dV": (dv_off, dim), "dP": (dp_off, cols_dp), "dQ": (dp_off, dim),
            "dK": (dk_off, dim), "P": (s_off, cols_s // 4), "dS": (dp_off, cols_dp // 4)}
    acc_end = max(s + n for s, n in cols.values())
    if acc_end + len(SF_TILES) * SF_TILE_COLS <= TMEM_ALLOC:
        sf = {name: acc_end + SF_TILE_COLS * i for i, name in enumerate(SF_TILES)}
    else:
        in_dp = ("Kh", "Qh")
        sf = {name: dp_off + cols_dp // 4 + SF_TILE_COLS * i for i, name in enumerate(in_dp)}
        sf.update({name: s_off + cols_s // 4 + SF_TILE_COLS * i
                   for i, name in enumerate(n for n in SF_TILES if n not in in_dp)})
    cols.update({f"sf{name}": (c, SF_TILE_COLS) for name, c in sf.items()})
    return cols


def serial_schedule(dim: int) -> bool:
    """bwd_sm100's `sf_serial`: the scale tiles share accumulator columns (D = 128), with `_mma_serial`."""
    cols = tmem_columns(dim)
    return cols["sfKh"][0] < cols["dK"][0] + cols["dK"][1]


def _put_sf(tile: torch.Tensor, row_in_block: torch.Tensor, row_block, col, byte: torch.Tensor) -> None:
    """bwd_sm100._put_sf: byte of row 32 * row_block + row_in_block, column col of a 512-byte 128x4 tile."""
    tile[row_in_block * 16 + row_block * 4 + col] = byte


def _atom(tile: torch.Tensor) -> torch.Tensor:
    """A 512-byte scale tile as the MMA reads it: `[128 rows, 4 K blocks]`."""
    return tile[sf_atom_offset(torch.arange(TILE)[:, None], torch.arange(4)[None, :])]


def _round_blocks(x: torch.Tensor, fixed_byte: int | None):
    """E4M3 payload values of x `[keys, queries]` and the per-32x32-block bytes `[key block, query block]`: one
    warp's 32 keys x one stage's 32 queries share a byte (its max over the warp's registers, rceil), or all take
    `fixed_byte` (const_p)."""
    if fixed_byte is not None:
        byte = torch.full((BLOCKS, BLOCKS), fixed_byte, dtype=torch.uint8)
    else:
        blocks = x.reshape(BLOCKS, MX_BLOCK, BLOCKS, MX_BLOCK)
        byte = rceil_bytes(blocks.abs().amax(dim=(1, 3)))
    full = byte.repeat_interleave(MX_BLOCK, 0).repeat_interleave(MX_BLOCK, 1)
    return mx_payload(x, full), byte


def _sf_tiles_from_blocks(byte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 128x4 tiles the compute warps write for a `[key block, query block]` byte matrix: key-major (row =
    key, column = query block) and query-major (row = query, column = key block), lane by lane as `_put_sf`."""
    key_major = torch.zeros(SF_TILE_BYTES, dtype=torch.uint8)
    query_major = torch.zeros(SF_TILE_BYTES, dtype=torch.uint8)
    lane = torch.arange(MX_BLOCK)
    for kb in range(BLOCKS):
        for qb in range(BLOCKS):
            _put_sf(key_major, lane, kb, qb, byte[kb, qb])
            _put_sf(query_major, lane, qb, kb, byte[kb, qb])
    return _atom(key_major), _atom(query_major)


def _causal_keep(m_block: int, n_block: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """apply_mask_sm100_transposed (causal) on the threads' registers: `[keys, queries]` True where kept."""
    key = torch.arange(TILE)[:, None]
    keep = torch.zeros(TILE, TILE, dtype=torch.bool)
    e = torch.arange(2 * MX_BLOCK)  # a thread's 64 registers: stage e // 32, column e % 32
    for g in range(2):  # the two warpgroups (FA4's thread index // 128)
        thr_row_offset = 32 * g
        seqlenk_col_limit = seqlen_k - n_block * TILE - key  # [keys, 1]
        seqlenq_row_limit = seqlen_q - m_block * TILE - thr_row_offset
        row_limit_top = seqlenq_row_limit - seqlenk_col_limit
        row_limit_top = torch.where(seqlenk_col_limit <= 0, torch.full((), TILE), row_limit_top)
        r2p = row_limit_top // 64 * 32 + torch.clamp(row_limit_top % 64, max=32)  # row_to_r2p_idx(x, 32, 2)
        kept = e[None, :] >= r2p  # r2p_bitmask_above
        query = 64 * (e // 32) + 32 * g + e % 32
        keep[:, query] = kept
    return keep


def _dq_accum_offsets(dim: int) -> torch.Tensor:
    """`[128, dim]` flat offsets of a dQ tile in the accumulator, as FA4's dQ reduce writes them: stage s of
    DQ_REDUCE_NCOL columns at s * 128 * ncol, thread t (row t) 4 columns per copy (_check_accum_tile_orders)."""
    row = torch.arange(TILE)[:, None]
    col = torch.arange(dim)[None, :]
    s, j = col // DQ_REDUCE_NCOL, col % DQ_REDUCE_NCOL
    return s * TILE * DQ_REDUCE_NCOL + 4 * row + j % 4 + 512 * (j // 4)


def _accum_tile_layout(dim: int) -> torch.Tensor:
    """bwd_accum_tile.accum_tile_layout(TMEM_FRAG_1CTA, 128, dim): (rows, (4, dim / 4)) : (4, (1, 4 * rows))."""
    row = torch.arange(TILE)[:, None]
    col = torch.arange(dim)[None, :]
    return 4 * row + col % 4 + 4 * TILE * (col // 4)


def _schedule_events(ledger: TmemLedger, cols: dict, steps: int, serial: bool) -> None:
    """The tensor-memory reads and writes of one CTA in the MMA warp's issue order (`_mma_overlapped` or
    `_mma_serial`), with the compute warps' P / dS stores and the reduce warps' dQ reads at the barriers that order
    them. A region's copy is a write of its tile; an MMA reads its operands and scale tiles and writes its D."""
    w = lambda name: ledger.write(name, *cols[name])  # noqa: E731
    r = lambda *names: [ledger.read(n, *cols[n]) for n in names]  # noqa: E731

    def mma(d, *reads):
        r(*reads)
        w(d)

    def s_mma():
        w("sfKh") if serial else None
        w("sfQh")
        mma("S", "sfKh", "sfQh")

    def p_store():  # compute warps: S^T into registers, P over its first columns
        r("S")
        w("P")

    def dp_mma():
        w("sfVh") if serial else None
        w("sfdOh")
        mma("dP", "sfVh", "sfdOh")

    accumulating = set()  # dV and dK read their D from their second MMA on

    def mma_acc(d, *reads):
        mma(d, *reads, *([d] if d in accumulating else []))
        accumulating.add(d)

    def dv_mma():
        w("sfdOs")
        w("sfP")
        mma_acc("dV", "P", "sfP", "sfdOs")

    def ds_store():  # compute warps: dP^T into registers, dS over its first columns
        r("dP")
        w("dS")

    def dk_dq_mma():
        w("sfQs")
        w("sfdSt")
        w("sfdS")
        mma_acc("dK", "dS", "sfdSt", "sfQs")
        w("sfKs") if serial else None
        mma("dQ", "sfdS", "sfKs")  # A = dS from shared memory
        r("dQ")  # the dQ reduce warps

    if not serial:  # once per CTA
        for name in ("sfKh", "sfVh", "sfKs"):
            w(name)
    s_mma()
    if serial:  # dP^T(0) waits for P(0): its scales go past P
        p_store()
        dp_mma()
    else:
        dp_mma()
        p_store()
    dv_mma()
    for _ in range(steps - 1):
        if serial:
            ds_store()
            dk_dq_mma()
            s_mma()
            p_store()
            dp_mma()
        else:
            s_mma()
            ds_store()
            dk_dq_mma()
            dp_mma()
            p_store()
        dv_mma()
    ds_store()
    dk_dq_mma()
    r("dV", "dK")  # the dK / dV epilogue


def backward_trace(q, k, v, do, do_values, out, lse, dlse, scales, cu_q, cu_k, *, causal: bool, scale: float,
                   p_quant: str, dq=None, dk=None, dv=None, dq_accum: str = "fp32",
                   dq_scale_log2: int = 12) -> BackwardTrace:
    """The backward model with its trace (see `backward`)."""
    if p_quant not in ("const_p", "dynamic"):
        raise ValueError(f"p_quant must be 'const_p' or 'dynamic', got {p_quant!r}")
    heads, dim = check_payloads((("q", q), ("k", k), ("v", v), ("do", do)))
    if do_values is None or do_values.dtype != torch.bfloat16 or do_values.shape != do.shape:
        raise ValueError("do_values must be the BF16 values of do's payload and scales")
    tq, tk = q.shape[0], k.shape[0]
    grads = []
    for name, given, tokens in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tk)):
        if given is None:
            given = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
        elif given.shape != (tokens, heads, dim) or given.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be BF16 {(tokens, heads, dim)}, got {given.dtype} {tuple(given.shape)}")
        grads.append(given)
    dq, dk, dv = grads
    trace = BackwardTrace(dq, dk, dv, columns=tmem_columns(dim))
    if tq == 0 or tk == 0:
        for g in grads:
            g.zero_()
        return trace
    cq, ck = offsets_list(cu_q, "cu_q"), offsets_list(cu_k, "cu_k")
    q_tiles, k_tiles = offsets_list(scales.q_tiles, "q_tiles"), offsets_list(scales.k_tiles, "k_tiles")
    batch = len(cq) - 1
    scale_log2 = torch.tensor(scale * LOG2E, dtype=torch.float32)
    cols, serial = trace.columns, serial_schedule(dim)
    p_fixed = P_SF_BYTE if p_quant == "const_p" else None

    # FA4's preprocess (launch._bwd_preprocess): Δ, LSE in log2, the zeroed accumulator, each sequence padded to
    # whole 128-row tiles from its padded offset (offset + b * 128) // 128 * 128
    padded_rows = (tq + batch * TILE + TILE - 1) // TILE * TILE
    padded_off = [(cq[b] + b * TILE) // TILE * TILE for b in range(batch)]
    delta = torch.zeros(heads, padded_rows)
    lse_log2 = torch.zeros(heads, padded_rows)
    acc_dtype = torch.float16 if dq_accum == "fp16" else torch.float32
    accum = torch.zeros(heads, padded_rows * dim, dtype=acc_dtype)
    rows_used = torch.zeros(padded_rows, dtype=torch.int32)
    dsum = (out.to(torch.float32) * do_values.to(torch.float32)).sum(dim=2).T  # [H, Tq]
    if dlse is not None:
        dsum = dsum - dlse.to(torch.float32)
    lse_l2 = torch.where(lse == -math.inf, torch.zeros(()), lse.to(torch.float32) * torch.tensor(LOG2E, dtype=torch.float32))
    for b in range(batch):
        n, p0 = cq[b + 1] - cq[b], padded_off[b]
        tiles_q = ceil_div(n, TILE) * TILE
        assert p0 + tiles_q <= padded_rows, "FA4's padded rows of a sequence run past the accumulator"
        rows_used[p0:p0 + tiles_q] += 1
        delta[:, p0:p0 + n] = dsum[:, cq[b]:cq[b + 1]]
        lse_log2[:, p0:p0 + tiles_q] = math.inf
        lse_log2[:, p0:p0 + n] = lse_l2[:, cq[b]:cq[b + 1]]
    assert int(rows_used.max()) <= 1, "two sequences share rows of FA4's padded dQ accumulator"

    sched = make_scheduler(ck, num_head=heads, tile_m=TILE, tile_n=TILE, head_dim=dim, lpt=False)
    trace.tiles = sched.tiles()
    reads = trace.scale_reads
    written_k = torch.zeros(tk, heads, dtype=torch.bool)
    tile_write = _dq_accum_offsets(dim)
    for tile in trace.tiles:
        n_block, head, b = tile.block, tile.head, tile.batch
        seqlen_q, seqlen_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        m_min, m_max = 0, ceil_div(seqlen_q, TILE)
        if causal:
            m_min = max(m_min, (n_block * TILE + seqlen_q - seqlen_k) // TILE)
        key_rows = min(TILE, seqlen_k - n_block * TILE)
        k_start = ck[b] + n_block * TILE
        written_k[k_start:k_start + key_rows, head] = True
        if m_min >= m_max:  # no query step: the compute warps zero this key tile's dK, dV
            dk[k_start:k_start + key_rows, head] = 0
            dv[k_start:k_start + key_rows, head] = 0
            continue
        k_tile = k_tiles[b] + n_block
        kv_k = tma_rows(k, head, k_start)
        kv_v = tma_rows(v, head, k_start)
        sf_kh = scale_tile(scales.k, head, k_tile, reads, "k")
        sf_vh = scale_tile(scales.v, head, k_tile, reads, "v")
        sf_ks = scale_tile(scales.k_seq, head, k_tile, reads, "k_seq")[:dim]
        dv_acc = torch.zeros(TILE, dim)
        dk_acc = torch.zeros(TILE, dim)
        for m_block in range(m_min, m_max):
            q_tile = q_tiles[b] + m_block
            q_start = cq[b] + m_block * TILE
            qv, dov = tma_rows(q, head, q_start), tma_rows(do, head, q_start)
            prow = padded_off[b] + m_block * TILE
            # S^T = K Q^T, masked
            s = block_scaled_mma(kv_k, sf_kh, qv, scale_tile(scales.q, head, q_tile, reads, "q"))
            if causal:
                s = s.masked_fill(~_causal_keep(m_block, n_block, seqlen_q, seqlen_k), -math.inf)
            else:
                s = s.masked_fill((torch.arange(TILE) >= seqlen_k - n_block * TILE)[:, None], -math.inf)
            # P = exp2(S^T scale_log2 - LSE_log2), rounded per 32x32 block
            p = torch.exp2(fp32_fma(s, scale_log2, -lse_log2[head, prow:prow + TILE][None, :]))
            if p_fixed is not None:
                p_payload = e4m3(p * 2.0 ** CONST_P_LOG2)
                p_bytes = torch.full((BLOCKS, BLOCKS), P_SF_BYTE, dtype=torch.uint8)
            else:
                p_payload, p_bytes = _round_blocks(p, None)
            sf_p, _ = _sf_tiles_from_blocks(p_bytes)
            # dP^T = V dO^T; dS = P (dP - Δ), rounded per 32x32 block
            dp = block_scaled_mma(kv_v, sf_vh, dov, scale_tile(scales.do, head, q_tile, reads, "do"))
            ds = p * (dp - delta[head, prow:prow + TILE][None, :])
            ds_payload, ds_bytes = _round_blocks(ds, None)
            sf_dst, sf_ds = _sf_tiles_from_blocks(ds_bytes)
            # dV += P^T dO, dK += dS^T Q (A from tensor memory: rows = keys), dQ = dS K (A = dS from shared memory)
            sf_dos = scale_tile(scales.do_seq, head, q_tile, reads, "do_seq")[:dim]
            sf_qs = scale_tile(scales.q_seq, head, q_tile, reads, "q_seq")[:dim]
            dv_acc = block_scaled_mma(p_payload, sf_p, dov.T, sf_dos, dv_acc)
            dk_acc = block_scaled_mma(ds_payload, sf_dst, qv.T, sf_qs, dk_acc)
            dq_tile = block_scaled_mma(ds_payload.T, sf_ds, kv_k.T, sf_ks)
            flat = prow * dim + tile_write
            accum[head, flat] = accumulate_dq(accum[head, flat], dq_tile, scale, dq_accum, dq_scale_log2)
        # dK / dV epilogue: rows of the sequence only; dK times the softmax scale
        dk[k_start:k_start + key_rows, head] = (dk_acc * scale)[:key_rows].to(torch.bfloat16)
        dv[k_start:k_start + key_rows, head] = dv_acc[:key_rows].to(torch.bfloat16)
        ledger = TmemLedger(TMEM_ALLOC)
        _schedule_events(ledger, cols, m_max - m_min, serial)
        trace.tmem = ledger
    assert bool(written_k.all()), f"key rows no CTA writes: {torch.nonzero(~written_k)[:4].tolist()}"
    # FA4's postprocess: dQ = accumulator (read in accum_tile_layout order) times the softmax scale (FP16: 2^-s)
    tile_read = _accum_tile_layout(dim)
    for b in range(batch):
        n = cq[b + 1] - cq[b]
        for m_block in range(ceil_div(n, TILE)):
            rows = min(TILE, n - m_block * TILE)
            flat = (padded_off[b] + m_block * TILE) * dim + tile_read
            acc = finish_dq(accum[:, flat], scale, dq_accum, dq_scale_log2)  # [H, 128, D]
            start = cq[b] + m_block * TILE
            dq[start:start + rows] = acc[:, :rows].transpose(0, 1).to(torch.bfloat16)
    warn_out_of_bounds(reads, "the backward")
    return trace


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, do_values: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, scales, cu_q: torch.Tensor,
             cu_k: torch.Tensor, *, causal: bool, scale: float, p_quant: str, dq=None, dk=None, dv=None,
             dq_accum: str = "fp32", dq_scale_log2: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`launch._mx_backward_sm100` on CPU tensors: dQ, dK, dV BF16 `[T, H, D]` of the kernel's schedule (written
    into `dq`, `dk`, `dv` when given). q, k, do: `square` E4M3 payloads, v `hdim`; `scales`: `launch.MXBwdScales`;
    `do_values` dO's BF16 values, `out` the forward's O (BF16), `lse` `[H, Tq]`, `dlse` its gradient or None.
    `dq_accum="fp16"` models the dQ accumulator of the recipe's FP16 option (`MXRecipe.dq_accum`, scale
    2^`dq_scale_log2`) in place of FA4's FP32 one; the kernel has only the FP32 one."""
    trace = backward_trace(q, k, v, do, do_values, out, lse, dlse, scales, cu_q, cu_k, causal=causal, scale=scale,
                           p_quant=p_quant, dq=dq, dk=dk, dv=dv, dq_accum=dq_accum, dq_scale_log2=dq_scale_log2)
    return trace.dq, trace.dk, trace.dv
