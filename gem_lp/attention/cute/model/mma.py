"""What the sm_100a kernels' MMA warps do with scale tiles and tensor memory, on CPU tensors.

* `scale_tile`: the 512 bytes the MMA warp copies for one (head, tile) (`sm100_mma.load_scale_tile`: 32 lanes x
  four 32-bit words at word `tile * 128 + lane * 4 + j` of the head's `[H, bytes / 4]` view), seen as the MMA sees
  them: row m, K block k at byte `(m % 32) * 16 + (m // 32) * 4 + k` (the shared-memory scale-factor layout
  `blockscaled_utils.make_smem_layout_sfa/sfb` builds for these MMAs, `((((32,4),1),(32,1)),1,4):((((16,4),0),
  (0,0)),0,1)`, which `tcgen05.cp ... 32x128b.warpx4` copies to tensor memory unchanged).
* `block_scaled_mma`: one `tcgen05.mma.kind::mxf8f6f4.block_scale.block32` per 32-element K block, emulated as exact
  products of dequantized E4M3 values times 2^(byte - 127) (summed in FP64, exact for a 32-term block of such
  products unless it underflows) rounded to FP32 per block, the blocks accumulated in FP32 in K order.
* `TmemLedger`: tensor-memory columns by owner, in the order the kernel issues its MMAs and copies, to check that
  every region stays inside the allocation and that nothing overwrites a region before its last reader.
"""
from __future__ import annotations

import torch

SF_TILE_BYTES = 512
TILE_ROWS = 128
MX_BLOCK = 32
E8M0_NAN = 255


def sf_atom_offset(row: torch.Tensor, kblock: torch.Tensor) -> torch.Tensor:
    """Byte of (row, K block) inside a 128x4 scale atom: the blocked layout of docs/numerics.md within one tile."""
    return (row % 32) * 16 + (row // 32) * 4 + kblock


def scale_tile(sf: torch.Tensor, head: int, tile: int, reads: list | None = None, name: str = "",
               clamp: bool = False) -> torch.Tensor:
    """`[128, 4]` uint8: the scale bytes by (row, K block) of tile `tile` of head `head` of `sf` `[H, bytes]`, read
    as the kernel reads them (words `tile * 128 + lane * 4 + j`). `clamp`: the tile index is kept inside the buffer
    (`sm100_mma.load_scale_tile(clamp=True)`, the forward's). `reads` collects (name, tile, in bounds) for the
    out-of-bounds checks; a tile outside the buffer reads as NaN scales (byte 255), its bytes being undefined."""
    nbytes = sf.shape[1]
    if clamp:
        tile = min(max(tile, 0), nbytes // SF_TILE_BYTES - 1)
    inside = 0 <= tile and (tile + 1) * SF_TILE_BYTES <= nbytes
    if reads is not None:
        reads.append((name, tile, inside))
    if not inside:
        return torch.full((TILE_ROWS, 4), E8M0_NAN, dtype=torch.uint8)
    lane = torch.arange(32)[:, None]
    word = tile * (SF_TILE_BYTES // 4) + lane * 4 + torch.arange(4)[None, :]  # [lane, j]
    raw = sf[head].view(torch.int32)[word].contiguous().view(torch.uint8).reshape(SF_TILE_BYTES)
    rows = torch.arange(TILE_ROWS)[:, None]
    return raw[sf_atom_offset(rows, torch.arange(4)[None, :])]


def e8m0_value(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) in FP64 (byte 255: NaN), the hardware's reading of an E8M0 scale factor."""
    b = byte.to(torch.float64)
    return torch.where(byte == E8M0_NAN, torch.nan, torch.exp2(b - 127.0))


def block_scaled_mma(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                     acc: torch.Tensor | None = None) -> torch.Tensor:
    """acc (+)= A B^T over K blocks of 32: `a` `[M, K]` and `b` `[N, K]` the E4M3 payload values (any float dtype
    holding them exactly), `sfa` `[M, K / 32]`, `sfb` `[N, K / 32]` uint8 scale bytes. Returns FP32 `[M, N]`."""
    m, k = a.shape
    n, blocks = b.shape[0], k // MX_BLOCK
    a_blk = a.to(torch.float64).reshape(m, blocks, MX_BLOCK) * e8m0_value(sfa[:, :blocks])[:, :, None]
    b_blk = b.to(torch.float64).reshape(n, blocks, MX_BLOCK) * e8m0_value(sfb[:, :blocks])[:, :, None]
    partial = torch.einsum("mbk,nbk->bmn", a_blk, b_blk).to(torch.float32)  # one MMA instruction per block
    out = torch.zeros(m, n, dtype=torch.float32) if acc is None else acc
    for kb in range(blocks):  # FP32 accumulation in issue order
        out = out + partial[kb]
    return out


class TmemLedger:
    """Tensor-memory columns by the region that last wrote them, checked as the kernel issues its operations.

    `write(name, start, cols)` makes `name` the owner of those columns; `read(name, start, cols)` asserts that
    `name` still owns all of them (nothing else wrote there since). Both assert the columns lie in
    `[0, alloc)`. `events` records what happened, for the tests and for reading."""

    def __init__(self, alloc: int, max_cols: int = 512):
        assert 0 < alloc <= max_cols, f"tcgen05.alloc of {alloc} columns (at most {max_cols})"
        self.alloc = alloc
        self.owner: list[str | None] = [None] * alloc
        self.events: list[tuple[str, str, int, int]] = []

    def _span(self, name: str, start: int, cols: int) -> range:
        assert 0 <= start and start + cols <= self.alloc, (
            f"{name}: tensor-memory columns {start}-{start + cols - 1} outside the {self.alloc} allocated")
        return range(start, start + cols)

    def write(self, name: str, start: int, cols: int) -> None:
        for c in self._span(name, start, cols):
            self.owner[c] = name
        self.events.append(("write", name, start, cols))

    def read(self, name: str, start: int, cols: int) -> None:
        clobbered = {self.owner[c] for c in self._span(name, start, cols)} - {name}
        assert not clobbered, (f"{name} (columns {start}-{start + cols - 1}) read after {sorted(map(str, clobbered))} "
                               f"overwrote it")
        self.events.append(("read", name, start, cols))
