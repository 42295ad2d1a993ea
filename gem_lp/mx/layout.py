"""The 128x4 blocked scale layout of cuBLAS, tcgen05 block-scaled MMA, TransformerEngine and torchao.

A `[rows, cols]` matrix of scale bytes is padded with byte 0 to rows % 128 == 0 and cols % 4 == 0,
cut into 128x4 tiles stored row-tile major with column tiles fastest, 512 contiguous bytes per tile;
inside a tile, scale (r, c) sits at `(r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)`.
"""
from __future__ import annotations

import torch

from gem_lp.mx.formats import ceil_div


def blocked_size(rows: int, cols: int) -> int:
    """Number of bytes of the blocked layout of a `[rows, cols]` scale matrix (padding included)."""
    return ceil_div(rows, 128) * ceil_div(cols, 4) * 512


def blocked_index(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Byte offset of scale `(r, c)` in the blocked layout of a matrix with `cols` columns."""
    n_col_blocks = ceil_div(cols, 4)
    return ((r // 128) * n_col_blocks + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Blocked layout of a 2-D scale matrix, flat `uint8` of `blocked_size(rows, cols)` bytes.

    Byte-identical to torchao's `to_blocked` (which also returns a flat tensor).
    """
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"scale must be uint8 (E8M0 bytes), got {scale.dtype}")
    scale = scale.view(torch.uint8)
    rows, cols = scale.shape
    n_rb, n_cb = ceil_div(rows, 128), ceil_div(cols, 4)
    padded = scale.new_zeros(n_rb * 128, n_cb * 4)
    padded[:rows, :cols] = scale
    # [rb, 4 (r%128//32), 32 (r%32), cb, 4 (c%4)] -> [rb, cb, 32, 4, 4]
    tiles = padded.view(n_rb, 4, 32, n_cb, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).contiguous()


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocked`: the `[rows, cols]` scale matrix (padding dropped)."""
    if blocked.dim() != 1 or blocked.numel() != blocked_size(rows, cols):
        raise ValueError(
            f"blocked must be a flat tensor of {blocked_size(rows, cols)} bytes for a "
            f"[{rows}, {cols}] scale matrix, got shape {tuple(blocked.shape)}"
        )
    n_rb, n_cb = ceil_div(rows, 128), ceil_div(cols, 4)
    tiles = blocked.view(torch.uint8).view(n_rb, n_cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(n_rb * 128, n_cb * 4)[:rows, :cols].contiguous()
