"""Launch tables of the CuTe attention kernels, per architecture (tiles are multiples of the 32-token MX block,
so every tile of a sequence starts on an MX block boundary of that sequence)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FwdTiles:
    tile_m: int
    tile_n: int


@dataclass(frozen=True)
class BwdTiles:
    tile_m: int
    tile_n: int
    q_stages: int
    do_stages: int
    pds_stages: int
    atom_layout_n_dkv: int
    atom_layout_m_dq: int
    dq_swap_ab: bool


# sm_90a, mxfp8, by head dim. Forward: FA4's Hopper choice. Backward: FA4's causal tile for D128 (its
# non-causal 80-row tile would split 32-query blocks), S^T = K Q^T in registers (SdP_swapAB), so dS and P
# go to the dK / dV wgmmas from registers.
SM90_FWD = {64: FwdTiles(192, 128), 128: FwdTiles(128, 128)}
SM90_BWD = {
    64: BwdTiles(128, 128, 2, 2, 2, atom_layout_n_dkv=2, atom_layout_m_dq=2, dq_swap_ab=False),
    128: BwdTiles(64, 128, 2, 2, 2, atom_layout_n_dkv=2, atom_layout_m_dq=1, dq_swap_ab=False),
}
HEAD_DIMS = (64, 128)
# Compute-capability majors with MXFP8 attention kernels (sm_90a; Blackwell's are not written yet).
MX_ARCH_MAJORS = (9,)
