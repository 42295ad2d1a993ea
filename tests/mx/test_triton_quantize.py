"""Triton MX casts (rowwise, colwise, dual, square) against the reference, byte for byte.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), on tiny shapes; on a CUDA machine
the same tests run the compiled kernels (hardware E4M3 conversion), and the `gpu` tests add large shapes
and compare the hardware conversion with the integer one.
"""
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from byte_checks import assert_same_bytes

from gem_lp.mx import MXTensor, dequantize, quantize, quantize_dual, quantize_reference, to_blocked
from benchmarks.cast_candidates import QUANTIZE_CANDIDATE_CONFIGS
from gem_lp.mx.kernels.triton_quantize import mx_cast_2d

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALINGS = ("rceil", "floor")
MS = (1, 31, 32, 33, 63, 100, 128, 129)
KS = (32, 64, 96, 160)
# NaN/Inf inputs make numpy (the interpreter) warn about the invalid products it is asked to compute.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Launch configurations (tile, thread strips): each moves the work between lanes and registers
# differently; thread_rows > 1 with M even takes the paired colwise store.
TILES = (
    dict(block_m=64, block_k=64, thread_rows=4),
    dict(block_m=32, block_k=32, thread_rows=1, row_blocks_in_thread=True),
    dict(block_m=32, block_k=128, thread_rows=16),
    dict(block_m=128, block_k=64, thread_rows=8, row_blocks_in_thread=True),
    dict(block_m=64, block_k=32, thread_rows=32),
)


def tile_id(tile: dict) -> str:
    blocks = "b" if tile.get("row_blocks_in_thread") else ""
    return f"{tile['block_m']}x{tile['block_k']}r{tile['thread_rows']}{blocks}"

# log2 of the magnitudes drawn per dtype: 1e-30..1e30 where the dtype holds it, fp16's own range otherwise
_LOG2_RANGE = {torch.float32: (-100.0, 100.0), torch.bfloat16: (-100.0, 100.0), torch.float16: (-24.0, 14.9)}
_SUBNORMAL_LOG2 = {torch.float32: (-149.0, -127.0), torch.bfloat16: (-133.0, -127.0), torch.float16: (-24.0, -15.0)}


def mx_test_input(M: int, K: int, dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    """`[M, K]` values whose block maxima span the dtype's range, with special values in random blocks.

    Magnitudes are drawn per 8x8 patch (a centre and a spread), so 1x32 and 32x1 blocks both mix
    scales, many payloads land in E4M3's subnormal range or flush to zero, and a quarter of the
    significands have 5 bits (exact E4M3 rounding ties). Then, each with probability 1/2: zero
    blocks (+0 and -0), blocks of dtype subnormals, values at 448/480/512 times a power of two,
    the dtype's largest finite value, NaN, +Inf and -Inf.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    def randint(n, *shape):
        return torch.randint(0, n, shape, generator=g)

    lo, hi = _LOG2_RANGE[dtype]
    pm, pk = math.ceil(M / 8), math.ceil(K / 8)
    centre = (lo + (hi - lo) * rand(pm, pk)).repeat_interleave(8, 0).repeat_interleave(8, 1)[:M, :K]
    spread = torch.tensor([0.0, 2.0, 8.0, 40.0], dtype=torch.float64)[randint(4, pm, pk)]
    spread = spread.repeat_interleave(8, 0).repeat_interleave(8, 1)[:M, :K]
    log2 = (centre - spread * rand(M, K)).clamp(min=lo)
    mant = 1 + rand(M, K)
    mant = torch.where(rand(M, K) < 0.25, (mant * 32).floor() / 32, mant)
    sign = torch.where(rand(M, K) < 0.5, -1.0, 1.0)
    x = sign * mant * torch.exp2(log2)

    def some(n_max):  # 0 with probability 1/2, else 1..n_max
        return 0 if rand(1).item() < 0.5 else 1 + randint(n_max).item()

    def random_row_block():
        r, kb = randint(M).item(), randint(K // 32).item()
        return r, slice(32 * kb, 32 * kb + 32)

    for _ in range(some(3)):  # zero 1x32 blocks
        r, cols = random_row_block()
        x[r, cols] = torch.where(rand(32) < 0.5, -0.0, 0.0)
    for _ in range(some(2)):  # zero 32x32 tile (zero colwise blocks too)
        r0, c0 = 32 * randint(math.ceil(M / 32)).item(), 32 * randint(K // 32).item()
        x[r0:r0 + 32, c0:c0 + 32] = 0.0
    x.view(-1)[randint(M * K, some(8))] = -0.0
    slo, shi = _SUBNORMAL_LOG2[dtype]
    for _ in range(some(3)):  # blocks of the dtype's subnormals
        r, cols = random_row_block()
        x[r, cols] = torch.exp2(slo + (shi - slo) * rand(32))
    n = some(6)
    if n:  # block maxima at the E4M3 / scale boundaries
        base = torch.tensor([448.0, 480.0, 512.0, 464.0, 447.0, 449.0], dtype=torch.float64)[randint(6, n)]
        jlo, jhi = (-20, 6) if dtype == torch.float16 else (-120, 118)
        base = base * torch.exp2(torch.randint(jlo, jhi, (n,), generator=g).double())
        x.view(-1)[randint(M * K, n)] = base * torch.where(rand(n) < 0.5, -1.0, 1.0)
    finfo_max = torch.finfo(dtype).max
    x.view(-1)[randint(M * K, some(2))] = finfo_max
    x.view(-1)[randint(M * K, some(2))] = -finfo_max
    for special in (math.nan, math.inf, -math.inf):
        x.view(-1)[randint(M * K, some(2))] = special
    return x.to(dtype).to(device)


def expected_casts(x, scaling, *, rowwise, colwise, square, blocked):
    """The reference's bytes in `mx_cast_2d`'s output order."""
    out = []
    if rowwise:
        r = quantize_reference(x, axis=1, scaling=scaling)
        out += [r.data, to_blocked(r.scale) if blocked else r.scale]
    if colwise:
        c = quantize_reference(x.t(), axis=1, scaling=scaling, allow_partial=True)
        out += [c.data, to_blocked(c.scale) if blocked else c.scale]
    if square:
        s = quantize_reference(x, block="square", scaling=scaling)
        out += [s.data, s.scale]
    return out


def check_cast(x, scaling, *, rowwise, colwise, square, blocked, tile=None, tag="", **options):
    outs = mx_cast_2d(x, rowwise=rowwise, colwise=colwise, square=square, scaling=scaling,
                      blocked_scales=blocked, **(tile or {}), **options)
    exp = expected_casts(x, scaling, rowwise=rowwise, colwise=colwise, square=square, blocked=blocked)
    names = [n for flag, pair in ((rowwise, ("row payload", "row scale")), (colwise, ("col payload", "col scale")),
                                  (square, ("square payload", "square scale"))) if flag for n in pair]
    assert len(outs) == len(exp)
    for out, ref, name in zip(outs, exp, names):
        assert_same_bytes(out, ref, f"{name} {tag}")


# Every shape once per two (dtype, scaling, scale layout, tile) combinations, rotating so that each
# combination meets many shapes; square joins the launch whenever M allows it.
COMBOS = list(itertools.product(DTYPES, SCALINGS, (False, True)))
CASES = [(M, K, COMBOS[(5 * i + j) % len(COMBOS)], TILES[(i + j) % len(TILES)], 100 * i + j)
         for i, (M, K) in enumerate(itertools.product(MS, KS)) for j in range(2)]


@pytest.mark.parametrize("M,K,combo,tile,seed", CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2][0]}-{c[2][1]}-{'blk' if c[2][2] else 'plain'}-{tile_id(c[3])}"
                              for c in CASES])
def test_dual_and_square_match_reference(M, K, combo, tile, seed):
    dtype, scaling, blocked = combo
    x = mx_test_input(M, K, dtype, seed)
    check_cast(x, scaling, rowwise=True, colwise=True, square=M % 32 == 0, blocked=blocked, tile=tile,
               tag=f"seed={seed}")


@pytest.mark.parametrize("mode", ["rowwise", "colwise", "square"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_cast_matches_reference(mode, dtype):
    shapes = [(33, 96), (128, 64), (100, 160)] if mode != "square" else [(32, 96), (128, 64), (96, 160)]
    for i, (M, K) in enumerate(shapes):
        seed = 7000 + 10 * i + DTYPES.index(dtype)
        x = mx_test_input(M, K, dtype, seed)
        for scaling, blocked in ((SCALINGS[i % 2], False), (SCALINGS[(i + 1) % 2], mode != "square")):
            check_cast(x, scaling, rowwise=mode == "rowwise", colwise=mode == "colwise",
                       square=mode == "square", blocked=blocked, tile=TILES[i], tag=f"seed={seed}")


def test_non_contiguous_inputs():
    base = mx_test_input(96, 100, torch.bfloat16, 11)  # transposed view: x [100, 96], strides (1, 100)
    check_cast(base.t(), "rceil", rowwise=True, colwise=True, square=False, blocked=True, tag="transposed")
    wide = mx_test_input(64, 128, torch.float32, 12)  # column-strided view: x [64, 64], strides (128, 2)
    check_cast(wide[:, ::2], "floor", rowwise=True, colwise=True, square=True, blocked=False, tag="strided")


def test_int64_offsets_give_the_same_bytes(monkeypatch):
    """The int64 in-tile offsets used for huge tensors, forced on a small one."""
    import gem_lp.mx.kernels.triton_quantize as tq

    monkeypatch.setattr(tq, "_INT32_SPAN", 0)
    x = mx_test_input(100, 96, torch.bfloat16, 21)
    check_cast(x, "rceil", rowwise=True, colwise=True, square=False, blocked=True, tag="int64")
    check_cast(x[:96].t(), "floor", rowwise=True, colwise=True, square=True, blocked=False, tag="int64 transposed")


def test_grad_and_empty_inputs():
    x = mx_test_input(64, 64, torch.float32, 22).requires_grad_()
    assert not any(t.requires_grad for t in mx_cast_2d(x, rowwise=True, colwise=True))
    row, col = quantize_dual(torch.empty(0, 64, device=DEVICE), backend="triton")
    assert row.shape == (0, 64) and col.shape == (64, 0) and row.scale.numel() == 0 and col.scale.numel() == 0
    q = quantize(torch.empty(0, 3, 64, device=DEVICE), backend="triton")
    assert q.shape == (0, 3, 64) and q.scale.shape == (0, 3, 2)


def test_blocked_scale_padding_is_zero():
    x = torch.full((33, 96), 1e10, dtype=torch.float32, device=DEVICE)  # every real scale byte is non-zero
    row_data, row_scale, col_data, col_scale = mx_cast_2d(x, rowwise=True, colwise=True, blocked_scales=True)
    assert row_scale.numel() == 128 * 4 and col_scale.numel() == 128 * 4
    assert int((row_scale != 0).sum()) == 33 * 3 and int((col_scale != 0).sum()) == 96 * 2


# ----------------------------------------------------------------------------- public dispatch


def _assert_same_mx(actual: MXTensor, expected: MXTensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    assert (actual.block, actual.axis, actual.scaling, actual.orig_dtype, actual.scale_layout) == \
        (expected.block, expected.axis, expected.scaling, expected.orig_dtype, expected.scale_layout), what
    assert_same_bytes(actual.data, expected.data, f"{what} payload")
    assert_same_bytes(actual.scale, expected.scale, f"{what} scale")
    torch.testing.assert_close(dequantize(actual), dequantize(expected), rtol=0, atol=0, equal_nan=True)


DISPATCH_CASES = ["last-axis-3d", "last-axis-1d", "axis0-2d", "square-3d", "blocked-2d", "last-axis-transposed"]


@pytest.mark.parametrize("case", DISPATCH_CASES)
def test_quantize_triton_matches_reference(case):
    x2 = mx_test_input(96, 64, torch.bfloat16, 500 + DISPATCH_CASES.index(case))
    kwargs = {}
    if case == "last-axis-3d":
        x = x2.reshape(3, 32, 64)
    elif case == "last-axis-1d":
        x = x2[5]
    elif case == "axis0-2d":
        x, kwargs = x2, dict(axis=0)
    elif case == "square-3d":
        x, kwargs = x2.reshape(3, 32, 64), dict(block="square")
    elif case == "blocked-2d":
        x, kwargs = x2, dict(scale_layout="blocked")
    else:
        x = x2.t()
    for scaling in SCALINGS:
        ours = quantize(x, scaling=scaling, backend="triton", **kwargs)
        ref = quantize(x, scaling=scaling, backend="reference", **kwargs)
        _assert_same_mx(ours, ref, case)


@pytest.mark.parametrize("M,K,dtype", [(1, 32, torch.float32), (100, 96, torch.bfloat16), (129, 64, torch.float16)])
def test_quantize_dual_matches_reference(M, K, dtype):
    x = mx_test_input(M, K, dtype, M + K)
    for scaling in SCALINGS:
        row, col = quantize_dual(x, scaling=scaling, backend="triton")
        ref_row, ref_col = quantize_dual(x, scaling=scaling, backend="reference")
        _assert_same_mx(row, ref_row, "rowwise")
        _assert_same_mx(col, ref_col, "colwise")
        # the kernel's colwise payload: a [K, M] view, rows 32 bytes apart (contiguous when M is a multiple of 32)
        assert col.shape == (K, M) and col.data.stride() == (-(-M // 32) * 32, 1) and col.scale_layout == "blocked"
        # the colwise cast is the quantization of x^T along its last dim, partial last block included
        torch.testing.assert_close(col.plain_scale(),
                                   quantize_reference(x.t(), axis=1, scaling=scaling, allow_partial=True).scale,
                                   rtol=0, atol=0)


def test_quantize_auto_falls_back_and_explicit_triton_refuses():
    x = mx_test_input(64, 64, torch.float32, 3).reshape(2, 32, 64)
    # axis 1 of a 3-D tensor is not a kernel layout: auto runs the reference, triton says why
    ref = quantize_reference(x, axis=1)
    _assert_same_mx(quantize(x, axis=1, backend="auto"), ref, "auto")
    with pytest.raises(ValueError, match="last axis or along axis 0 of a 2-D tensor"):
        quantize(x, axis=1, backend="triton")


def test_errors():
    x = torch.randn(64, 96, device=DEVICE)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(K\) must be a multiple of 32, got 40"):
        mx_cast_2d(torch.randn(64, 40, device=DEVICE))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(torch.randn(64, 40, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_dual(torch.randn(64, 40, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match=r"x.shape\[0\] has size 33"):
        quantize(torch.randn(33, 64, device=DEVICE), axis=0, backend="triton")
    with pytest.raises(ValueError, match="M\\) to be a multiple of 32, got 33"):
        mx_cast_2d(torch.randn(33, 64, device=DEVICE), rowwise=False, square=True)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        mx_cast_2d(x.double())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.int32"):
        quantize_dual(x.to(torch.int32), backend="triton")
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\], got shape \(2, 32, 96\)"):
        mx_cast_2d(x.reshape(2, 32, 96))
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\]"):
        quantize_dual(x.reshape(2, 32, 96), backend="triton")
    with pytest.raises(ValueError, match="at least one of rowwise, colwise, square"):
        mx_cast_2d(x, rowwise=False)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 32, got 48"):
        mx_cast_2d(x, block_m=48)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        mx_cast_2d(x, num_warps=3)
    with pytest.raises(ValueError, match="scaling must be one of"):
        mx_cast_2d(x, scaling="round")
    with pytest.raises(ValueError, match="scale_layout='blocked' needs block='1d' along the last axis"):
        quantize(x, axis=0, scale_layout="blocked", backend="triton")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        quantize(x, scale_layout="swizzled")


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA tensor \\(got device cpu\\)"):
        mx_cast_2d(torch.randn(32, 32))


def test_torch_compile_fullgraph():
    def cast(x):
        row, col = quantize_dual(x, backend="triton")
        last = quantize(x, backend="triton", scaling="floor")
        square = quantize(x, block="square", backend="triton")
        return row, col, last, square

    x = mx_test_input(64, 96, torch.bfloat16, 5)
    eager = cast(x)
    torch._dynamo.reset()
    compiled = torch.compile(cast, fullgraph=True)(x)
    for a, b, what in zip(compiled, eager, ("rowwise", "colwise", "last axis", "square")):
        _assert_same_mx(a, b, what)


_HOPPER_COMPILE = """
import json, torch
from gem_lp.mx.kernels.triton_quantize import (CastConfig, _mx_cast_2d_kernel, cast_2d_launch, compile_for_target,
                                       default_config, output_specs, ptxas_usage)
FLAGS = dict(rowwise=(True, False, False), colwise=(False, True, False), dual=(True, True, False),
             square=(False, False, True), all=(True, True, True), colsq=(False, True, True))
# the GPU's default configurations (no interpreter here) for every set of casts
builds = [(mode, default_config(*FLAGS[mode]), 4096, 2048) for mode in FLAGS]
builds += [("all", CastConfig(64, 64, 2, 8), 4000, 2016),  # partial tiles, masks
           ("dual", CastConfig(32, 32, 1, 1, True), 1001, 96)]  # odd M: colwise without pairs
for mode, config, M, K in builds:
    x = torch.empty(M, K, dtype=torch.bfloat16)
    flags = FLAGS[mode]
    outs = [torch.empty(shape, dtype=dtype) for shape, dtype, _ in output_specs(M, K, *flags, True)]
    grid, args, kwargs = cast_2d_launch(x, outs, *flags, True, True, config, True)
    ptx = compile_for_target(_mx_cast_2d_kernel, args, kwargs).asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    print(json.dumps(dict(mode=mode, config=list(config), M=M, regs=regs, spills=spills,
                          cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"), st_vec=ptx.count("st.global.v4") + ptx.count("st.global.v2"),
                          ld_v4=ptx.count("ld.global.v4"))))
"""


def test_kernel_compiles_for_hopper_with_hardware_cast():
    """The CUDA builds (sm_90, no GPU needed) of the default launch configurations and of the masked and
    odd-M paths: hardware E4M3 conversion, 16-byte loads, no register spills, and vector (8- or 16-byte)
    stores of the transposed colwise payload (the thread strips at work)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="0")  # a compiled, not interpreted, kernel object
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(builds) == 8, done.stdout
    for b in builds:
        assert b["cvt"] > 0 and b["ld_v4"] > 0 and b["spills"] == 0, b
        if b["mode"] in ("colwise", "dual") and b["M"] == 4096:
            assert b["st_vec"] > 0, b


# ----------------------------------------------------------------------------- GPU


def _gpu_input(M, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g) * torch.exp2(
        torch.randint(-60, 60, (M, 1), device="cuda", generator=g).float())
    flat = x.view(-1)
    idx = torch.randint(0, M * K, (64,), device="cuda", generator=g)
    flat[idx[:8]] = math.nan
    flat[idx[8:16]] = math.inf
    flat[idx[16:24]] = -math.inf
    flat[idx[24:32]] = 0.0
    flat[idx[32:40]] = 480.0
    return x.to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,transposed", [((8192, 4096), False), ((1000, 4096), False), ((4096, 1000), True)],
                         ids=["8192x4096", "1000x4096", "4096x1000-transposed"])
def test_gpu_large_shapes_match_reference(shape, transposed):
    x = _gpu_input(*shape, seed=shape[0])
    if transposed:
        x = x.t()  # [1000, 4096] view with strides (1, 1000)
    M = x.shape[0]
    for scaling in SCALINGS:
        check_cast(x, scaling, rowwise=True, colwise=True, square=M % 32 == 0, blocked=True, tag="dual")
        check_cast(x, scaling, rowwise=True, colwise=False, square=False, blocked=False, tag="rowwise")
        check_cast(x, scaling, rowwise=False, colwise=True, square=False, blocked=True, tag="colwise")
        if M % 32 == 0:
            check_cast(x, scaling, rowwise=False, colwise=False, square=True, blocked=False, tag="square")


@pytest.mark.gpu
def test_gpu_hardware_and_integer_e4m3_rounding_agree():
    x = _gpu_input(4096, 2048, seed=1)
    for scaling in SCALINGS:
        hw = mx_cast_2d(x, rowwise=True, colwise=True, square=True, scaling=scaling, hw_cast=True)
        sw = mx_cast_2d(x, rowwise=True, colwise=True, square=True, scaling=scaling, hw_cast=False)
        for a, b in zip(hw, sw):
            assert_same_bytes(a, b, f"hw vs integer cast ({scaling})")
    small = mx_test_input(129, 160, torch.float32, 99)  # ties, subnormals, boundaries
    for dtype in DTYPES:
        xs = small.to(dtype)
        for hw_cast in (True, False):
            outs = mx_cast_2d(xs, rowwise=True, colwise=True, hw_cast=hw_cast)
            for out, ref in zip(outs, expected_casts(xs, "rceil", rowwise=True, colwise=True, square=False,
                                                     blocked=False)):
                assert_same_bytes(out, ref, f"{dtype} hw_cast={hw_cast}")


GPU_CONFIGS = [(variant, config) for variant, configs in QUANTIZE_CANDIDATE_CONFIGS.items() for config in configs]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("variant,config", GPU_CONFIGS, ids=[f"{v}-{c!r}".replace(" ", "_") for v, c in GPU_CONFIGS])
def test_gpu_every_candidate_config_matches_reference(variant, config):
    """Every configuration the benchmark times, with the hardware cast, on NaN/Inf/zero/480 inputs, even
    and odd M (paired and byte-wise colwise stores), full and partial tiles."""
    bm, bk, nw, tr, rb = config
    flags = dict(rowwise=variant in ("rowwise", "dual"), colwise=variant in ("colwise", "dual"),
                 square=variant == "square")
    for M, K in ((4096, 2048), (1000, 480), (999, 96)):
        if flags["square"] and M % 32:
            continue
        x = _gpu_input(M, K, seed=M + bm)
        check_cast(x, "rceil", blocked=not flags["square"], tag=f"{variant} {config!r} {M}x{K}",
                   block_m=bm, block_k=bk, num_warps=nw, thread_rows=tr, row_blocks_in_thread=rb, **flags)
