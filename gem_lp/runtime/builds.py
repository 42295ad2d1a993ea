"""The in-memory caches of compiled CuTe kernels, registered in one place: how many kernels a process has built
(a build during a timed training step stalls it; the trainer reports them) and which."""
from __future__ import annotations

import sys

_CACHES: dict[str, dict] = {}


def register_cache(name: str, cache: dict) -> dict:
    """Register a kernel package's cache (compile key -> kernel) under `name`; returns the cache."""
    _CACHES[name] = cache
    return cache


def _cute_caches():
    """(name, dict of compile key -> kernel) of every registered cache, and flash-attn-4's when it is imported."""
    yield from _CACHES.items()
    fa4 = sys.modules.get("flash_attn.cute.interface")
    if fa4 is not None:
        for attr, fn in vars(fa4).items():
            cache = getattr(getattr(fn, "compile_cache", None), "cache", None)
            if isinstance(cache, dict):
                yield f"flash_attn.cute.interface.{attr}", cache


def cute_kernel_builds() -> int:
    """CuTe kernels built in this process so far: ours (every registered cache) and flash-attn-4's (its interface
    functions' `compile_cache`). Imports nothing: a stack not yet imported has built nothing."""
    return sum(len(cache) for _, cache in _cute_caches())


def cute_kernel_keys() -> set[str]:
    """`cache name: compile key` of every CuTe kernel `cute_kernel_builds` counts (to say which were built)."""
    return {f"{name}: {key}" for name, cache in _cute_caches() for key in cache}
