"""The RMSNorm module."""
from __future__ import annotations

import torch
from torch import nn

from gem_lp.norm.ops import PRECISIONS, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, weight `[dim]` ones at init; output in the input dtype. `recipe`: "fp32" (FP32
    math, the default) or "bf16" (the BF16 recipe's norm, see `rms_norm`'s `precision`)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, recipe: str = "fp32", backend: str = "auto"):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if recipe not in PRECISIONS:
            raise ValueError(f"recipe must be one of {PRECISIONS}, got {recipe!r}")
        self.dim, self.eps, self.recipe, self.backend = dim, eps, recipe, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, precision=self.recipe, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + ("" if self.recipe == "fp32" else f", recipe={self.recipe!r}")
