"""Launch tables of the CuTe RMSNorm + MX cast kernel, per architecture: how many columns one CTA holds (`tile_k`,
a multiple of 128; `tile_k / 64` warps, one 8x8 strip a thread) and how many CTAs of a cluster share a row
(`cluster_n`). The bytes written do not depend on the launch."""
from __future__ import annotations

from dataclasses import dataclass

from gem_lp.mx.formats import ceil_div


@dataclass(frozen=True)
class NormLaunch:
    tile_k: int
    cluster_n: int


# Widest CTA tile (16 warps); the largest portable cluster (the generic rule's), and the largest the launch tables may
# name (Hopper and Blackwell run clusters of 16 CTAs, which CuTe DSL kernels opt in to).
MAX_TILE_K = 1024
PORTABLE_CLUSTER = 8
MAX_CLUSTER = 16
# Columns per CTA the generic rule aims at (see SM90).
TARGET_TILE_K = 256
# The fastest candidates of `benchmarks/bench_norm.py` on Hopper (docs/PERF.md): 32-row tiles of 256 columns
# (4 warps, 16 KiB of shared memory, 96 registers: 5 CTAs an SM) split K over a cluster, 16 CTAs at K = 4096;
# 128 or 512 columns per CTA were slower at every K. sm_100a takes the same table, untimed (no Blackwell GPU here).
SM90 = {256: NormLaunch(256, 1), 512: NormLaunch(256, 2), 1024: NormLaunch(256, 4), 4096: NormLaunch(256, 16)}
TABLES = {"sm_90a": SM90, "sm_100a": dict(SM90)}


def generic_launch(K: int) -> NormLaunch:
    """The smallest cluster whose CTAs hold at most TARGET_TILE_K columns (up to MAX_TILE_K when the cluster would
    exceed PORTABLE_CLUSTER)."""
    cluster_n = min(ceil_div(K, TARGET_TILE_K), PORTABLE_CLUSTER)
    tile_k = ceil_div(ceil_div(K, cluster_n), 128) * 128
    cluster_n = ceil_div(K, tile_k)
    return NormLaunch(tile_k, cluster_n)


def max_k() -> int:
    return MAX_TILE_K * PORTABLE_CLUSTER


def launch_for(arch: str, K: int) -> NormLaunch:
    """The launch for rows of K elements (K a multiple of 32, at most `max_k()`) on `arch` (sm_90a / sm_100a)."""
    if K > max_k():
        raise ValueError(f"the CuTe RMSNorm kernel takes rows of at most {max_k()} elements, got K={K}")
    return TABLES.get(arch, {}).get(K) or generic_launch(K)


# Which casts of the MX linears (`gem_lp.linear.operands`) take the CuTe kernel instead of the Triton one, per arch:
# (K from which the casts with the RMSNorm prologue do, K from which the casts without it do; None: never). At the
# trainer's token counts the norm's casts are faster on the CuTe kernel from K = 256, the casts without the norm as
# fast or slower (docs/PERF.md). Both kernels write the same bytes (GPU tests). sm_100a takes
# sm_90a's entry, unmeasured; other arches: the Triton kernel. The dispatch table must also give the CuTe RMSNorm + MX
# cast on the device (`rms_norm_quantize`).
LINEAR_CASTS_FROM_K: dict[str, tuple[int | None, int | None]] = {"sm_90a": (256, None), "sm_100a": (256, None)}
