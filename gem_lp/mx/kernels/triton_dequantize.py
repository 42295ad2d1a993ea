"""The dequantize pass: an MX tensor `[R, C]` (blocked along C) to its exact values in BF16 or FP32, as a GEMM reads
them (on Hopper, MX operands reach the tensor cores as MX-exact BF16: E4M3 x 2^k is exact in BF16 down to 2^-133)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE, SCALE_DTYPE, MXTensor, ceil_div
from gem_lp.mx.kernels.triton_cast import e4m3_value, scale_offset, scale_value, store_operand
from gem_lp.mx.layout import blocked_size
from gem_lp.runtime.device import interpreter_enabled
from gem_lp.runtime.triton_launch import KernelLaunch


@triton.jit
def _mx_dequantize_kernel(data_ptr, stride_data, scale_ptr, out_ptr, stride_out, R, C, BLOCKED: tl.constexpr,
                          TRANSPOSED: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    # data: [R, C] payload, rows stride_data apart (a padded colwise payload). out: [R, C] with rows stride_out
    # apart, or with TRANSPOSED its transpose [C, R] (element (r, c) at c * stride_out + r).
    NCB: tl.constexpr = BLOCK_C // 32
    n_c_tiles = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    r = (pid // n_c_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None, None]
    cb = (pid % n_c_tiles) * NCB + tl.arange(0, NCB)[None, :, None]
    c = cb * 32 + tl.arange(0, 32)[None, None, :]
    ok = (r < R) & (c < C)
    if TRANSPOSED:
        # the payload is a colwise payload buffer (rows of stride_data bytes, a multiple of 16, all allocated):
        # loads over the whole padded row stay vectors whatever C is; only columns < C are stored
        q = tl.load(data_ptr + r.to(tl.int64) * stride_data + c, mask=(r < R) & (c < stride_data), other=0)
        dst = out_ptr + c.to(tl.int64) * stride_out + r
    else:
        q = tl.load(data_ptr + r.to(tl.int64) * stride_data + c, mask=ok, other=0)
        dst = out_ptr + r.to(tl.int64) * stride_out + c
    n_cb = (C + 31) // 32
    byte = tl.load(scale_ptr + scale_offset(r, cb, n_cb, BLOCKED), mask=(r < R) & (cb < n_cb), other=127)
    store_operand(dst, e4m3_value(q, HW_CAST) * scale_value(byte.to(tl.int32)), ok, HW_CAST)



def _check_runnable(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not interpreter_enabled():
        raise ValueError(f"the Triton dequantize pass needs CUDA tensors ({name} is on {t.device}); on a CPU machine set "
                         f"TRITON_INTERPRET=1 before importing gem_lp")


def check_mx_operand(mx: MXTensor, name: str) -> None:
    """`mx` must be a 2-D MXFP8 tensor blocked along dim 1, scales plain (any strides) or 128x4 blocked.

    The payload's last dim must be contiguous; its rows may be padded (row stride >= columns), as the colwise
    payloads of `rms_norm_mx` are (a `[K, M]` view of a buffer with rows a multiple of 32 bytes apart).
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"{name} must be an MXTensor, got {type(mx).__name__}")
    d = mx.data
    if (d.dim() != 2 or d.dtype != PAYLOAD_DTYPE or (d.shape[1] > 1 and d.stride(1) != 1)
            or (d.shape[0] > 1 and d.stride(0) < d.shape[1])):
        raise ValueError(f"{name}.data must be a 2-D float8_e4m3fn tensor with a contiguous last dim and a row "
                         f"stride >= its columns, got {d.dtype} of shape {tuple(d.shape)} strides {d.stride()}")
    if mx.block != "1d" or mx.axis not in (1, -1):
        raise ValueError(f"{name} must be blocked 1x32 along its last dim (block='1d', axis=1), got "
                         f"block={mx.block!r}, axis={mx.axis}")
    rows, cols = d.shape
    n_cb = ceil_div(cols, BLOCK)
    s = mx.scale
    blocked = mx.scale_layout == "blocked"
    if s.dtype != SCALE_DTYPE or (blocked and not s.is_contiguous()) or s.device != d.device:
        raise ValueError(f"{name}.scale must be a uint8 tensor on {d.device} (contiguous when blocked), got {s.dtype} "
                         f"on {s.device} with strides {s.stride()}")
    if blocked:
        if s.shape != (blocked_size(rows, n_cb),):
            raise ValueError(f"{name}.scale (blocked) must hold {blocked_size(rows, n_cb)} bytes for a "
                             f"[{rows}, {n_cb}] scale matrix, got shape {tuple(s.shape)}")
    elif s.shape != (rows, n_cb):
        raise ValueError(f"{name}.scale must be [{rows}, {n_cb}] (plain layout), got {tuple(s.shape)}")
    _check_runnable(d, name)


def mx_dequantize_operand(mx: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`deq(mx)` as a `[R, C]` tensor of `dtype` (bfloat16 or float32), by a memory-bound Triton pass.

    `mx`: 2-D, blocked along dim 1, scales plain or blocked, a last partial block allowed.
    Exact in float32; in bfloat16 exact except values below 2^-126 that need more than its subnormal bits.
    """
    check_mx_operand(mx, "mx")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    blocked = mx.scale_layout == "blocked"
    # plain scales of any strides (the CuTe cast's colwise ones are a transposed view): the kernel reads a matrix
    return dequantize_operand(mx.data, mx.scale if blocked else mx.scale.contiguous(), blocked, dtype)


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor, blocked: bool, dtype: torch.dtype,
                transposed: bool = False, padded_cols: int | None = None) -> torch.Tensor:
    """`mx_dequantize_operand`'s launch for a checked payload `data [R, C]` (last dim contiguous, rows
    possibly padded) and its scales (no checks). Returns a contiguous `[R, C]` tensor of `dtype`, or with
    `transposed` the transposed view of a contiguous `[padded_cols (default C), R]` tensor whose rows C.. are
    zeros; `transposed` needs a colwise payload buffer (`triton_cast.colwise_payload_buffer`: every byte of its
    padded rows allocated)."""
    R, C = data.shape
    cols = C if padded_cols is None else padded_cols
    out = torch.empty((cols, R) if transposed else (R, C), dtype=dtype, device=data.device)
    if transposed and cols > C:
        out[C:].zero_()
    if R == 0 or C == 0:
        return out.t() if transposed else out
    on_gpu = data.is_cuda and not interpreter_enabled()
    stride = data.stride(0)
    stride_out = R if transposed else C
    _dequantize_launch(R, C, stride, transposed, blocked, on_gpu)(
        (data.view(torch.uint8), stride, scale, out, stride_out, R, C), on_gpu)
    return out.t() if transposed else out


@functools.lru_cache(maxsize=256)
def _dequantize_launch(R: int, C: int, stride: int, transposed: bool, blocked: bool, on_gpu: bool) -> KernelLaunch:
    """`_mx_dequantize_kernel`'s launch for these ints (relaunched directly after the first: `KernelLaunch`).
    Transposed, a tile spans 64 rows: each stored run of the output is 128 bytes."""
    br, bc = ((64, 128) if transposed else (32, 256)) if on_gpu else (32, 64)
    return KernelLaunch(_mx_dequantize_kernel, (ceil_div(R, br) * ceil_div(C, bc),), 7,
                        dict(BLOCKED=blocked, TRANSPOSED=transposed, HW_CAST=on_gpu, BLOCK_R=br, BLOCK_C=bc,
                             num_warps=4 if on_gpu else 1))


