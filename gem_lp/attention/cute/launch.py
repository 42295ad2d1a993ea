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
from flash_attn.cute.utils import AuxData

from gem_lp.runtime.builds import register_cache
from gem_lp.runtime.device import fake_mode
from gem_lp.attention.cute.bwd_sm90 import MXAttentionBackwardSm90
from gem_lp.attention.cute.config import (MX_BWD_ARCH_MAJORS, MX_FWD_ARCH_MAJORS, MX_P_QUANTS, SM90_BWD, SM90_FWD, SM100_BWD, SM100_FWD,
                     FwdTiles)
from gem_lp.attention.cute.fwd_sm90 import MXAttentionForwardSm90
from gem_lp.attention.cute.sm100_operands import (MXBwdScales, MXScales, check_sm100_bwd_operands,  # noqa: F401
                                                  check_sm100_operands)

_COMPILED: dict[tuple, object] = register_cache("attention", {})
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


def _seq_tensor(t: torch.Tensor | None):
    return None if t is None else to_cute_tensor(t, assumed_align=4, leading_dim=0)


# sm_103a builds the sm_100a kernels for its own arch (never run: no Blackwell GPU here; self-checked on first use)
_ARCHES = {"sm_90a": 9, "sm_100a": 10, "sm_103a": 10}


def _check_arch(arch: str, direction: str = "fwd", p_quant: str | None = None) -> int:
    """The compute-capability major of `arch` when it has an MXFP8 kernel for `direction` (and `p_quant`)."""
    majors = MX_FWD_ARCH_MAJORS if direction == "fwd" else MX_BWD_ARCH_MAJORS
    major = _ARCHES.get(arch)
    if major not in majors:
        built = ", ".join(a for a, m in _ARCHES.items() if m in majors)
        raise NotImplementedError(f"the MXFP8 attention {direction} kernels are built for {built}; {arch} has none")
    if p_quant is not None and p_quant not in MX_P_QUANTS[major]:
        raise NotImplementedError(f"the {arch} MXFP8 attention {direction} kernel has p_quant in "
                                  f"{MX_P_QUANTS[major]}, got {p_quant!r}")
    return major


def mx_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               *, causal: bool, scale: float, p_quant: str, arch: str, tiles: FwdTiles | None = None,
               scales: MXScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O `[Tq, H, D]` BF16 and LSE `[H, Tq]` of the MXFP8 recipe.

    sm_90a (`fwd_sm90`): q, k, v are MX-exact BF16 operands (the producer pass); `tiles` overrides the launch
    table (for measurements). sm_100a (`fwd_sm100`; compiled, never run here): q, k, v are the E4M3 payloads and
    `scales` their block scales."""
    if _check_arch(arch, "fwd", p_quant) == 10:
        return _mx_forward_sm100(q, k, v, scales, cu_q, cu_k, causal=causal, scale=scale, p_quant=p_quant)
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
    if not fake_mode():
        fn(q, k, v, out, lse, scale, cu_q, cu_k, None, None, None, None, None, None, None, AuxData(), cu_tiles,
           None)
    return out, lse


def _grad_outputs(dq, dk, dv, tq: int, tk: int, heads: int, dim: int, device) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV as the backward kernels write them: the caller's (checked: BF16 `[T, H, D]` with contiguous heads
    and features, e.g. views into one packed gradient), else new tensors."""
    grads = []
    for name, given, tokens in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tk)):
        if given is None:
            given = torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device=device)
        elif (given.shape != (tokens, heads, dim) or given.dtype != torch.bfloat16 or given.stride(2) != 1
              or given.stride(1) != dim):
            raise ValueError(f"{name} must be BF16 {(tokens, heads, dim)} with contiguous heads and features, got "
                             f"{given.dtype} {tuple(given.shape)} strides {given.stride()}")
        grads.append(given)
    return tuple(grads)


def _bwd_preprocess(out, do_values, lse, dlse, cu_q, cu_k, tiles):
    """FA4's backward preprocess for query tiles of `tiles.tile_m` rows: Δ = rowsum(dO ⊙ O) - dLSE (from
    `do_values`, dO's BF16 values), the LSE in log2 and a zeroed FP32 dQ accumulator, each with every sequence
    padded to whole tiles. Returns `(dq_accum, dpsum, lse_log2, cu_tiles_q, cu_tiles_k)`."""
    tq, heads, dim = out.shape
    tile_m = tiles.tile_m
    padded = (tq + (cu_q.shape[0] - 1) * tile_m + tile_m - 1) // tile_m * tile_m
    dq_accum = torch.empty(heads, padded * dim, dtype=torch.float32, device=out.device)
    dpsum = torch.empty(heads, padded, dtype=torch.float32, device=out.device)
    lse_log2 = torch.empty(heads, padded, dtype=torch.float32, device=out.device)
    cu_tiles_q = _cu_tiles(cu_q, tile_m)
    fa4._bwd_preprocess(out, do_values, dpsum, lse, lse_log2, dq_accum, cu_q, None, dlse, cutlass.BFloat16, dim, dim,
                        tile_m, cu_total_m_blocks=cu_tiles_q, fake_mode=fake_mode(), hdim_multiple_of=32)
    return dq_accum, dpsum, lse_log2, cu_tiles_q, _cu_tiles(cu_k, tiles.tile_n)


def mx_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: torch.Tensor | None, cu_q: torch.Tensor,
                cu_k: torch.Tensor, *, causal: bool, scale: float, p_quant: str, arch: str,
                dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                scales: MXBwdScales | None = None, do_values: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (BF16) of the MXFP8 recipe.

    sm_90a (`bwd_sm90`): the operands below. sm_100a (`bwd_sm100`; compiled, never run here): q, k, v, do are the
    E4M3 payloads, `scales` their block scales (`MXBwdScales`), `do_values` dO's BF16 values (payload times scale)
    for Δ; the rest as below.

    q, k, do: the `square`-quantized operands; v: `hdim`; all MX-exact BF16. `out`, `do` and `dlse` make
    Δ = rowsum(dO ⊙ O) - dLSE (the recipe takes the quantized dO that dP uses); `lse` `[H, Tq]` from the forward.
    `dq`, `dk`, `dv`: where to write them (BF16 `[T, H, D]` with contiguous heads and features, e.g. views into
    one packed gradient), else new tensors.
    """
    if _check_arch(arch, "bwd", p_quant) == 10:
        return _mx_backward_sm100(q, k, v, do, do_values, out, lse, dlse, scales, cu_q, cu_k, causal=causal,
                                  scale=scale, p_quant=p_quant, dq=dq, dk=dk, dv=dv)
    tq, heads, dim = q.shape
    dq, dk, dv = _grad_outputs(dq, dk, dv, tq, k.shape[0], heads, dim, q.device)
    if tq == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    tiles = SM90_BWD[dim]
    fake = fake_mode()
    dq_accum, dpsum, lse_log2, cu_tiles_q, cu_tiles_k = _bwd_preprocess(out, do, lse, dlse, cu_q, cu_k, tiles)
    bf16 = cutlass.BFloat16
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


def _mx_forward_sm100(q, k, v, scales: MXScales | None, cu_q, cu_k, *, causal: bool, scale: float,
                      p_quant: str = "const_p") -> tuple[torch.Tensor, torch.Tensor]:
    """`mx_forward` on sm_100a: `MXAttentionForwardSm100` on E4M3 payloads and blocked scales."""
    from gem_lp.attention.cute.fwd_sm100 import MXAttentionForwardSm100

    check_sm100_operands(q, k, v, scales, cu_q, cu_k)
    tq, heads, dim = q.shape
    out = torch.empty(tq, heads, dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(heads, tq, dtype=torch.float32, device=q.device)
    if tq == 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    tiles = SM100_FWD[dim]
    cu_tiles = _cu_tiles(cu_q, tiles.tile_m * tiles.q_stage)
    # the kernel reads the scales as 32-bit words (16 bytes per lane of the MMA warp)
    sf = [t.view(torch.int32) for t in (scales.q, scales.k, scales.v)]
    key = ("mx fwd sm100", dim, causal, p_quant, tiles, cu_tiles is not None)

    def make():
        kernel = MXAttentionForwardSm100(dim, is_causal=causal, tile_m=tiles.tile_m, tile_n=tiles.tile_n,
                                         q_stage=tiles.q_stage, p_quant=p_quant)
        return cute.compile(
            kernel, *(to_cute_tensor(t) for t in (q, k, v, out)), to_cute_tensor(lse, assumed_align=4), scale,
            *(to_cute_tensor(t) for t in sf), _seq_tensor(scales.q_tiles), _seq_tensor(scales.k_tiles),
            _seq_tensor(cu_q), _seq_tensor(cu_k), _seq_tensor(cu_tiles),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")

    fn = _build(key, make)
    if not fake_mode():
        # FP8 payloads go to the TVM FFI call as uint8 views, as FA4 passes them
        fn(*(t.view(torch.uint8) for t in (q, k, v)), out, lse, scale, *sf, scales.q_tiles, scales.k_tiles, cu_q,
           cu_k, cu_tiles)
    return out, lse


def _mx_backward_sm100(q, k, v, do, do_values, out, lse, dlse, scales: MXBwdScales | None, cu_q, cu_k, *,
                       causal: bool, scale: float, p_quant: str, dq=None, dk=None, dv=None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mx_backward` on sm_100a: FA4's preprocess (Δ from `do_values`, LSE in log2), `MXAttentionBackwardSm100` on
    E4M3 payloads and blocked scales, FA4's dQ postprocess."""
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    from gem_lp.attention.cute.bwd_sm100 import MXAttentionBackwardSm100

    check_sm100_bwd_operands(q, k, v, do, do_values, scales, cu_q, cu_k)
    tq, heads, dim = q.shape
    dq, dk, dv = _grad_outputs(dq, dk, dv, tq, k.shape[0], heads, dim, q.device)
    if tq == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    tiles = SM100_BWD[dim]
    fake = fake_mode()
    dq_accum, dpsum, lse_log2, cu_tiles_q, cu_tiles_k = _bwd_preprocess(out, do_values, lse, dlse, cu_q, cu_k,
                                                                         tiles)
    bf16 = cutlass.BFloat16
    # the kernel reads the scales as 32-bit words (16 bytes per lane of the MMA warp)
    sf = [getattr(scales, n).view(torch.int32) for n in ("q", "q_seq", "k", "k_seq", "v", "do", "do_seq")]
    key = ("mx bwd sm100", dim, causal, p_quant, tiles, cu_tiles_k is not None)

    def make():
        kernel = MXAttentionBackwardSm100(dim, is_causal=causal, p_quant=p_quant, tile_m=tiles.tile_m,
                                          tile_n=tiles.tile_n)
        tensors = [to_cute_tensor(t) for t in (q, k, v, do)]
        tensors += [to_cute_tensor(t) for t in (lse_log2, dpsum, dq_accum, dk, dv)]
        return cute.compile(
            kernel, *tensors, scale, *(to_cute_tensor(t) for t in sf), _seq_tensor(scales.q_tiles),
            _seq_tensor(scales.k_tiles), _seq_tensor(cu_q), _seq_tensor(cu_k), _seq_tensor(cu_tiles_k),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")

    fn = _build(key, make)
    if not fake:
        # FP8 payloads go to the TVM FFI call as uint8 views, as FA4 passes them
        fn(*(t.view(torch.uint8) for t in (q, k, v, do)), lse_log2, dpsum, dq_accum, dk, dv, scale, *sf,
           scales.q_tiles, scales.k_tiles, cu_q, cu_k, cu_tiles_k)
    dq_order = FlashAttentionBackwardSm100.accum_tile_orders(False, tiles.tile_n)[0]
    fa4._bwd_postprocess_convert(dq_accum, dq, scale, cu_q, None, 100, bf16, dim, tiles.tile_m, 128, 1, False,
                                 cu_total_m_blocks=cu_tiles_q, accum_order=dq_order, fake_mode=fake,
                                 hdim_multiple_of=32)
    return dq, dk, dv
