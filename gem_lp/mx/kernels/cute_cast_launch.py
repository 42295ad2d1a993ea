"""Host side of the CuTe RMSNorm + MX cast kernel: build once per configuration (M is dynamic), then launch on torch
tensors through TVM FFI. Under `FakeTensorMode` the kernel is built and not launched (`gem_lp.compile_check`)."""
from __future__ import annotations

import dataclasses

import torch

import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map

from gem_lp.runtime.builds import register_cache
from gem_lp.runtime.device import build_arch, fake_mode
from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE, SCALE_DTYPE, ceil_div, colwise_row_stride
from gem_lp.mx.layout import blocked_size
from gem_lp.mx.kernels.cute_cast_config import MAX_CLUSTER, MAX_TILE_K, NormLaunch, launch_for, max_k
from gem_lp.mx.kernels.cute_cast import NormMXCast

_COMPILED: dict[tuple, object] = register_cache("mx.cast", {})
# (x dtype, weight dtype or None, K, rceil, blocked, arch or device) -> the build of the launch table's launch
_DEFAULT_BUILDS: dict[tuple, object] = {}


@dataclasses.dataclass
class NormCastOutputs:
    """Payloads (float8_e4m3fn) and E8M0 scale bytes (uint8) of `y [M, K]` (rowwise) and `y^T [K, M]` (colwise),
    and rstd `[M]` (None without the norm). `col_data` is a `[K, M]` view whose rows are `colwise_row_stride(M)`
    bytes apart. Scales are flat 128x4 blocked layouts, or plain `[M, K/32]` / `[K, ceil(M/32)]` matrices, the
    latter the transposed view of a contiguous `[ceil(M/32), K]` tensor (strides `(1, K)`).
    `row_operand` and `col_operand`: the dequantized casts in BF16, both laid out as y, `[R, K]` with R >= M rows
    (zeros past M); a GEMM contracting over M reads `col_operand` transposed. `column_sums`: x's FP32 column sums
    `[K]`. Outputs not asked for are None."""

    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    rstd: torch.Tensor | None
    row_operand: torch.Tensor | None = None
    col_operand: torch.Tensor | None = None
    column_sums: torch.Tensor | None = None


def _new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized output buffer (the kernel writes every byte; tests fill these with garbage to check that)."""
    return torch.empty(shape, dtype=dtype, device=device)


def unsupported(x: torch.Tensor) -> str | None:
    """Why the kernel cannot take `x [M, K]` (None when it can)."""
    K = x.shape[-1]
    if K % BLOCK:
        return f"K={K} is not a multiple of {BLOCK}"
    if K > max_k():
        return f"K={K} is above the kernel's {max_k()}"
    return None


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """Which outputs a build writes (see `NormMXCast`)."""
    rowwise: bool = True
    colwise: bool = True
    row_operand: bool = False
    col_operand: bool = False
    column_sums: bool = False
    silu: bool = False


_MX_CASTS = _Outputs()


def _build(dtype, w_dtype, K: int, launch: NormLaunch, normalize: bool, rceil: bool, blocked: bool,
           outputs: _Outputs = _MX_CASTS):
    key = (dtype, w_dtype, K, launch, normalize, rceil, blocked, outputs)
    fn = _COMPILED.get(key)
    if fn is None:
        vec = 128 // dtype.width
        m = cute.sym_int()
        x = make_fake_tensor(dtype, (m, K), divisibility=vec)
        w = make_fake_tensor(w_dtype, (K,), divisibility=1) if normalize else None

        def flat(dt, wanted: bool, divisibility: int = 16):
            return make_fake_tensor(dt, (cute.sym_int(),), divisibility=divisibility) if wanted else None

        casts = [flat(cutlass.Uint8, outputs.rowwise), flat(cutlass.Uint8, outputs.rowwise),
                 flat(cutlass.Uint8, outputs.colwise), flat(cutlass.Uint8, outputs.colwise)]
        rstd = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), divisibility=1) if normalize else None
        operands = [flat(cutlass.BFloat16, outputs.row_operand, 8), flat(cutlass.BFloat16, outputs.col_operand, 8),
                    flat(cutlass.Float32, outputs.column_sums, 4)]
        kernel = NormMXCast(dtype, K, launch.tile_k, launch.cluster_n, normalize, rceil, blocked,
                            **dataclasses.asdict(outputs))
        fn = _COMPILED[key] = cute.compile(
            kernel, x, w, *casts, rstd, *operands, cutlass.Int32(16), cutlass.Float32(0.0),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    return fn


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when its rows start at 16-byte aligned addresses with a contiguous last dim (what the kernel's
    16-byte `cp.async` copies need), else a contiguous copy."""
    if fake_mode():  # a build: the layout is the compiled one (16-byte aligned rows)
        return x
    rows_aligned = x.shape[0] <= 1 or (x.stride(0) * x.element_size()) % 16 == 0
    if x.stride(1) == 1 and rows_aligned and x.data_ptr() % 16 == 0:
        return x
    return x.contiguous()


def norm_mx_cast(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0, *, scaling: str = "rceil",
                 blocked_scales: bool = True, arch: str | None = None, launch: NormLaunch | None = None,
                 rowwise: bool = True, colwise: bool = True, row_operand: bool = False, col_operand: bool = False,
                 operand_rows: int | None = None, column_sums: bool = False,
                 activation: str | None = None) -> NormCastOutputs:
    """RMSNorm of `x [M, K]` (or x itself when `weight` is None) cast to MXFP8 rowwise and colwise, one launch.

    Args:
        x: `[M, K]` float32/bfloat16/float16, K a multiple of 32 (at most `config.max_k()`), any M >= 0.
        weight: `[K]` norm weight (any float dtype), or None for the dual cast of x.
        eps: added to the mean of squares (FP32).
        scaling: "rceil" or "floor".
        blocked_scales: scales in the 128x4 blocked layout (with its zero padding) instead of plain matrices.
        arch: the build's target (default: the device's); for builds without a GPU.
        launch: another launch than the table's (`config.NormLaunch`; benchmarks compare them). The bytes written do
            not depend on it.
        rowwise, colwise: write the MX casts (payloads and scales).
        row_operand, col_operand: write the dequantized casts in BF16, the operands a BF16 GEMM multiplies exactly
            (`[R, K]` both, laid out as y), with `operand_rows` = R >= M rows (default M; rows M.. are zeros, e.g.
            for a GEMM that runs at a bucketed M).
        column_sums: also x's FP32 column sums `[K]` (`weight` None: a linear layer's bias gradient from the pass
            that casts its dY), added atomically per 32-row block: equal to `x.float().sum(0)` within FP32
            rounding, in an order that changes from run to run.
        activation: None, or "silu" (`weight` None, no column sums): the outputs are those of y = SiLU(x) as torch
            computes it on the GPU in x's dtype, made on the fly (y is never stored).
    At least one cast or operand must be asked for.
    """
    M, K = x.shape
    dev = x.device
    if not (rowwise or colwise or row_operand or col_operand):
        raise ValueError("norm_mx_cast: ask for at least one of rowwise, colwise, row_operand, col_operand")
    rows = M if operand_rows is None else operand_rows
    if rows < M:
        raise ValueError(f"operand_rows must be >= M={M}, got {operand_rows}")
    if column_sums and weight is not None:
        raise ValueError("column_sums=True needs weight=None (the sums are of x, for a dual cast without the norm)")
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if activation is not None and (weight is not None or column_sums):
        raise ValueError(f"activation={activation!r} needs weight=None and column_sums=False (an input activation is "
                         "applied to x before the casts, without the norm)")
    x = _aligned_rows(x)
    normalize = weight is not None
    if normalize:
        weight = weight.contiguous()
    k_blocks, m_blocks = K // BLOCK, ceil_div(M, BLOCK)
    row_data = row_scale = col_data = col_scale = col_buf = row_op = col_op = None
    stride = colwise_row_stride(M)
    if rowwise:
        row_data = _new_buffer((M, K), PAYLOAD_DTYPE, dev)
        row_scale = _new_buffer((blocked_size(M, k_blocks),) if blocked_scales else (M, k_blocks), SCALE_DTYPE, dev)
    if colwise:
        col_buf = _new_buffer((K * stride,), PAYLOAD_DTYPE, dev)
        col_data = col_buf.as_strided((K, M), (stride, 1))
        # plain: row block by row block, the kernel storing each row block's K bytes as one run
        col_scale = _new_buffer((blocked_size(K, m_blocks),), SCALE_DTYPE, dev) if blocked_scales else \
            _new_buffer((m_blocks, K), SCALE_DTYPE, dev).t()
    fake = fake_mode()  # a build: nothing is written
    if row_operand:
        row_op = _new_buffer((rows, K), torch.bfloat16, dev)
        if rows > M and not fake:
            row_op[M:].zero_()
    if col_operand:
        col_op = _new_buffer((rows, K), torch.bfloat16, dev)
        if rows > M and not fake:
            col_op[M:].zero_()
    rstd = _new_buffer((M,), torch.float32, dev) if normalize else None
    sums = torch.zeros(K, dtype=torch.float32, device=dev) if column_sums else None
    out = NormCastOutputs(row_data, row_scale, col_data, col_scale, rstd, row_op, col_op, sums)
    if M == 0:
        return out
    scaling_key = scaling == "rceil"
    w_dtype = weight.dtype if normalize else None
    outputs = _Outputs(rowwise, colwise, row_operand, col_operand, column_sums, activation == "silu")
    if launch is None:  # the common call: one dict lookup for the built kernel (host time counts at small M)
        key = (x.dtype, w_dtype, K, scaling_key, blocked_scales, arch or dev, outputs)
        fn = _DEFAULT_BUILDS.get(key)
        if fn is None:
            fn = _DEFAULT_BUILDS[key] = _build(
                torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[w_dtype] if normalize else None, K,
                launch_for(arch or build_arch(dev), K), normalize, scaling_key, blocked_scales, outputs)
    elif not (launch.tile_k % 128 == 0 and 0 < launch.tile_k <= MAX_TILE_K and launch.cluster_n <= MAX_CLUSTER
              and launch.cluster_n * launch.tile_k >= K > (launch.cluster_n - 1) * launch.tile_k):
        raise ValueError(f"launch {launch} does not cover K={K} (tile_k a multiple of 128 up to {MAX_TILE_K}, "
                         f"cluster_n up to {MAX_CLUSTER}, every CTA holding columns)")
    else:
        fn = _build(torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[w_dtype] if normalize else None, K, launch,
                    normalize, scaling_key, blocked_scales, outputs)
    if not fake:  # col_scale.t(): the plain matrix's storage (a flat blocked layout is its own transpose)
        fn(x, weight, None if row_data is None else row_data.view(torch.uint8).view(-1),
           None if row_scale is None else row_scale.view(-1), None if col_buf is None else col_buf.view(torch.uint8),
           None if col_scale is None else col_scale.t().view(-1), rstd, None if row_op is None else row_op.view(-1),
           None if col_op is None else col_op.view(-1), sums, stride, float(eps))
    return out


