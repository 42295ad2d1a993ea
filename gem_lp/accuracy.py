"""Accuracy figures of a low-precision result against an FP32 reference (docs/numerics.md, "Accuracy conventions").

Both work on the flattened tensors in FP64 so that the figure itself adds no rounding of note.
"""
from __future__ import annotations

import math

import torch


def _flat64(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError(f"out and ref must be tensors, got {type(out).__name__} and {type(ref).__name__}")
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    return (out.detach().reshape(-1).to(device="cpu", dtype=torch.float64),
            ref.detach().reshape(-1).to(device="cpu", dtype=torch.float64))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio `20 * log10(||ref|| / ||out - ref||)` in dB.

    `inf` when `out` equals `ref` exactly (including two empty or all-zero tensors); NaN when either
    holds a NaN.
    """
    o, r = _flat64(out, ref)
    noise = torch.linalg.vector_norm(o - r).item()
    signal = torch.linalg.vector_norm(r).item()
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors.

    Two all-zero (or empty) tensors give 1.0; an all-zero tensor against a non-zero one gives 0.0.
    """
    o, r = _flat64(out, ref)
    no = torch.linalg.vector_norm(o).item()
    nr = torch.linalg.vector_norm(r).item()
    if math.isnan(no) or math.isnan(nr):
        return math.nan
    if no == 0.0 and nr == 0.0:
        return 1.0
    if no == 0.0 or nr == 0.0:
        return 0.0
    return float(torch.dot(o, r).item() / (no * nr))
