"""Host side of the CuTe RMSNorm + MX cast kernel: build once per configuration (M is dynamic), then launch on torch
tensors through TVM FFI. Under `FakeTensorMode` the kernel is built and not launched (`gem_lp.compile_check`)."""
from __future__ import annotations

import dataclasses

import torch

import cutlass
import cutlass.cute as cute
from flash_attn.cute.testing import is_fake_mode
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map

from ...mx.formats import BLOCK, PAYLOAD_DTYPE, SCALE_DTYPE, ceil_div
from ...mx.layout import blocked_size
from .config import NormLaunch, launch_for, max_k
from .kernel import NormMXCast

# Rows of the colwise payload `y^T [K, M]` start 16 bytes apart (a GEMM's TMA wants 16-byte strides; the kernel's
# 8-byte stores stay aligned): the same layout as the Triton kernels' colwise payload.
COLWISE_ROW_ALIGN = 16

_COMPILED: dict[tuple, object] = {}


@dataclasses.dataclass
class NormCastOutputs:
    """Payloads (float8_e4m3fn) and E8M0 scale bytes (uint8) of `y [M, K]` (rowwise) and `y^T [K, M]` (colwise),
    and rstd `[M]` (None without the norm). `col_data` is a `[K, M]` view whose rows are `colwise_row_stride(M)`
    bytes apart. Scales are flat 128x4 blocked layouts, or plain `[M, K/32]` / `[K, ceil(M/32)]` matrices."""

    row_data: torch.Tensor
    row_scale: torch.Tensor
    col_data: torch.Tensor
    col_scale: torch.Tensor
    rstd: torch.Tensor | None


def colwise_row_stride(M: int) -> int:
    return max(1, ceil_div(M, COLWISE_ROW_ALIGN)) * COLWISE_ROW_ALIGN


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def unsupported(x: torch.Tensor) -> str | None:
    """Why the kernel cannot take `x [M, K]` (None when it can)."""
    K = x.shape[-1]
    if K % BLOCK:
        return f"K={K} is not a multiple of {BLOCK}"
    if K > max_k():
        return f"K={K} is above the kernel's {max_k()}"
    return None


def _build(dtype, w_dtype, K: int, launch: NormLaunch, normalize: bool, rceil: bool, blocked: bool):
    key = (dtype, w_dtype, K, launch, normalize, rceil, blocked)
    fn = _COMPILED.get(key)
    if fn is None:
        vec = 128 // dtype.width
        m = cute.sym_int()
        x = make_fake_tensor(dtype, (m, K), divisibility=vec)
        w = make_fake_tensor(w_dtype, (K,), divisibility=1) if normalize else None
        flat = [make_fake_tensor(cutlass.Uint8, (cute.sym_int(),), divisibility=16) for _ in range(4)]
        rstd = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), divisibility=1) if normalize else None
        kernel = NormMXCast(dtype, K, launch.tile_k, launch.cluster_n, normalize, rceil, blocked)
        fn = _COMPILED[key] = cute.compile(
            kernel, x, w, *flat, rstd, cutlass.Int32(16), cutlass.Float32(0.0),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    return fn


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when its rows start at 16-byte aligned addresses with a contiguous last dim (what the kernel's
    16-byte `cp.async` copies need), else a contiguous copy."""
    if is_fake_mode():  # a build: the layout is the compiled one (16-byte aligned rows)
        return x
    rows_aligned = x.shape[0] <= 1 or (x.stride(0) * x.element_size()) % 16 == 0
    if x.stride(1) == 1 and rows_aligned and x.data_ptr() % 16 == 0:
        return x
    return x.contiguous()


def norm_mx_cast(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, *, scaling: str = "rceil",
                 blocked_scales: bool = True, arch: str | None = None) -> NormCastOutputs:
    """RMSNorm of `x [M, K]` (or x itself when `weight` is None) cast to MXFP8 rowwise and colwise, one launch.

    Args:
        x: `[M, K]` float32/bfloat16/float16, K a multiple of 32 (at most `config.max_k()`), any M >= 0.
        weight: `[K]` norm weight (any float dtype), or None for the dual cast of x.
        eps: added to the mean of squares (FP32).
        scaling: "rceil" or "floor".
        blocked_scales: scales in the 128x4 blocked layout (with its zero padding) instead of plain matrices.
        arch: the build's target (default: the device's); for builds without a GPU.
    """
    M, K = x.shape
    dev = x.device
    x = _aligned_rows(x)
    normalize = weight is not None
    if normalize:
        weight = weight.contiguous()
    k_blocks, m_blocks = K // BLOCK, ceil_div(M, BLOCK)
    row_data = torch.empty(M, K, dtype=PAYLOAD_DTYPE, device=dev)
    stride = colwise_row_stride(M)
    col_buf = torch.empty(K * stride, dtype=PAYLOAD_DTYPE, device=dev)
    col_data = col_buf.as_strided((K, M), (stride, 1))
    if blocked_scales:
        row_scale = torch.empty(blocked_size(M, k_blocks), dtype=SCALE_DTYPE, device=dev)
        col_scale = torch.empty(blocked_size(K, m_blocks), dtype=SCALE_DTYPE, device=dev)
    else:
        row_scale = torch.empty(M, k_blocks, dtype=SCALE_DTYPE, device=dev)
        col_scale = torch.empty(K, m_blocks, dtype=SCALE_DTYPE, device=dev)
    rstd = torch.empty(M, dtype=torch.float32, device=dev) if normalize else None
    out = NormCastOutputs(row_data, row_scale, col_data, col_scale, rstd)
    if M == 0:
        return out
    arch = arch or device_arch(dev)
    fn = _build(torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[weight.dtype] if normalize else None, K,
                launch_for(arch, K), normalize, scaling == "rceil", blocked_scales)
    if not is_fake_mode():
        fn(x, weight, row_data.view(torch.uint8).view(-1), row_scale.view(-1), col_buf.view(torch.uint8),
           col_scale.view(-1), rstd, stride, float(eps))
    return out


