"""Launch tables of the CuTe RMSNorm + MX cast kernel, per architecture: how many rows (`rows`: 32, 64 or 128) and
columns (`tile_k`, a multiple of 128) one CTA holds (`rows / 32 * tile_k / 64` warps, one 8x8 strip a thread) and how
many CTAs of a cluster share a row (`cluster_n`). The bytes written do not depend on the launch."""
from __future__ import annotations

from dataclasses import dataclass

from ...mx.formats import ceil_div


@dataclass(frozen=True)
class NormLaunch:
    tile_k: int
    cluster_n: int
    rows: int = 32


# Widest CTA tile (16 warps), and the largest portable cluster.
MAX_TILE_K = 1024
# Elements of a CTA tile: 16 warps of 8x8 strips.
MAX_TILE_ELEMENTS = 32 * 1024
MAX_CLUSTER = 8
# Columns per CTA the generic rule aims at (see SM90) when its tiles are 32 rows tall.
TARGET_TILE_K = 256
# Chosen per K of the model and benchmark shapes. 128 x 128 tiles (8 warps; a cluster of up to 8 along K): a CTA's
# colwise payload rows are then 128 contiguous bytes and its scales whole 512-byte tiles of the blocked layouts, all
# written with 16-byte stores. Wider rows (a cluster would exceed 8 CTAs) take 32 x 512 tiles.
# `benchmarks/bench_norm.py` times the alternatives (LAUNCH_CANDIDATES); the fastest goes here.
SM90 = {256: NormLaunch(128, 2, 128), 512: NormLaunch(128, 4, 128), 1024: NormLaunch(128, 8, 128),
        4096: NormLaunch(512, 8, 32)}
TABLES = {"sm_90a": SM90, "sm_100a": dict(SM90)}


def generic_launch(K: int) -> NormLaunch:
    """128 x 128 tiles when a cluster of at most MAX_CLUSTER covers K; else 32-row tiles and the smallest cluster
    whose CTAs hold at most TARGET_TILE_K columns (up to MAX_TILE_K when the cluster would exceed MAX_CLUSTER)."""
    if K <= 128 * MAX_CLUSTER:
        return NormLaunch(128, ceil_div(K, 128), 128)
    cluster_n = min(ceil_div(K, TARGET_TILE_K), MAX_CLUSTER)
    tile_k = ceil_div(ceil_div(K, cluster_n), 128) * 128
    cluster_n = ceil_div(K, tile_k)
    return NormLaunch(tile_k, cluster_n)


def max_k() -> int:
    return MAX_TILE_K * MAX_CLUSTER


def launch_for(arch: str, K: int) -> NormLaunch:
    """The launch for rows of K elements (K a multiple of 32, at most `max_k()`) on `arch` (sm_90a / sm_100a)."""
    if K > max_k():
        raise ValueError(f"the CuTe RMSNorm kernel takes rows of at most {max_k()} elements, got K={K}")
    return TABLES.get(arch, {}).get(K) or generic_launch(K)
