"""Host side of the CuTe attention kernels: build (once per configuration), then launch on torch tensors.

Everything here takes the varlen layout of FlashAttention: q `[Tq, H, D]`, k, v `[Tk, H, D]`, `cu_seqlens_*`
int32 `[B+1]` on the device, LSE `[H, Tq]` FP32 (natural log). Under `FakeTensorMode` the kernels are built and
not launched, which is how `gem_lp.compile_check` builds them on a machine without a GPU.
"""
from __future__ import annotations

import math

import torch

import cutlass
import cutlass.cute as cute
from flash_attn.cute import interface as fa4
from flash_attn.cute.cute_dsl_utils import to_cute_tensor
from flash_attn.cute.testing import is_fake_mode
from flash_attn.cute.utils import AuxData

from .bwd_sm90 import MXAttentionBackwardSm90
from .config import SM90_BWD, SM90_FWD, FwdTiles
from .fwd_sm90 import MXAttentionForwardSm90

_COMPILED: dict[tuple, object] = {}
# FA4 gives its varlen schedulers a cumulative tile count above this many sequences (a binary search below).
_CU_TILES_ABOVE = fa4.BIN_BATCH_SEARCH_THRESH


def _build(key: tuple, make):
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = make()
    return fn


def _cu_tiles(cu_seqlens: torch.Tensor, tile: int) -> torch.Tensor | None:
    if cu_seqlens.shape[0] - 1 <= _CU_TILES_ABOVE:
        return None
    return fa4._compute_tile_cumsum(cu_seqlens=cu_seqlens, tile_size=tile)[0]


def device_arch(device: torch.device) -> str:
    """`sm_90a` / `sm_100a` of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def _seq_tensor(t: torch.Tensor | None):
    return None if t is None else to_cute_tensor(t, assumed_align=4, leading_dim=0)


def _check_arch(arch: str) -> None:
    if arch != "sm_90a":
        raise NotImplementedError(f"the MXFP8 attention kernels are built for sm_90a; {arch} has none yet")


def mx_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               *, causal: bool, scale: float, p_quant: str, arch: str, tiles: FwdTiles | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[Tq, H, D]` BF16 and LSE `[H, Tq]` of the MXFP8 recipe on MX-exact BF16 operands (`fwd_sm90`);
    `tiles` overrides the launch table (for measurements)."""
    _check_arch(arch)
    tq, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(heads, tq, dtype=torch.float32, device=q.device)
    if tq == 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    tiles = tiles or SM90_FWD[dim]
    cu_tiles = _cu_tiles(cu_q, tiles.tile_m)
    key = ("mx fwd sm90", dim, causal, p_quant, tiles, cu_tiles is not None)

    def make():
        kernel = MXAttentionForwardSm90(dim, is_causal=causal, tile_m=tiles.tile_m, tile_n=tiles.tile_n,
                                        p_quant=p_quant)
        return cute.compile(
            kernel, *(to_cute_tensor(t) for t in (q, k, v, out)), to_cute_tensor(lse, assumed_align=4), scale,
            _seq_tensor(cu_q), _seq_tensor(cu_k), None, None, None, None, None, None, None, AuxData(),
            _seq_tensor(cu_tiles), None, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi")

    fn = _build(key, make)
    if not is_fake_mode():
        fn(q, k, v, out, lse, scale, cu_q, cu_k, None, None, None, None, None, None, None, AuxData(), cu_tiles,
           None)
    return out, lse


def mx_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: torch.Tensor | None, cu_q: torch.Tensor,
                cu_k: torch.Tensor, *, causal: bool, scale: float, p_quant: str, arch: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (BF16) of the MXFP8 recipe (`bwd_sm90`).

    q, k, do: the `square`-quantized operands; v: `hdim`; all MX-exact BF16. `out`, `do` and `dlse` make
    Δ = rowsum(dO ⊙ O) - dLSE (the recipe takes the quantized dO that dP uses); `lse` `[H, Tq]` from the forward.
    """
    _check_arch(arch)
    tq, heads, dim = q.shape
    tk = k.shape[0]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if tq == 0 or tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    tiles = SM90_BWD[dim]
    batch = cu_q.shape[0] - 1
    fake = is_fake_mode()
    padded = (tq + batch * tiles.tile_m + tiles.tile_m - 1) // tiles.tile_m * tiles.tile_m
    dq_accum = torch.empty(heads, padded * dim, dtype=torch.float32, device=q.device)
    dpsum = torch.empty(heads, padded, dtype=torch.float32, device=q.device)
    lse_log2 = torch.empty(heads, padded, dtype=torch.float32, device=q.device)
    cu_tiles_q = _cu_tiles(cu_q, tiles.tile_m)
    cu_tiles_k = _cu_tiles(cu_k, tiles.tile_n)
    bf16 = cutlass.BFloat16
    fa4._bwd_preprocess(out, do, dpsum, lse, lse_log2, dq_accum, cu_q, None, dlse, bf16, dim, dim,
                        tiles.tile_m, cu_total_m_blocks=cu_tiles_q, fake_mode=fake, hdim_multiple_of=32)
    key = ("mx bwd sm90", dim, causal, p_quant, tiles, cu_tiles_k is not None)

    def make():
        kernel = MXAttentionBackwardSm90(dim, is_causal=causal, tiles=tiles, p_quant=p_quant)
        tensors = [to_cute_tensor(t) for t in (q, k, v, do)]
        tensors += [to_cute_tensor(t) for t in (lse_log2, dpsum, dq_accum)]
        tensors += [to_cute_tensor(t) for t in (dk, dv)]
        return cute.compile(
            kernel, *tensors, scale, _seq_tensor(cu_q), _seq_tensor(cu_k), None, None, None, None, None, None,
            None, AuxData(), None, _seq_tensor(cu_tiles_k),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")

    fn = _build(key, make)
    if not fake:
        fn(q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, scale, cu_q, cu_k, None, None, None, None, None, None,
           None, AuxData(), None, cu_tiles_k)
    fa4._bwd_postprocess_convert(dq_accum, dq, scale, cu_q, None, 90, bf16, dim, tiles.tile_m, 256,
                                 tiles.atom_layout_m_dq, tiles.dq_swap_ab, cu_total_m_blocks=cu_tiles_q,
                                 fake_mode=fake, hdim_multiple_of=32)
    return dq, dk, dv
