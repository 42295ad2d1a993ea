"""Argument checks shared by the ops: each raises naming the argument and the expected form."""
from __future__ import annotations

import math

import torch

from gem_lp.mx.formats import INPUT_DTYPES


def check_float(t: torch.Tensor, name: str, dims: int | None = None, what: str = "") -> None:
    """`t` is a float32/bfloat16/float16 tensor (of `dims` dims when given; `what` describes its shape)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{what}, got {type(t).__name__}")
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D{what}, got shape {tuple(t.shape)}")


def check_same_device(x: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def check_eps(eps: float) -> None:
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def check_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_name: str = "weight") -> None:
    """RMSNorm's arguments: `x [..., K]`, `weight [K]` on x's device, `eps` finite and >= 0."""
    check_float(x, "x", what=" [..., K]")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    check_float(weight, weight_name, 1, " [K]")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{weight_name} must be [K={x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    check_same_device(x, **{weight_name: weight})
    check_eps(eps)
