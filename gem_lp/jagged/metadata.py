"""Jagged batch metadata: offsets, lengths and the per-sequence 128-padded scale rows.

A jagged batch packs B sequences into `values [T, H, D]`; sequence b holds tokens
`offsets[b] .. offsets[b+1] - 1` (TorchRec-style `offsets [B+1]`, int32 or int64, `offsets[0] == 0`).
Scales are padded per sequence to a multiple of 128 rows:

    scale_offsets[b] = sum_{i<b} ceil(L_i / 128) * 128      (int64, [B+1]);   Tp = scale_offsets[B]

and token t of sequence b sits on padded row `scale_offsets[b] + (t - offsets[b])`. Every 128-row tile of
the padded rows belongs to exactly one sequence, which is what lets one kernel launch cover a whole batch.
"""
from __future__ import annotations

import dataclasses

import torch

SCALE_ROW_TILE = 128  # padded scale rows per tile: the row tile of the 128x4 blocked layout
OFFSET_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class JaggedLayout:
    """Offsets and padded-scale metadata of one jagged batch.

    Attributes:
        offsets: `[B+1]` int32/int64 (the caller's tensor and dtype), `offsets[0] == 0`, non-decreasing.
        lengths: `[B]`, same dtype and device as `offsets`, `offsets[1:] - offsets[:-1]`.
        scale_offsets: `[B+1]` int64, first padded scale row of each sequence (see module docstring).
        max_len: longest sequence (0 for an empty batch).
        total: T, the number of packed tokens (`offsets[-1]`).
        padded_total: Tp, the number of padded scale rows (`scale_offsets[-1]`, a multiple of 128; a `bounded`
            layout allocates more: its tiles past the last sequence hold only zero scale bytes).
        tile_seq: `[Tp/128]` int32, the sequence owning each 128-row tile (see `tile_sequences`).
        tile_tokens: `[Tp/128, 2]` int64, per tile: the packed token its first padded row stands for
            (`offsets[b] + 128 * tile - scale_offsets[b]` of its sequence b) and the end of that sequence
            (`offsets[b+1]`); see `tile_token_table`.
    """

    offsets: torch.Tensor
    lengths: torch.Tensor
    scale_offsets: torch.Tensor
    max_len: int
    total: int
    padded_total: int
    tile_seq: torch.Tensor
    tile_tokens: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tiles(self) -> int:
        """Number of 128-row tiles of padded scale rows (`Tp / 128`)."""
        return self.padded_total // SCALE_ROW_TILE

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @classmethod
    def from_offsets(
        cls,
        offsets: torch.Tensor,
        values: torch.Tensor | None = None,
        *,
        total: int | None = None,
        max_len: int | None = None,
        padded_total: int | None = None,
        validate: bool | None = None,
    ) -> "JaggedLayout":
        """Build and check the layout of `offsets` (and of `values [T, ...]` when given).

        At most one host sync for the whole batch: it reads max_len, Tp and the values that the checks
        need in a single transfer. Pass `max_len` and `padded_total` (and `total` when `values` is None)
        to build the layout with no sync at all: the contents of `offsets` are then not checked (the
        caller vouches for them and for the ints) unless `validate=True`, which spends the sync on
        checking them all. `validate=None` (default) checks whenever the sync happens anyway.

        Raises:
            TypeError / ValueError naming `offsets` (or `values`, `max_len`, `padded_total`, `total`)
            when the offsets are not 1-D int32/int64 on the values' device, do not start at 0,
            decrease, or do not end at `values.shape[0]`.
        """
        check_offsets_form(offsets, values)
        if values is not None:
            if total is not None and total != values.shape[0]:
                raise ValueError(f"total={total} disagrees with values.shape[0]={values.shape[0]}")
            total = values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        padded = (lengths.to(torch.int64) + (SCALE_ROW_TILE - 1)) // SCALE_ROW_TILE * SCALE_ROW_TILE
        scale_offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])

        if validate is None:
            validate = max_len is None or padded_total is None or total is None
        if validate or max_len is None or padded_total is None or total is None:
            total, max_len, padded_total = _check_and_read(
                offsets, lengths, scale_offsets, values is not None,
                total=total, max_len=max_len, padded_total=padded_total)
        else:
            _check_ints(total=total, max_len=max_len, padded_total=padded_total)
        tiles = tile_sequences(scale_offsets, int(padded_total) // SCALE_ROW_TILE)
        return cls(offsets, lengths, scale_offsets, int(max_len), int(total), int(padded_total), tiles,
                   tile_token_table(offsets, scale_offsets, tiles))


    @classmethod
    def bounded(cls, offsets: torch.Tensor, total: int, max_len: int) -> "JaggedLayout":
        """The layout with no host sync, as a CUDA graph can capture it: scale rows for the worst case of B sequences
        over `total` tokens, `(ceil(total / 128) + B) * 128` (a sequence's padding is less than one 128-row tile),
        the tiles past the last sequence's padding holding zero scale bytes. Addressed by `scale_offsets`, the scales
        of every sequence are where `from_offsets` puts them. The offsets are taken unchecked (the caller vouches
        for them, and that no sequence is longer than `max_len`)."""
        check_offsets_form(offsets)
        _check_ints(total=total, max_len=max_len)
        batch = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        padded = (lengths.to(torch.int64) + (SCALE_ROW_TILE - 1)) // SCALE_ROW_TILE * SCALE_ROW_TILE
        scale_offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
        padded_total = ((total + SCALE_ROW_TILE - 1) // SCALE_ROW_TILE + batch) * SCALE_ROW_TILE if batch else 0
        tiles = tile_sequences(scale_offsets, padded_total // SCALE_ROW_TILE).clamp_(max=max(batch - 1, 0))
        return cls(offsets, lengths, scale_offsets, int(max_len), int(total), int(padded_total), tiles,
                   tile_token_table(offsets, scale_offsets, tiles))


def check_offsets_form(offsets: torch.Tensor, values: torch.Tensor | None = None, name: str = "offsets") -> None:
    """The checks that need no host sync: type, rank, dtype, size and (with `values`) device of `offsets`;
    errors name the argument `name`."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B+1] of int32/int64, got {type(offsets).__name__}")
    if offsets.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.numel() == 0:
        raise ValueError(f"{name} must have B+1 >= 1 elements (an empty batch is [0]), got 0")
    if values is not None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor [T, ...], got {type(values).__name__}")
        if values.dim() == 0:
            raise ValueError("values must have a leading token dimension [T, ...], got a 0-d tensor")
        if offsets.device != values.device:
            raise ValueError(
                f"{name} must be on the same device as values: {name} on {offsets.device}, "
                f"values on {values.device}"
            )


def _check_ints(**named: int | None) -> None:
    for name, v in named.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


def _check_and_read(offsets, lengths, scale_offsets, have_values: bool, **given: int | None) -> tuple[int, int, int]:
    """One host sync: read first/last offset, min/max length and Tp together, check them against the
    given ints, and return `(total, max_len, padded_total)`."""
    _check_ints(**given)
    zero = offsets.new_zeros(1)
    stats = torch.stack([
        offsets[0].to(torch.int64),
        torch.cat([lengths, zero]).min().to(torch.int64),
        offsets[-1].to(torch.int64),
        torch.cat([lengths, zero]).max().to(torch.int64),
        scale_offsets[-1],
    ]).tolist()
    first, min_len, last, max_len, padded_total = stats
    if first != 0:
        raise ValueError(f"offsets must start at 0, got offsets[0] = {first}")
    if min_len < 0:
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(
            f"offsets must be non-decreasing, got offsets[{bad}] = {int(offsets[bad])} > "
            f"offsets[{bad + 1}] = {int(offsets[bad + 1])}"
        )
    what = "values.shape[0]" if have_values else "total"
    if given["total"] is not None and last != given["total"]:
        raise ValueError(f"offsets must end at {what} = {given['total']}, got offsets[-1] = {last}")
    for name, actual in (("max_len", max_len), ("padded_total", padded_total)):
        if given[name] is not None and given[name] != actual:
            raise ValueError(f"{name}={given[name]} disagrees with the offsets, which give {actual}")
    return last, max_len, padded_total


def tile_sequences(scale_offsets: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """`[num_tiles]` int32 owner sequence of each 128-row tile: the last b with scale_offsets[b] <= row.

    `right=True` skips zero-length sequences, whose scale offset equals the next sequence's.
    """
    starts = torch.arange(num_tiles, device=scale_offsets.device, dtype=torch.int64) * SCALE_ROW_TILE
    return (torch.searchsorted(scale_offsets, starts, right=True) - 1).to(torch.int32)


def tile_token_table(offsets: torch.Tensor, scale_offsets: torch.Tensor, tile_seq: torch.Tensor) -> torch.Tensor:
    """`[num_tiles, 2]` int64: per 128-row tile, the packed token of its first padded row (as if every padded row
    of its sequence b were a token: `offsets[b] + 128 * tile - scale_offsets[b]`, past the sequence's end for a
    tile of padding rows) and the end of its sequence (`offsets[b+1]`). A kernel program then finds its tokens
    with one lookup instead of `tile_seq` followed by `offsets` and `scale_offsets`. On device, no host sync."""
    b = tile_seq.to(torch.int64)
    offsets = offsets.to(torch.int64)
    starts = torch.arange(b.numel(), device=b.device, dtype=torch.int64) * SCALE_ROW_TILE
    return torch.stack([offsets[b] + starts - scale_offsets[b], offsets[b + 1]], dim=1).contiguous()
