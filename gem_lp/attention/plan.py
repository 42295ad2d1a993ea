"""Per-batch launch plans of the attention kernels, cached on the offsets tensor they derive from.

The tile maps and producer block maps are functions of the offsets' values alone (plus block sizes), and every
attention layer of a training step passes the same offsets tensor: building them once per batch instead of once
per call saves a few dozen small device ops (each a host-side dispatch) per layer and pass.

An entry lives as long as its offsets tensor (a weak, identity-keyed dictionary) and is rebuilt when the tensor's
version counter moves (an in-place write through autograd-visible ops). Writes that bypass the version counter
(`offsets.data[...] = ...`, writes through another framework's view) are not seen: pass a new tensor instead, or
call `clear_plan_cache()`. Plans are not cached while a CUDA graph is being captured (their memory would belong
to the graph's pool).
"""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")

_PLANS = WeakIdKeyDictionary()


def cached_plan(offsets: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
    """`build()`'s result for (`offsets`, `key`), built once per version of `offsets`.

    `key` must name everything else the plan depends on (block sizes, row counts, causal, the other offsets
    tensor's identity when there is one)."""
    if _capturing(offsets):
        return build()
    per_tensor = _PLANS.setdefault(offsets, {})
    version = offsets._version
    entry = per_tensor.get(key)
    if entry is not None and entry[0] == version:
        return entry[1]
    plan = build()
    per_tensor[key] = (version, plan)
    return plan


def clear_plan_cache() -> None:
    """Forget every cached plan."""
    _PLANS.clear()


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
