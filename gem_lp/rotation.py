"""`qk_rotation`: Q and K rotated by one orthonormal Walsh-Hadamard matrix over the head dim.

(Q H)(K H)^T = Q H H^T K^T = Q K^T, so attention is unchanged in exact arithmetic, while an outlier
channel of Q or K is spread evenly over all D channels: no 32-element MX block then holds a value far
above its neighbours (docs/numerics.md, "Outlier channels"). The rotation is plain differentiable torch,
applied by `jagged_attention` before any backend runs; autograd rotates dQ and dK back (H is symmetric).

The transform is a matmul with a cached D x D matrix, faster than a log2(D)-stage butterfly of adds at these
head dims.
"""
from __future__ import annotations

import functools
import math

import torch

QK_ROTATIONS = (None, "hadamard")


def check_qk_rotation(qk_rotation, head_dim: int) -> None:
    """`qk_rotation` is None or "hadamard", and "hadamard" needs a power-of-two head dim."""
    if qk_rotation not in QK_ROTATIONS:
        raise ValueError(f"qk_rotation must be None or 'hadamard', got {qk_rotation!r}")
    if qk_rotation == "hadamard" and (head_dim < 1 or head_dim & (head_dim - 1)):
        raise ValueError(f"qk_rotation='hadamard' needs a head dim that is a power of two (e.g. 64 or 128), "
                         f"got D={head_dim}")


@functools.lru_cache(maxsize=None)
def hadamard_matrix(dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester Walsh-Hadamard matrix `[dim, dim]` (entries +-1/sqrt(dim), symmetric,
    its own inverse); `dim` a power of two. Cached per (dim, dtype, device): never write to it."""
    check_qk_rotation("hadamard", dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(dtype=dtype, device=device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x `[..., D]` times the orthonormal Hadamard matrix over its last dim, differentiable.

    Computed in FP32 (FP64 for FP64 input), autocast or not, and rounded once to x's dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(x.shape[-1], compute, x.device)
    with torch.autocast(x.device.type, enabled=False):  # like the attention ops: autocast never reaches it
        return (x.to(compute) @ h).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, qk_rotation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[T, H, D]` rotated over D by `qk_rotation` (None: returned as they are)."""
    if qk_rotation is None:
        return q, k
    return hadamard_transform(q), hadamard_transform(k)
