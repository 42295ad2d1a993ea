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

@dataclass(frozen=True)
class Sm100FwdTiles:
    tile_m: int
    tile_n: int
    q_stage: int  # Q tiles of 128 rows per CTA (FA4's q_stage)


# sm_100a, mxfp8 forward (`fwd_sm100`), by head dim: 128 x 128 tiles, one scale tile per Q and K/V tile. One Q
# stage: at D = 128 two would fill the 512 tensor-memory columns and leave none for the scale factors; D = 64 has
# room for two but is built with one until that is measured (there is no sm_100 GPU here).
SM100_FWD = {64: Sm100FwdTiles(128, 128, 1), 128: Sm100FwdTiles(128, 128, 1)}
HEAD_DIMS = (64, 128)
# Compute-capability majors with MXFP8 attention kernels, per direction: sm_90a both; sm_100a the forward only
# (compiled and its PTX checked, never run: no Blackwell GPU here).
MX_FWD_ARCH_MAJORS = (9, 10)
MX_BWD_ARCH_MAJORS = (9,)
# Majors where the public API runs mxfp8 on these kernels: a training call needs both directions, so sm_100 keeps
# the reference recipe until its backward exists.
MX_ARCH_MAJORS = tuple(m for m in MX_FWD_ARCH_MAJORS if m in MX_BWD_ARCH_MAJORS)
# p_quant modes per arch
MX_P_QUANTS = {9: ("const_p", "dynamic"), 10: ("const_p", "dynamic")}
