"""Host side of the MX GEMM on sm_90: argument checks, the per-arch launch table, one build per (N, K, output
dtype, bias, launch) with M dynamic, and the launch through TVM FFI. Under `FakeTensorMode` the kernel is built and
not launched (`gem_lp.compile_check`).

The kernel is quack's `GemmDefaultSm90` (persistent, cooperative, TMA epilogue, bias as its row-vector operand) with
`transform.MXTransformA` as its A-operand transform; it is compiled by quack's `compile_gemm_kernel`. quack's generic
plan layer (`quack.gemm_runtime.host.build_gemm_epi_plan`) is not used: its layout-owning-transform path is the
weight-only GEMM's orientation (the transformed operand is N, the activations are B, D is transposed).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from gem_lp.runtime.builds import register_cache
from gem_lp.runtime.device import build_arch, fake_mode, sm_count
from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE, SCALE_DTYPE, ceil_div
from gem_lp.mx.layout import blocked_size, to_blocked

OUT_DTYPES = (torch.bfloat16, torch.float32)
# D's rows start 16 bytes apart (TMA): N a multiple of 8 for BF16 Y, of 4 for FP32 Y; quack's tiles need N % 8 too.
N_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """CTA tile (tile_m x tile_n, tile_K = 128: one blocked scale tile) and cluster along N."""

    tile_m: int = 128
    tile_n: int = 128
    cluster_n: int = 1


# Per-arch launch tables: (N, K) -> launch; shapes not listed take the arch's default: the fastest candidate of
# `benchmarks.bench_mx_gemm` per shape.
SM90_DEFAULT = GemmLaunch(128, 128, 1)
SM90: dict[tuple[int, int], GemmLaunch] = {
    (3072, 1024): GemmLaunch(128, 192, 1),
    (4096, 1024): GemmLaunch(128, 192, 1),
    (1536, 512): GemmLaunch(128, 192, 1),
    (768, 256): GemmLaunch(128, 256, 1),
}
TABLES = {"sm_90a": (SM90, SM90_DEFAULT)}

_COMPILED: dict[tuple, object] = register_cache("linear.gemm", {})


def _compile(launch: GemmLaunch, mA, mS, mB, mD, epi, **split):
    """quack's `GemmDefaultSm90` with our MX A transform (A `mA` + scale words `mS` decoded in registers) for these
    fake operands; `split`: quack's split-K arguments."""
    import cutlass
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_scheduler_args
    from quack.operand_transform import TransformAOperand

    from gem_lp.linear.kernels.cute_gemm_transform import SCALE_TILE_K, MXTransformA

    return compile_gemm_kernel(
        GemmDefaultSm90, cutlass.BFloat16, (launch.tile_m, launch.tile_n, SCALE_TILE_K), (1, launch.cluster_n, 1),
        False, True, False, False, (9, 0), TransformAOperand(mA, mS), mB, mD, None, epi,
        make_fake_scheduler_args(False, False, 1), None, transform_a=MXTransformA, **split)


def launch_for(arch: str, N: int, K: int) -> GemmLaunch:
    if arch not in TABLES:
        raise ValueError(f"mx_gemm_sm90 has launch tables for {sorted(TABLES)}, not {arch!r}")
    table, default = TABLES[arch]
    return table.get((N, K), default)


def check_args(a_payload: torch.Tensor, a_scale: torch.Tensor, b_bf16: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> None:
    """ValueError / TypeError naming the argument and the expected form (module `gem_lp.gemm.cute` docstring)."""
    if not isinstance(a_payload, torch.Tensor) or a_payload.dim() != 2:
        raise ValueError(f"a_payload must be a 2-D [M, K] tensor, got {getattr(a_payload, 'shape', a_payload)}")
    if a_payload.dtype != PAYLOAD_DTYPE:
        raise TypeError(f"a_payload must be {PAYLOAD_DTYPE} (E4M3 payload), got {a_payload.dtype}")
    M, K = a_payload.shape
    if K == 0 or K % BLOCK:
        raise ValueError(f"a_payload [M, K] needs K a positive multiple of {BLOCK}, got K={K}")
    if a_payload.stride(1) != 1 and K > 1:
        raise ValueError(f"a_payload must be contiguous along K (stride 1), got strides {a_payload.stride()}")
    if not isinstance(b_bf16, torch.Tensor) or b_bf16.dim() != 2 or b_bf16.shape[1] != K:
        raise ValueError(f"b_bf16 must be a 2-D [N, K={K}] tensor (K-major weight), got "
                         f"{tuple(getattr(b_bf16, 'shape', ()))}")
    if b_bf16.dtype != torch.bfloat16:
        raise TypeError(f"b_bf16 must be torch.bfloat16 (the MX-exact BF16 weight), got {b_bf16.dtype}")
    N = b_bf16.shape[0]
    if N == 0 or N % N_MULTIPLE:
        raise ValueError(f"b_bf16 [N, K] needs N a positive multiple of {N_MULTIPLE}, got N={N}")
    if a_scale.dtype not in (SCALE_DTYPE, torch.float8_e8m0fnu):
        raise TypeError(f"a_scale must be uint8 E8M0 bytes (or float8_e8m0fnu), got {a_scale.dtype}")
    kb = K // BLOCK
    if a_scale.dim() == 1:
        if a_scale.numel() != blocked_size(M, kb):
            raise ValueError(f"a_scale (flat, blocked 128x4 layout) must hold blocked_size(M={M}, K/32={kb}) = "
                             f"{blocked_size(M, kb)} bytes, got {a_scale.numel()}")
    elif a_scale.dim() == 2:
        if tuple(a_scale.shape) != (M, kb):
            raise ValueError(f"a_scale (plain layout) must be [M, K/32] = [{M}, {kb}], got {tuple(a_scale.shape)}")
    else:
        raise ValueError(f"a_scale must be the flat blocked layout or a plain [M, K/32] matrix, got "
                         f"{a_scale.dim()}-D")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating [N={N}] vector or None, got "
                         f"{getattr(bias, 'dtype', None)} {tuple(getattr(bias, 'shape', ()))}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    devices = {t.device for t in (a_payload, a_scale, b_bf16, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"a_payload, a_scale, b_bf16 and bias must share a device, got {sorted(map(str, devices))}")


def _build(N: int, K: int, out_dtype: torch.dtype, has_bias: bool, launch: GemmLaunch):
    """The compiled kernel for these static parameters (M dynamic)."""
    key = (N, K, out_dtype, has_bias, launch)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90

    from gem_lp.linear.kernels.cute_gemm_transform import A_RUN, SCALE_TILE_K, SCALE_TILE_WORDS

    m, row_tiles = cute.sym_int(), cute.sym_int()
    col_tiles = ceil_div(K, SCALE_TILE_K)
    fake = cute.runtime.make_fake_tensor
    mA = fake(cutlass.Float8E4M3FN, (A_RUN, m, K // A_RUN), stride=(1, K, A_RUN), assumed_align=16)
    mS = fake(cutlass.Int32, (SCALE_TILE_WORDS, row_tiles, col_tiles),
              stride=(1, SCALE_TILE_WORDS * col_tiles, SCALE_TILE_WORDS), assumed_align=16)
    mB = fake(cutlass.BFloat16, (N, K), stride=(K, 1), assumed_align=16)
    d_dtype = cutlass.BFloat16 if out_dtype == torch.bfloat16 else cutlass.Float32
    mD = fake(d_dtype, (m, N), stride=(N, 1), assumed_align=16)
    bias = make_fake_tensor(cutlass.Float32, (N,), leading_dim=0, divisibility=4) if has_bias else None
    epi = GemmDefaultSm90.EpilogueArguments(mRowVecBroadcast=bias)
    fn = _COMPILED[key] = _compile(launch, mA, mS, mB, mD, epi)
    return fn


@functools.lru_cache(maxsize=None)
def _max_active_clusters(cluster_n: int, device_index: int) -> int:
    from quack.cute_dsl_utils import get_max_active_clusters

    return get_max_active_clusters(cluster_n, device_id=device_index)


def mx_gemm_sm90(a_payload: torch.Tensor, a_scale: torch.Tensor, b_bf16: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                 launch: GemmLaunch | None = None, arch: str | None = None) -> torch.Tensor:
    """`Y [M, N] = deq(A) @ B^T (+ bias)`, A the MX operand (payload + E8M0 scales along K), B a BF16 weight.

    Args:
        a_payload: `[M, K]` float8_e4m3fn, K a multiple of 32, contiguous along K (rows re-laid out contiguously
            otherwise); any M >= 0.
        a_scale: E8M0 bytes (uint8) of A per row per 32-wide k block: the flat 128x4 blocked layout
            (`gem_lp.mx.to_blocked`, `blocked_size(M, K/32)` bytes, padding bytes 0) -- what the kernel reads -- or
            the plain `[M, K/32]` matrix, which costs a `to_blocked` pass over the scales first.
        b_bf16: `[N, K]` bfloat16, K-major (the MX-exact BF16 weight), N a multiple of 8.
        bias: `[N]` float vector added in FP32, or None.
        out_dtype: torch.bfloat16 or torch.float32 (Y rounded once from the FP32 accumulator).
        launch: another launch than the arch table's (benchmarks compare them).
        arch: the build's target (default: the device's); for builds without a GPU.
    """
    check_args(a_payload, a_scale, b_bf16, bias, out_dtype)
    (M, K), N = a_payload.shape, b_bf16.shape[0]
    dev = a_payload.device
    y = torch.empty(M, N, dtype=out_dtype, device=dev)
    if M == 0:
        return y

    fake = fake_mode()
    if not fake and dev.type != "cuda":
        raise ValueError(f"mx_gemm_sm90 runs on a CUDA device (sm_90), got tensors on {dev}")
    arch = arch or build_arch(dev)
    launch = launch or launch_for(arch, N, K)
    fn = _build(N, K, out_dtype, bias is not None, launch)
    if fake:
        return y
    from quack.gemm_tvm_ffi_utils import make_scheduler_args
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.operand_transform import TransformAOperand

    from gem_lp.linear.kernels.cute_gemm_transform import A_RUN, SCALE_TILE_K, SCALE_TILE_WORDS

    a = a_payload if (a_payload.stride(0) == K and a_payload.data_ptr() % 16 == 0) else a_payload.contiguous()
    scale = a_scale.view(torch.uint8)
    if scale.dim() == 2:
        scale = to_blocked(scale)
    if scale.data_ptr() % 16:
        scale = scale.clone()
    b = b_bf16 if (b_bf16.stride(1) == 1 and b_bf16.stride(0) == K and b_bf16.data_ptr() % 16 == 0) \
        else b_bf16.contiguous()
    col_tiles, row_tiles = ceil_div(K, SCALE_TILE_K), ceil_div(M, 128)
    a_view = a.as_strided((A_RUN, M, K // A_RUN), (1, K, A_RUN))
    s_view = scale.view(torch.int32).as_strided((SCALE_TILE_WORDS, row_tiles, col_tiles),
                                                (1, SCALE_TILE_WORDS * col_tiles, SCALE_TILE_WORDS))
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    # the build's Constexpr fields (add_to_output, rounding_mode) are not call arguments: None at run time
    epi = GemmDefaultSm90.EpilogueArguments(mRowVecBroadcast=bias32, add_to_output=None, rounding_mode=None)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    sched = make_scheduler_args(_max_active_clusters(launch.cluster_n, index), 8, None)
    fn(TransformAOperand(a_view, s_view), b, y, None, epi, sched, None, None, None)
    return y


# ---- the weight gradient: dW = dY^T deq(X), contracted over the tokens --------------------------------------------

# Rows of A (K_in) and columns of dW per CTA tile; the tokens are split over CTAs (quack's serial split-K: each output
# tile's splits commit FP32 partials in split order, the last one finishes: the same bits on every run).
WGRAD_SM90 = GemmLaunch(128, 128, 1)
WGRAD_MIN_K_TILES = 8  # k-tiles (128 tokens) per split at least
# The most tiles of N (WGRAD_SM90.tile_n wide) at which the kernel beat the dequantize pass + cuBLAS (docs/PERF.md:
# 2 tiles 1.18-1.70x faster, 6 tiles 1.02x, 8 tiles 0.92x; each CTA decodes its A tile, once per tile of N).
WGRAD_MAX_N_TILES = {"sm_90a": 6}
TOKEN_ALIGN = 16  # the payload crosses as 16-byte runs: the tokens the GEMM contracts are M rounded up to this

_WGRAD: dict[tuple, object] = register_cache("linear.weight_grad", {})


def contracted_tokens(M: int) -> int:
    """The token count the weight-gradient GEMM contracts over: M rounded up to `TOKEN_ALIGN`."""
    return ceil_div(M, TOKEN_ALIGN) * TOKEN_ALIGN


def weight_grad_split(tiles: int, k_tiles: int, sms: int) -> int:
    """Splits of the token range per output tile: enough CTAs for every SM, each split at least
    `WGRAD_MIN_K_TILES` k-tiles."""
    return max(1, min(sms // max(tiles, 1), k_tiles // WGRAD_MIN_K_TILES))


def _build_weight_grad(N: int, out_dtype: torch.dtype, split_k: int, launch: GemmLaunch):
    """The compiled weight-gradient kernel: K_in, the token count and the strides dynamic; N, the output dtype, the
    split count and the launch static."""
    key = (N, out_dtype, split_k, launch)
    fn = _WGRAD.get(key)
    if fn is not None:
        return fn
    import cutlass
    import cutlass.cute as cute
    from quack.gemm_config import SplitKMode
    from quack.gemm_default_epi import GemmDefaultSm90

    from gem_lp.linear.kernels.cute_gemm_transform import A_RUN, SCALE_TILE_WORDS

    k_in, runs, tiles_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_tensor
    # A: the colwise payload X^T [K_in, tokens] (row stride a multiple of 16 bytes) as (16, K_in, tokens / 16)
    mA = fake(cutlass.Float8E4M3FN, (A_RUN, k_in, runs), stride=(1, cute.sym_int64(divisibility=16), A_RUN),
              assumed_align=16)
    mS = fake(cutlass.Int32, (SCALE_TILE_WORDS, cute.sym_int(), tiles_k),
              stride=(1, cute.sym_int64(divisibility=SCALE_TILE_WORDS), SCALE_TILE_WORDS), assumed_align=16)
    # B: dY's colwise operand [tokens, N] (row-major) seen as (N, tokens): N-major
    mB = fake(cutlass.BFloat16, (N, cute.sym_int()), stride=(1, N), assumed_align=16)
    d_dtype = cutlass.BFloat16 if out_dtype == torch.bfloat16 else cutlass.Float32
    # D: dW [N, K_in] (row-major) seen as (K_in, N): M-major
    mD = fake(d_dtype, (k_in, N), stride=(1, cute.sym_int64(divisibility=8)), assumed_align=16)
    epi = GemmDefaultSm90.EpilogueArguments()
    if split_k > 1:
        epi = GemmDefaultSm90.EpilogueArguments(
            split_k_semaphore=fake(cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                                   stride=(cute.sym_int64(), 1, cute.sym_int64()), assumed_align=4),
            split_k_workspace=fake(cutlass.Float32, tuple(cute.sym_int() for _ in range(4)),
                                   stride=(1, cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4),
                                           cute.sym_int64(divisibility=4)), assumed_align=16))
    fn = _WGRAD[key] = _compile(launch, mA, mS, mB, mD, epi, split_k=split_k, split_k_mode=SplitKMode.SERIAL)
    return fn


def weight_grad_taken(arch: str, M: int, dy_col: torch.Tensor) -> bool:
    """Whether a linear layer's backward takes `mx_weight_grad_sm90` for dW at M tokens, given dY's colwise operand
    `dy_col [N, rows]`: the arch's table has it faster than the dequantize pass + cuBLAS at this N, and the operand
    is one it reads (BF16, N a multiple of 8, rows covering M rounded up to 16; the cuBLAS route's padded rows do
    from M = 1024 on). The saved payload is always of its form (`colwise_payload_buffer`)."""
    N, rows = dy_col.shape
    return (ceil_div(N, WGRAD_SM90.tile_n) <= WGRAD_MAX_N_TILES.get(arch, 0) and dy_col.dtype == torch.bfloat16
            and N % N_MULTIPLE == 0 and rows >= contracted_tokens(M))


def check_weight_grad_args(x_payload: torch.Tensor, x_scale: torch.Tensor, dy_col: torch.Tensor,
                           out_dtype: torch.dtype) -> None:
    """ValueError / TypeError naming the argument and the expected form (`mx_weight_grad_sm90`)."""
    if not isinstance(x_payload, torch.Tensor) or x_payload.dim() != 2 or x_payload.dtype != PAYLOAD_DTYPE:
        raise ValueError(f"x_payload must be a 2-D [K, M] {PAYLOAD_DTYPE} tensor (X's colwise payload), got "
                         f"{getattr(x_payload, 'dtype', None)} {tuple(getattr(x_payload, 'shape', ()))}")
    K, M = x_payload.shape
    tokens = contracted_tokens(M)
    if K == 0 or (M > 1 and x_payload.stride(1) != 1) or x_payload.stride(0) % 16 or x_payload.stride(0) < tokens:
        raise ValueError(f"x_payload [K, M={M}] must have K > 0, a contiguous last dim and a row stride that is a "
                         f"multiple of 16 and >= {tokens} (colwise_payload_buffer), got shape "
                         f"{tuple(x_payload.shape)} strides {x_payload.stride()}")
    if x_scale.dtype not in (SCALE_DTYPE, torch.float8_e8m0fnu) or x_scale.dim() != 1 \
            or x_scale.numel() != blocked_size(K, ceil_div(M, BLOCK)):
        raise ValueError(f"x_scale must be the flat blocked E8M0 bytes of [K={K}, M/32] (blocked_size(K, "
                         f"ceil(M / 32)) = {blocked_size(K, ceil_div(M, BLOCK))} bytes), got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")
    if not isinstance(dy_col, torch.Tensor) or dy_col.dim() != 2 or dy_col.dtype != torch.bfloat16 \
            or dy_col.shape[1] < tokens or dy_col.stride(0) != 1 or dy_col.stride(1) != dy_col.shape[0]:
        raise ValueError(f"dy_col must be the [N, rows] transposed view of a contiguous bfloat16 [rows, N] tensor "
                         f"with rows >= {tokens} (zeros past M={M}), got {getattr(dy_col, 'dtype', None)} "
                         f"{tuple(getattr(dy_col, 'shape', ()))} strides {getattr(dy_col, 'stride', lambda: ())()}")
    if dy_col.shape[0] == 0 or dy_col.shape[0] % N_MULTIPLE:
        raise ValueError(f"dy_col [N, rows] needs N a positive multiple of {N_MULTIPLE}, got N={dy_col.shape[0]}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if x_payload.device != dy_col.device or x_scale.device != dy_col.device:
        raise ValueError("x_payload, x_scale and dy_col must share a device")


def mx_weight_grad_sm90(x_payload: torch.Tensor, x_scale: torch.Tensor, dy_col: torch.Tensor,
                        out_dtype: torch.dtype = torch.float32, *, launch: GemmLaunch | None = None,
                        split_k: int | None = None) -> torch.Tensor:
    """`dW [N, K] = dY_c^T deq(X_c)`: a linear layer's weight gradient from what its forward saved, X's colwise MX
    cast (payload + blocked scales along the tokens), and dY's colwise MX-exact BF16 operand; FP32 accumulation, dW
    rounded once to `out_dtype`. The payload is decoded in registers (the A transform of `mx_gemm_sm90`), so it is
    never written out as BF16.

    Args:
        x_payload: `[K, M]` float8_e4m3fn, rows `stride(0)` bytes apart (a multiple of 16, at least M rounded up
            to 16: `colwise_payload_buffer`). The padding bytes up to M rounded to 16 are read as part of the
            contraction: this function sets them to zero (they hold no data).
        x_scale: the flat blocked E8M0 bytes of `[K, ceil(M / 32)]` (padding bytes not 255).
        dy_col: `[N, rows]`, the transposed view of dY's colwise operand `[rows, N]` (contiguous BF16, rows >= M
            rounded up to 16, zeros past M), N a multiple of 8.
        launch, split_k: another tile or split than the defaults (benchmarks compare them).
    """
    check_weight_grad_args(x_payload, x_scale, dy_col, out_dtype)
    (K, M), N = x_payload.shape, dy_col.shape[0]
    dev = x_payload.device
    dw = torch.empty(N, K, dtype=out_dtype, device=dev)
    if M == 0:
        return dw.zero_()
    fake = fake_mode()
    if not fake and dev.type != "cuda":
        raise ValueError(f"mx_weight_grad_sm90 runs on a CUDA device (sm_90), got tensors on {dev}")
    from gem_lp.linear.kernels.cute_gemm_transform import A_RUN, SCALE_TILE_K, SCALE_TILE_WORDS

    launch = launch or WGRAD_SM90
    tokens = contracted_tokens(M)
    tiles = ceil_div(K, launch.tile_m) * ceil_div(N, launch.tile_n)
    index = 0 if fake else (torch.cuda.current_device() if dev.index is None else dev.index)
    if split_k is None:  # a build without a GPU takes an H100's / H200's 132 SMs
        split_k = weight_grad_split(tiles, ceil_div(tokens, SCALE_TILE_K), 132 if fake else sm_count(dev, 132))
    fn = _build_weight_grad(N, out_dtype, split_k, launch)
    if fake:
        return dw
    from quack.gemm import _split_k_buffers
    from quack.gemm_config import SplitKMode
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.gemm_tvm_ffi_utils import make_scheduler_args
    from quack.operand_transform import TransformAOperand

    stride = x_payload.stride(0)
    if tokens > M:  # the padding bytes the 16-byte runs read: no data, zeros for the contraction
        x_payload.as_strided((K, tokens - M), (stride, 1), x_payload.storage_offset() + M).view(torch.uint8).zero_()
    a_view = x_payload.as_strided((A_RUN, K, tokens // A_RUN), (1, stride, A_RUN))
    col_tiles = ceil_div(ceil_div(M, BLOCK), 4)
    s_view = x_scale.view(torch.uint8).view(torch.int32).as_strided(
        (SCALE_TILE_WORDS, ceil_div(K, 128), col_tiles), (1, SCALE_TILE_WORDS * col_tiles, SCALE_TILE_WORDS))
    b_view = dy_col[:, :tokens]
    d_view = dw.t()
    semaphore = workspace = None
    if split_k > 1:  # quack's per-tile flags and FP32 partials, laid out as its kernel reads them
        semaphore, workspace = _split_k_buffers(d_view[None], SplitKMode.SERIAL, launch.tile_m, launch.tile_n, 1,
                                                launch.cluster_n, False)
        semaphore, workspace = semaphore.permute(1, 2, 0), workspace.permute(3, 1, 2, 0)
    epi = GemmDefaultSm90.EpilogueArguments(add_to_output=None, rounding_mode=None, split_k_semaphore=semaphore,
                                            split_k_workspace=workspace)
    sched = make_scheduler_args(_max_active_clusters(launch.cluster_n, index), 8, None)
    fn(TransformAOperand(a_view, s_view), b_view, d_view, None, epi, sched, None, None, None)
    return dw


# ---- sm_100: quack's block-scaled GEMM (compiled, not launched yet) ---------------------------------------------------

# 2-CTA tcgen05 tile 256x256 (cluster 2x1), MXFP8 A and B with E8M0 scales per 32 k in the blocked layout. With the
# MX output epilogue 256x128: quack 0.6.5's row-direction scale store fails to build at tile N 256 (a copy of
# mismatched rank in its epilogue, 128x256 and 256x256 alike).
SM100_TILE_MN, SM100_CLUSTER = (256, 256), (2, 1, 1)
SM100_MX_OUT_TILE_MN = (256, 128)


def build_sm100_mxfp8(out_dtype: torch.dtype = torch.bfloat16, mx_out: str | None = None):
    """Build (never launch) quack's `GemmDefaultSm100` for `Y = deq(A) deq(B)^T`, A `[M, K]` and B `[N, K]` MXFP8
    (K-major) with blocked E8M0 scale factors, M, N, K dynamic: the sm_100 MX GEMM, whose MMA is the block-scaled
    `tcgen05.mma ... kind::mxf8f6f4.block_scale`. No public launch uses it yet (module `gem_lp.gemm.cute` docstring).

    `mx_out`: None (Y in `out_dtype`), or the GEMM + quantize epilogue (quack's `BlockScaleFactorStore`): Y written as
    E4M3 with blocked E8M0 scales, `"row"` one scale per 32 columns of a row (the next GEMM contracts over N) or
    `"col"` one per 32 rows of a column (a backward GEMM contracts over M). Its scales round up from amax / 448 and
    its payload rounds to nearest even, as `docs/numerics.md`'s rceil rule; quack writes one direction per
    launch, so both layouts of one output are two builds."""
    if mx_out not in (None, "row", "col"):
        raise ValueError(f"mx_out must be None, 'row' or 'col', got {mx_out!r}")
    key = ("sm100", out_dtype, mx_out)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    import cutlass
    from quack.gemm_default_epi import GemmDefaultSm100
    from quack.gemm_tvm_ffi_utils import (compile_gemm_kernel, make_fake_gemm_tensors, make_fake_scheduler_args,
                                          make_fake_sf_tensor)

    if mx_out is not None:
        d_dtype = cutlass.Float8E4M3FN
    else:
        d_dtype = cutlass.BFloat16 if out_dtype == torch.bfloat16 else cutlass.Float32
    mA, mB, mD, mC, _, _, _, l = make_fake_gemm_tensors(
        cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, d_dtype, None, "k", "k", "n", None, batched=False)
    sfa, sfb = (make_fake_sf_tensor(cutlass.Float8E8M0FNU, None) for _ in range(2))
    epi = {}
    if mx_out is not None:
        epi["mSFD" if mx_out == "row" else "mSFDCol"] = make_fake_sf_tensor(cutlass.Float8E8M0FNU, None)
    fn = _COMPILED[key] = compile_gemm_kernel(
        GemmDefaultSm100, cutlass.Float8E4M3FN, SM100_TILE_MN if mx_out is None else SM100_MX_OUT_TILE_MN,
        SM100_CLUSTER, False, True, False, False, (10, 0), mA, mB, mD, mC, GemmDefaultSm100.EpilogueArguments(**epi), make_fake_scheduler_args(False, False, l), None,
        mSFA=sfa, mSFB=sfb, sf_vec_size=32)
    return fn
