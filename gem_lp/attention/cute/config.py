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
# room for two but is built with one until hardware can judge it (there is no sm_100 GPU here).
SM100_FWD = {64: Sm100FwdTiles(128, 128, 1), 128: Sm100FwdTiles(128, 128, 1)}
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Sm100BwdTiles:
    tile_m: int  # queries per step
    tile_n: int  # keys per CTA


# sm_100a, mxfp8 backward (`bwd_sm100`), by head dim: FA4's 1-CTA 128 x 128 tiles, one scale tile per query step
# and per key tile. Tensor-memory columns (512), D = 64: S^T 0-127 (E4M3 P in 0-31), dV 128-191, dP^T 192-319 (E4M3
# dS in 192-223, dQ 192-255), dK 320-383, ten 4-column scale tiles 384-423. D = 128: S^T 0-127, dV 128-255, dP^T /
# dQ 256-383, dK 384-511 take all 512 columns; the scale tiles go to S^T columns 32-63 (past the E4M3 P) and dP^T
# columns 288-295 (past the E4M3 dS) while those hold nothing live, with a serial MMA schedule (bwd_sm100).
SM100_BWD = {64: Sm100BwdTiles(128, 128), 128: Sm100BwdTiles(128, 128)}
# Compute-capability majors with MXFP8 attention kernels, per direction: sm_90a both; sm_100a both (compiled and their
# PTX checked, never run: no Blackwell GPU here). Which of them an op runs is the dispatch table's choice.
MX_FWD_ARCH_MAJORS = (9, 10)
MX_BWD_ARCH_MAJORS = (9, 10)
# p_quant modes per arch
MX_P_QUANTS = {9: ("const_p", "dynamic"), 10: ("const_p", "dynamic")}
