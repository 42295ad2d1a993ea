"""The operands of the sm_100a MXFP8 attention kernels (E4M3 payloads with blocked E8M0 scales in the zero-gather
jagged layout) and their checks: what the producer (`interface._sm100_forward`), the launches (`launch`) and the CPU
model (`sm100_model`) share, importable without the CuTe DSL."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem_lp.attention.cute.config import SM100_BWD, SM100_FWD
from gem_lp.attention.plan import cached_plan
from gem_lp.runtime.device import fake_mode

SF_TILE_BYTES = 512


def _needed_tiles(tiles: torch.Tensor) -> int | None:
    """The scale tiles per head the offsets need (`tiles[-1]`: the per-sequence 128-padded rows over 128), read once
    per tiles tensor (one host sync); None while a CUDA graph is captured (the producer's bounded layout always
    holds them) and for builds under fake tensors."""
    if tiles.numel() == 0 or fake_mode() or (tiles.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return cached_plan(tiles, ("needed scale tiles",), lambda: int(tiles[-1]))


def _check_tiles(names, scales, tiles: torch.Tensor, tokens: int) -> None:
    """Each named scale buffer holds the scale tiles the offsets need. Per-sequence 128-padding needs at most
    ceil(T/128) + B tiles (what `JaggedLayout.bounded` allots): buffers that large pass without reading the offsets,
    so the producer's path never waits for the GPU; smaller ones are checked against `tiles[-1]`."""
    bound = (tokens + 127) // 128 + max(tiles.numel() - 1, 0)
    short = [name for name in names if getattr(scales, name).shape[1] // SF_TILE_BYTES < bound]
    need = _needed_tiles(tiles) if short else None
    if need is None:
        return
    for name in short:
        have = getattr(scales, name).shape[1] // SF_TILE_BYTES
        if have < need:
            raise ValueError(f"scales.{name} holds {have} scale tiles per head, fewer than the {need} its offsets "
                             "need (each sequence's scale rows padded to 128: gem_lp.jagged.JaggedLayout)")


def _check_payloads(named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if t.dtype != torch.float8_e4m3fn or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] float8_e4m3fn payload, got {t.dtype} {tuple(t.shape)}")


def _check_scales(scales, heads: int, tokens_of: dict[str, int], cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    """Each named scale buffer `[H, n * 512]` uint8, contiguous, large enough for its tokens; the tile offsets int32
    `[B+1]` like the sequence offsets."""
    for name, tokens in tokens_of.items():
        sf = getattr(scales, name)
        if sf.dtype != torch.uint8 or sf.dim() != 2 or sf.shape[0] != heads or sf.shape[1] % SF_TILE_BYTES:
            raise ValueError(f"scales.{name} must be [H={heads}, n * 512] uint8 (blocked), got {sf.dtype} "
                             f"{tuple(sf.shape)}")
        if sf.shape[1] < (tokens + 127) // 128 * SF_TILE_BYTES:
            raise ValueError(f"scales.{name} has {sf.shape[1]} bytes per head, fewer than {tokens} tokens need")
        if not sf.is_contiguous():
            raise ValueError(f"scales.{name} must be contiguous")
    for name, tiles, cu in (("q_tiles", scales.q_tiles, cu_q), ("k_tiles", scales.k_tiles, cu_k)):
        if tiles.dtype != torch.int32 or tiles.shape != cu.shape:
            raise ValueError(f"scales.{name} must be int32 of shape {tuple(cu.shape)}, got {tiles.dtype} "
                             f"{tuple(tiles.shape)}")


@dataclass(frozen=True)
class MXScales:
    """The block scales of the sm_100a forward's operands, in the per-sequence 128-padded blocked layout of
    `gem_lp.jagged.quantize_jagged` (docs/jagged.md): `q`, `k` the `hdim` scales `[H, blocked bytes]` uint8 of Q
    and K, `v` V's `seq` scales; `q_tiles`, `k_tiles` int32 `[B+1]` on the device: each sequence's first 128-row
    scale tile (the layout's `scale_offsets // 128`) for the query and the key sequences."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_tiles: torch.Tensor
    k_tiles: torch.Tensor


def check_sm100_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: MXScales | None,
                         cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    """Shapes and dtypes of the sm_100a forward's operands (raises ValueError)."""
    if scales is None:
        raise ValueError("the sm_100a MXFP8 forward takes E4M3 payloads and their block scales: pass scales=MXScales")
    _check_payloads({"q": q, "k": k, "v": v})
    heads, dim = q.shape[1], q.shape[2]
    if dim not in SM100_FWD:
        raise ValueError(f"the sm_100a MXFP8 forward takes head dims {tuple(SM100_FWD)}, got {dim}")
    if k.shape[1:] != q.shape[1:] or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: heads and head dims differ")
    _check_scales(scales, heads, {"q": q.shape[0], "k": k.shape[0], "v": k.shape[0]}, cu_q, cu_k)
    _check_tiles(("q",), scales, scales.q_tiles, q.shape[0])
    _check_tiles(("k", "v"), scales, scales.k_tiles, k.shape[0])


@dataclass(frozen=True)
class MXBwdScales:
    """The block scales of the sm_100a backward's operands, blocked and per-sequence 128-padded as `MXScales`, each
    `[H, blocked bytes]` uint8. Q, K, dO are `square`-quantized, and each comes with both layouts of its scales (the
    same values): `q`, `k`, `do` the `hdim`-shaped ones (row = token, column = 32-feature block; for S = Q K^T and
    dP = dO V^T) and `q_seq`, `k_seq`, `do_seq` the `seq`-shaped ones (row = feature, column = 32-token block; for
    dK = dS^T Q, dQ = dS K, dV = P^T dO); `v` V's `hdim` scales. `q_tiles`, `k_tiles` as in `MXScales`."""

    q: torch.Tensor
    q_seq: torch.Tensor
    k: torch.Tensor
    k_seq: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    do_seq: torch.Tensor
    q_tiles: torch.Tensor
    k_tiles: torch.Tensor


def check_sm100_bwd_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                             do_values: torch.Tensor | None, scales: MXBwdScales | None, cu_q: torch.Tensor,
                             cu_k: torch.Tensor) -> None:
    """Shapes and dtypes of the sm_100a backward's operands (raises ValueError)."""
    if scales is None:
        raise ValueError("the sm_100a MXFP8 backward takes E4M3 payloads and their block scales: pass "
                         "scales=MXBwdScales")
    _check_payloads({"q": q, "k": k, "v": v, "do": do})
    heads, dim = q.shape[1], q.shape[2]
    if dim not in SM100_BWD:
        raise ValueError(f"the sm_100a MXFP8 backward takes head dims {tuple(SM100_BWD)}, got {dim}")
    if k.shape[1:] != q.shape[1:] or v.shape != k.shape or do.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, do {tuple(do.shape)}: "
                         "shapes differ")
    if do_values is None or do_values.dtype != torch.bfloat16 or do_values.shape != do.shape:
        got = None if do_values is None else f"{do_values.dtype} {tuple(do_values.shape)}"
        raise ValueError(f"do_values must be the BF16 values of do's payload and scales, {tuple(do.shape)} (for "
                         f"Δ = rowsum(dO O)), got {got}")
    tq, tk = q.shape[0], k.shape[0]
    _check_scales(scales, heads, {"q": tq, "q_seq": tq, "k": tk, "k_seq": tk, "v": tk, "do": tq, "do_seq": tq},
                  cu_q, cu_k)
    _check_tiles(("q", "q_seq", "do", "do_seq"), scales, scales.q_tiles, tq)
    _check_tiles(("k", "k_seq", "v"), scales, scales.k_tiles, tk)
