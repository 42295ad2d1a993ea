"""TorchRec bridge: `JaggedTensor` / `KeyedJaggedTensor` <-> `(values, offsets)` as `quantize_jagged` takes them.

Offsets missing from a TorchRec tensor are computed with `torch.cumsum` rather than TorchRec's fbgemm
helper, so the bridge also works where fbgemm is a CPU-only build and the tensors live on CUDA.
"""
from __future__ import annotations

import torch

from gem_lp.jagged.metadata import check_offsets_form


def _torchrec():
    try:
        from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
    except ImportError as e:  # torchrec is installed with --no-deps; say what is missing
        raise ImportError(f"the TorchRec bridge needs torchrec (and fbgemm-gpu or fbgemm-gpu-cpu): {e}") from e
    return JaggedTensor, KeyedJaggedTensor


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """`[B+1]` offsets (same dtype and device as `lengths [B]`), starting at 0."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0, dtype=lengths.dtype)])


def _offsets_of(offsets: torch.Tensor | None, lengths: torch.Tensor | None, what: str) -> torch.Tensor:
    if offsets is not None:
        return offsets
    if lengths is None:
        raise ValueError(f"{what} has neither offsets nor lengths")
    return offsets_from_lengths(lengths)


def from_jagged_tensor(jt, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, offsets)` of a TorchRec `JaggedTensor`, without copying the values.

    Args:
        jt: `torchrec.JaggedTensor`, e.g. one feature of an `EmbeddingCollection` output, values `[T, E]`.
        heads: when given, the embedding dim is split into heads: values become a `[T, heads, E/heads]`
            view (E must be divisible by heads). None returns the values unchanged.

    Returns:
        `values` and `offsets [B+1]` (the JaggedTensor's own offsets, or a cumsum of its lengths).
    """
    JaggedTensor, _ = _torchrec()
    if not isinstance(jt, JaggedTensor):
        raise TypeError(f"jt must be a torchrec JaggedTensor, got {type(jt).__name__}")
    values = jt.values()
    offsets = _offsets_of(jt.offsets_or_none(), jt.lengths_or_none(), "jt")
    if heads is None:
        return values, offsets
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if values.dim() != 2:
        raise ValueError(f"heads needs jt.values() of shape [T, E] (embeddings), got {tuple(values.shape)}")
    t, e = values.shape
    if e % heads:
        raise ValueError(f"the embedding dim E = {e} of jt.values() is not divisible by heads = {heads}")
    return values.view(t, heads, e // heads), offsets


def to_jagged_tensor(values: torch.Tensor, offsets: torch.Tensor):
    """A TorchRec `JaggedTensor` over `values [T, ...]` (not copied) with `offsets [B+1]`.

    Only the form of `offsets` is checked here (1-D int32/int64 on the values' device); build a
    `JaggedLayout` to check its contents.
    """
    JaggedTensor, _ = _torchrec()
    check_offsets_form(offsets, values)
    return JaggedTensor(values=values, offsets=offsets)


def from_kjt(kjt, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, offsets)` of one feature of a `KeyedJaggedTensor`.

    The values are a slice (view) of the KJT's values, `[T_key, ...]`; the offsets `[B+1]` restart at 0.
    """
    _, KeyedJaggedTensor = _torchrec()
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"kjt must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}")
    keys = kjt.keys()
    if key not in keys:
        raise KeyError(f"key {key!r} is not a feature of kjt; its keys are {keys}")
    index = keys.index(key)
    lengths_start = kjt.lengths_offset_per_key()
    lo, hi = lengths_start[index], lengths_start[index + 1]
    all_offsets = _offsets_of(kjt.offsets_or_none(), kjt.lengths_or_none(), "kjt")
    key_offsets = all_offsets[lo:hi + 1]
    start = kjt.offset_per_key()[index]
    end = kjt.offset_per_key()[index + 1]
    return kjt.values()[start:end], key_offsets - key_offsets[0]
