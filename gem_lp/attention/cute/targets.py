"""The attention kernels `jagged_attention` can launch on the cute backend, as `gem_lp.compile_check` builds."""
from __future__ import annotations

from functools import partial

import torch

from gem_lp.compile_check import CompileTarget
from gem_lp.attention.cute.config import HEAD_DIMS

# A varlen batch for the builds (shapes are dynamic in the kernels: any batch reuses them); above 256 sequences
# FA4's schedulers take a cumulative tile count, a second build of each kernel.
_TOKENS, _HEADS = 4096, 4
_BATCHES = {"": 8, " many-seqs": 300}


def _tensors(dim: int, batch: int):
    q, k, v = (torch.empty(_TOKENS, _HEADS, dim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return q, k, v, torch.empty(batch + 1, dtype=torch.int32, device="cuda")


def _bf16(direction: str, dim: int, causal: bool, batch: int) -> None:
    from flash_attn.cute import interface as fa4

    q, k, v, cu = _tensors(dim, batch)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024, causal=causal)
    if direction == "fwd":
        fa4._flash_attn_fwd(q, k, v, return_lse=True, **kw)
    else:
        lse = torch.empty(_HEADS, _TOKENS, dtype=torch.float32, device="cuda")
        fa4._flash_attn_bwd(q, k, v, q, q, lse, **kw)


def _sm100_operands(dim: int, batch: int):
    """E4M3 payloads and blocked scales as `quantize_jagged` lays them out (each sequence padded to 128 rows)."""
    from gem_lp.attention.cute.launch import MXScales

    q, k, v = (torch.empty(_TOKENS, _HEADS, dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(3))
    padded_tiles = (_TOKENS + batch * 127) // 128
    sf = [torch.empty(_HEADS, padded_tiles * 512, dtype=torch.uint8, device="cuda") for _ in range(3)]
    tiles = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    return q, k, v, MXScales(*sf, tiles, tiles)


def _sm100_bwd_operands(dim: int, batch: int):
    """E4M3 payloads of q, k, v, dO, dO's BF16 values, and `MXBwdScales` (both layouts of the square operands)."""
    from gem_lp.attention.cute.launch import MXBwdScales

    q, k, v, do = (torch.empty(_TOKENS, _HEADS, dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(4))
    padded_tiles = (_TOKENS + batch * 127) // 128
    sf = [torch.empty(_HEADS, padded_tiles * 512, dtype=torch.uint8, device="cuda") for _ in range(7)]
    tiles = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    do_values = torch.empty(_TOKENS, _HEADS, dim, dtype=torch.bfloat16, device="cuda")
    return q, k, v, do, do_values, MXBwdScales(*sf, tiles, tiles)


def _mxfp8(direction: str, dim: int, causal: bool, batch: int, p_quant: str, arch: str) -> None:
    from gem_lp.attention.cute.launch import mx_backward, mx_forward

    q, k, v, cu = _tensors(dim, batch)
    kw = dict(causal=causal, scale=dim**-0.5, p_quant=p_quant, arch=arch)
    if direction == "fwd" and arch == "sm_100a":
        q, k, v, scales = _sm100_operands(dim, batch)
        mx_forward(q, k, v, cu, cu, scales=scales, **kw)
    elif arch == "sm_100a":
        q, k, v, do, do_values, scales = _sm100_bwd_operands(dim, batch)
        out = torch.empty(_TOKENS, _HEADS, dim, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(_HEADS, _TOKENS, dtype=torch.float32, device="cuda")
        mx_backward(q, k, v, do, out, lse, None, cu, cu, scales=scales, do_values=do_values, **kw)
    elif direction == "fwd":
        mx_forward(q, k, v, cu, cu, **kw)
    else:
        lse = torch.empty(_HEADS, _TOKENS, dtype=torch.float32, device="cuda")
        mx_backward(q, k, v, q, q, lse, None, cu, cu, **kw)


def compile_targets(arch: str) -> list[CompileTarget]:
    """bf16 (FlashAttention-4's kernels) on both arches; mxfp8 where its kernels exist: sm_90a and sm_100a forward
    and backward at D = 64 and 128, each with const_p and dynamic (`gem_lp.compile_check.MISSING` would list a
    missing one; the public API runs the reference for mxfp8 where a kernel is missing)."""
    from gem_lp.attention.cute.config import MX_BWD_ARCH_MAJORS, MX_FWD_ARCH_MAJORS, MX_P_QUANTS, SM100_BWD

    major = int(arch[3:-1]) // 10
    with_mx = {"fwd": major in MX_FWD_ARCH_MAJORS, "bwd": major in MX_BWD_ARCH_MAJORS}
    p_quants = MX_P_QUANTS.get(major, ())
    targets = []
    for dim in HEAD_DIMS:
        for causal in (False, True):
            for seqs, batch in _BATCHES.items():
                mode = f"d{dim} {'causal' if causal else 'full'}{seqs}"
                for direction in ("fwd", "bwd"):
                    targets.append(CompileTarget("attention", direction, "bf16", mode,
                                                 partial(_bf16, direction, dim, causal, batch)))
                    mx_dim = direction == "fwd" or major != 10 or dim in SM100_BWD
                    for p_quant in p_quants if with_mx[direction] and mx_dim else ():
                        targets.append(CompileTarget("attention", direction, "mxfp8", f"{mode} {p_quant}",
                                                     partial(_mxfp8, direction, dim, causal, batch, p_quant, arch)))
    return targets
