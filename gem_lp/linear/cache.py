"""Per-tensor caches of the MX linears: what is made from a parameter once per update of it (the weight's MX
operands, the bias in Y's dtype), keyed by the parameter's identity and checked against its version counter."""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class PerTensorCache:
    """Values keyed by a live tensor's identity: a dict on `id(t)` holding a weak reference to `t` (checked on
    lookup, so a reused id never matches); the entry leaves with the tensor. A lookup costs a dict access, a
    fraction of `WeakIdKeyDictionary`'s."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t: torch.Tensor):
        entry = self._entries.get(id(t))
        return None if entry is None or entry[0]() is not t else entry[1]

    def put(self, t: torch.Tensor, value) -> None:
        watch_fused_optimizer_steps()
        key, entries = id(t), self._entries
        entries[key] = (weakref.ref(t, lambda _, key=key: entries.pop(key, None)), value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def _bump_versions_after_fused_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The caches trust `_version` to change when a parameter is written. The fused optimizer kernels (AdamW, Adam,
    SGD, Adagrad with `fused=True`) write parameters in place without bumping it, so every later call would reuse
    the quantization of the weights before the step: after such a step, bump the version of its parameters."""
    if any(group.get("fused") for group in optimizer.param_groups):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params:
            torch.autograd.graph.increment_version(params)


_WATCHING = []


def watch_fused_optimizer_steps() -> None:
    """Register the global optimizer hook above, once, when the first cache entry is made (not at import)."""
    if not _WATCHING:
        _WATCHING.append(register_optimizer_step_post_hook(_bump_versions_after_fused_step))
