"""Jagged packing of per-user prefix tokens in front of each user's history (plain torch ops, any device)."""
from __future__ import annotations

import torch


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int64 `[B + 1]` offsets of int `[B]` lengths (torch ops only, so it runs on CUDA without fbgemm)."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    offsets = lengths.new_zeros(lengths.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.to(torch.int64), 0)
    return offsets


def prepend_tokens(prefix: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor):
    """Pack `[prefix_b ⊕ values_b]` per sequence into one jagged tensor.

    Args:
        prefix: `[B, K, D]`, K tokens per sequence.
        values: `[T, D]` packed jagged values, sequence b at rows `offsets[b]:offsets[b+1]`.
        lengths: int `[B]` with `sum(lengths) == T`.
    Returns:
        packed `[B*K + T, D]` (sequence b: its K prefix tokens then its values),
        packed_offsets int64 `[B + 1]`, and value_rows int64 `[T]`: the row of each value in `packed`
        (so `packed[value_rows]` gives the values back and `packed[prefix_rows]` the prefix, with
        `prefix_rows = packed_offsets[:-1, None] + arange(K)`).
    """
    if prefix.dim() != 3 or values.dim() != 2 or prefix.shape[2] != values.shape[1]:
        raise ValueError(f"prefix must be [B, K, D] and values [T, D] with the same D, got "
                         f"{tuple(prefix.shape)} and {tuple(values.shape)}")
    if lengths.shape != (prefix.shape[0],):
        raise ValueError(f"lengths must be [B] = [{prefix.shape[0]}], got {tuple(lengths.shape)}")
    if prefix.dtype != values.dtype:
        raise TypeError(f"prefix and values must share a dtype, got {prefix.dtype} and {values.dtype}")
    b, k, _ = prefix.shape
    t = values.shape[0]
    device = values.device
    offsets = lengths_to_offsets(lengths)
    packed_offsets = offsets + k * torch.arange(b + 1, device=device)
    seq_of_value = torch.repeat_interleave(torch.arange(b, device=device), lengths, output_size=t)
    value_rows = torch.arange(t, device=device) + k * (seq_of_value + 1)
    prefix_index = prefix_rows(packed_offsets, k).reshape(-1)
    # source row of each packed row: prefix rows come first in `cat`, values after them
    source = torch.empty(b * k + t, dtype=torch.int64, device=device)
    source[prefix_index] = torch.arange(b * k, device=device)
    source[value_rows] = torch.arange(b * k, b * k + t, device=device)
    packed = torch.cat([prefix.reshape(b * k, -1), values])[source]
    return packed, packed_offsets, value_rows


def prefix_rows(packed_offsets: torch.Tensor, k: int) -> torch.Tensor:
    """int64 `[B, K]` rows of the K prefix tokens of each sequence in a `prepend_tokens` result."""
    return packed_offsets[:-1, None] + torch.arange(k, device=packed_offsets.device)
