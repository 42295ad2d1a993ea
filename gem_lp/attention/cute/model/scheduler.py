"""FlashAttention-4's varlen tile map, as the sm_100a kernels' schedulers compute it on the device.

Both MXFP8 kernels run FA4's `SingleTileVarlenScheduler` (flash_attn/cute/tile_scheduler.py) with the static
scheduling mode: one CTA per grid index, the grid `total_blocks_max * num_head` wide, and each CTA decodes its index
into (block, head, batch) with `VarlenDecoder.decode`: a warp-wide prefix sum of the per-batch tile counts over
groups of 31 batches (lane 31 holds no batch), a ballot to find the batch inside the group, then the head and the
block from the index's offset in that batch's range. Above `CU_TILES_ABOVE` sequences the launcher passes FA4's
cumulative tile counts (`_compute_tile_cumsum`), and the decoder first finds the batch's group by a binary search
(`utils.get_batch_from_cu_tensor`) instead of walking the groups. The forward runs it over query tiles (causal:
`lpt`, heads in L2-sized sections and blocks longest-first), the backward over key tiles (no `lpt`).
"""
from __future__ import annotations

from dataclasses import dataclass

# FA4's `interface.BIN_BATCH_SEARCH_THRESH`: above this many sequences the launchers pass cumulative tile counts
CU_TILES_ABOVE = 256
WARP = 32
# FA4's VarlenDecoder.create: K and V bytes that fit L2 (its LPT head sections)
L2_BYTES = 50 * 1024 * 1024


@dataclass(frozen=True)
class Tile:
    """One valid work tile: `block` (query tile for the forward, key tile for the backward), `head`, `batch`."""

    block: int
    head: int
    batch: int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tile_cumsum(cu_seqlens: list[int], tile: int) -> list[int]:
    """FA4's `_compute_tile_cumsum` (`CuSeqlensToBlocksKernel`): [B+1] exclusive cumulative ceil(L_b / tile)."""
    out = [0]
    for b in range(len(cu_seqlens) - 1):
        out.append(out[-1] + ceil_div(cu_seqlens[b + 1] - cu_seqlens[b], tile))
    return out


def batch_from_cu(idx: int, cu: list[int]) -> int:
    """`utils.get_batch_from_cu_tensor`: the binary search for the batch whose range of `cu` holds `idx`."""
    lo, hi = 0, len(cu) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cu[mid + 1] <= idx:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class VarlenScheduler:
    """`SingleTileVarlenScheduler` with one Q stage, no split-KV, no cluster, no PackGQA (what both kernels build).

    `cu_seqlens` are the offsets the scheduler tiles (the forward's query offsets, the backward's key offsets),
    `tile_m` its tile along them (`cta_tiler[0]`), `tile_n` the other tile (used only by the LPT head sections),
    `kv_block_bytes` FA4's K + V bytes of one tile for those sections, `lpt` FA4's longest-processing-time order,
    `cu_tiles` the cumulative tile counts the launcher passes above `CU_TILES_ABOVE` sequences (else None)."""

    cu_seqlens: tuple[int, ...]
    num_head: int
    tile_m: int
    tile_n: int
    kv_block_bytes: int
    lpt: bool
    cu_tiles: tuple[int, ...] | None

    @property
    def num_batch(self) -> int:
        return len(self.cu_seqlens) - 1

    def grid(self) -> int:
        """`get_grid_shape`: CTAs along x (the other two grid dims are 1)."""
        total = self.cu_seqlens[-1]
        total_blocks_max = (total + self.num_batch * (self.tile_m - 1)) // self.tile_m
        return total_blocks_max * self.num_head

    def _num_blocks(self, batch: int) -> int:
        """`VarlenDecoder._num_m_blocks` of one lane: 0 past the last batch."""
        if batch >= self.num_batch:
            return 0
        return ceil_div(self.cu_seqlens[batch + 1] - self.cu_seqlens[batch], self.tile_m)

    def _group(self, start: int) -> list[int]:
        """Inclusive prefix sums of the tile counts of batches start .. start + 30 (lanes 0-30; lane 31 counts 0)."""
        counts = [self._num_blocks(start + lane) if lane < WARP - 1 else 0 for lane in range(WARP)]
        sums, acc = [], 0
        for c in counts:
            acc += c
            sums.append(acc)
        return sums

    def decode(self, tile_idx: int) -> Tile | None:
        """`VarlenDecoder.decode` of grid index `tile_idx` (None: the CTA has no tile)."""
        h = self.num_head
        start, group_start_tile = 0, 0
        if self.cu_tiles is not None:  # the cumulative-tiles path: jump to the batch's group
            lo = batch_from_cu(tile_idx // h, list(self.cu_tiles))
            start = lo // (WARP - 1) * (WARP - 1)
            group_start_tile = self.cu_tiles[start] * h
        sums = self._group(start)
        in_group = sums[-1]
        group_end_tile = in_group * h + group_start_tile
        batch = start
        while group_end_tile <= tile_idx:
            batch += WARP - 1
            if batch >= self.num_batch:
                return None
            sums = self._group(batch)
            in_group = sums[-1]
            group_end_tile += in_group * h
        group_start_tile = group_end_tile - in_group * h
        lane = sum(1 for s in sums if group_start_tile + s * h <= tile_idx)  # popc(ballot)
        batch += lane
        if batch >= self.num_batch:
            return None
        group_start_tile += (sums[lane - 1] if lane > 0 else 0) * h
        num_blocks = self._num_blocks(batch)
        mh_block = tile_idx - group_start_tile
        if self.lpt:
            num_n_blocks = num_blocks * self.tile_m // self.tile_n
            max_kv = L2_BYTES // self.kv_block_bytes
            nheads_in_l2 = next((n for n in (16, 8, 4, 2) if num_n_blocks * n <= max_kv), 1)
            nheads_in_l2 = min(nheads_in_l2, h)
            mh_in_l2 = nheads_in_l2 * num_blocks
            section = mh_block // mh_in_l2
            l2_mod = mh_block - section * mh_in_l2
            heads_here = nheads_in_l2 if nheads_in_l2 * (section + 1) <= h else h - section * nheads_in_l2
            block = l2_mod // heads_here
            head = section * nheads_in_l2 + l2_mod - block * heads_here
            block = num_blocks - 1 - block
        else:
            head = mh_block // num_blocks
            block = mh_block - head * num_blocks
        return Tile(block, head, batch)

    def tiles(self) -> list[Tile]:
        """Every CTA's tile in grid order (CTAs without one dropped); checks that each (block, head, batch) of
        the batch exists exactly once."""
        got = [t for t in (self.decode(i) for i in range(self.grid())) if t is not None]
        want = {Tile(blk, hd, b) for b in range(self.num_batch) for hd in range(self.num_head)
                for blk in range(self._num_blocks(b))}
        if len(got) != len(set(got)) or set(got) != want:
            missing, extra = want - set(got), set(got) - want
            raise AssertionError(f"FA4's varlen tile map: {len(got)} tiles for {len(want)}, missing "
                                 f"{sorted(missing, key=str)[:4]}, unexpected {sorted(extra, key=str)[:4]}")
        return got


def make_scheduler(cu_seqlens: list[int], *, num_head: int, tile_m: int, tile_n: int, head_dim: int, lpt: bool,
                   element_bytes: int = 1) -> VarlenScheduler:
    """The scheduler the launchers build: cumulative tile counts above `CU_TILES_ABOVE` sequences
    (`launch._cu_tiles`), FA4's K + V tile bytes for the LPT sections (`VarlenDecoder.create`)."""
    cu = tuple(int(c) for c in cu_seqlens)
    cu_tiles = tuple(tile_cumsum(list(cu), tile_m)) if len(cu) - 1 > CU_TILES_ABOVE else None
    kv_block_bytes = 2 * head_dim * element_bytes * tile_n
    return VarlenScheduler(cu, num_head, tile_m, tile_n, kv_block_bytes, lpt, cu_tiles)
