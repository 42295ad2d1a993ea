"""The CuTe RMSNorm + MX cast kernel (and the dual cast without the norm) on the GPU, byte for byte against the
reference. sm_90 / sm_100 with the CuTe DSL stack only.

rstd: on inputs whose FP32 sums of squares are exact (small integers times a power of two per row) the sum has no
order, so rstd must equal the CPU reference's bit for bit; on generic inputs it must be within 2 ulp. Payloads and
scales: always every byte of the reference quantization of `y = (fp32(x) * rstd) * fp32(w)` with the kernel's rstd
(everything after the sum of squares is the reference's arithmetic). The reference quantization runs on the GPU for
the large shapes: it is elementwise IEEE arithmetic, integer maxima and torch's software E4M3 rounding, the same
bits on both devices (the CPU reference is used for the small shapes and for rstd).
"""
import functools
import math

import pytest
import torch
from byte_checks import assert_same_bytes
import norm_inputs

from gem_lp.mx import dequantize, quantize_dual, quantize_reference, to_blocked
from gem_lp.norm import rms_norm_quantize

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu()

from gem_lp.mx.kernels import cute_cast_launch as cute_launch  # noqa: E402
from gem_lp.mx.kernels.cute_cast_config import NormLaunch  # noqa: E402
from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast  # noqa: E402

DEV = "cuda"
generic_input = functools.partial(norm_inputs.generic_input, device=DEV)
norm_weight = functools.partial(norm_inputs.norm_weight, device=DEV)
MS = (1, 31, 33, 127, 129, 32767, 32768)
KS = (256, 512, 1024, 4096)
GARBAGE_BYTE = 0xA5


@pytest.fixture(autouse=True)
def garbage_output_buffers(monkeypatch):
    """Every output buffer starts full of 0xA5 bytes: a byte the kernel leaves unwritten (a padding byte of a
    blocked scale layout, a payload byte) then differs from the reference."""
    def garbage(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.view(torch.uint8).fill_(GARBAGE_BYTE)
        return t

    monkeypatch.setattr(cute_launch, "_new_buffer", garbage)


def exact_sum_input(M, K, dtype, seed):
    """Integers in [-15, 15] times 2^e per row (e in [-8, 8]): every partial sum of squares is exact in FP32."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-15, 16, (M, K), generator=g).float()
    e = torch.randint(-8, 9, (M, 1), generator=g).float()
    return (ints * torch.exp2(e)).to(dtype).to(DEV)


def special_rows(x):
    """NaN, Inf, -Inf and all-zero rows and a zero 32-column block where the rows exist."""
    M, K = x.shape
    x = x.clone()
    for row, col, value in ((3, 7, math.nan), (10, K - 1, math.inf), (20, 0, -math.inf)):
        if row < M:
            x[row, col] = value
    if M > 11:
        x[11] = 0.0
    if M > 30:
        x[30, 32:64] = 0.0
    return x


def cpu_rstd(x, eps):
    return torch.rsqrt(x.cpu().float().square().mean(-1) + eps)


def reference_casts(x, w, rstd, scaling):
    """The reference (rowwise, colwise) MX casts of y (x itself when w is None), on x's device."""
    y = x.float() if w is None else x.float() * rstd[:, None] * w.float()
    return (quantize_reference(y, axis=1, scaling=scaling),
            quantize_reference(y.t(), axis=1, scaling=scaling, allow_partial=True))


def check_casts(out, refs, blocked, tag):
    row, col = refs
    assert_same_bytes(out.row_data, row.data, f"row payload {tag}")
    assert_same_bytes(out.row_scale, to_blocked(row.scale) if blocked else row.scale, f"row scale {tag}")
    assert out.col_data.shape == col.data.shape and out.col_data.stride(0) % 16 == 0
    assert_same_bytes(out.col_data, col.data, f"col payload {tag}")
    assert_same_bytes(out.col_scale, to_blocked(col.scale) if blocked else col.scale, f"col scale {tag}")
    if not blocked:  # stored row block by row block
        assert out.col_scale.stride() == (1, col.scale.shape[0]), f"col scale strides {tag}"


def assert_same_floats(a, b, what):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True, msg=what)


CASES = [(M, K, torch.bfloat16) for M in MS for K in KS]
CASES += [(M, K, dt) for dt in (torch.float32, torch.float16) for M in (33, 129, 32767) for K in (256, 1024)]


@pytest.mark.parametrize("M,K,dtype", CASES, ids=[f"{m}x{k}-{str(d)[6:]}" for m, k, d in CASES])
def test_exact_sums_match_reference(M, K, dtype):
    """rstd and every byte equal the reference, NaN / Inf / zero rows included, scales blocked or plain."""
    seed = M + K
    x = special_rows(exact_sum_input(M, K, dtype, seed))
    w = norm_weight(K, torch.float32, seed)
    blocked = (M + K // 256) % 2 == 0
    scaling = "floor" if (M % 3 == 0 and K == 1024) else "rceil"
    out = norm_mx_cast(x, w, 1e-6, scaling=scaling, blocked_scales=blocked)
    want_rstd = cpu_rstd(x, 1e-6)
    assert_same_floats(out.rstd, want_rstd, "rstd")
    check_casts(out, reference_casts(x, w, want_rstd.to(DEV), scaling), blocked, f"{M}x{K} {dtype}")


@pytest.mark.parametrize("M,K", [(33, 1024), (129, 4096), (32767, 1024), (31, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_generic_inputs_match_reference_given_rstd(M, K, dtype):
    x, w = generic_input(M, K, dtype, M * 7 + K), norm_weight(K, dtype, M)
    out = norm_mx_cast(x, w, 1e-6, blocked_scales=True)
    want = cpu_rstd(x, 1e-6)
    # the kernel sums the K squares in another order than torch: the two sums of non-negative terms are each within
    # about log2(K) roundings of the exact one, and rstd = rsqrt(mean + eps) halves that and adds its own rounding
    ulp = torch.finfo(torch.float32).eps * want.abs()
    bound = (math.log2(K) + 1) * ulp
    assert bool(((out.rstd.cpu() - want).abs() <= bound).all()), "rstd further from the reference than the bound"
    check_casts(out, reference_casts(x, w, out.rstd, "rceil"), True, f"{M}x{K}")


@pytest.mark.parametrize("M", [1, 33, 129, 32767])
@pytest.mark.parametrize("K", KS)
def test_dual_cast_matches_reference(M, K):
    """quantize_dual(backend="cute"): the dual cast of x (no norm), NaN / Inf / zeros, each dtype, both rules."""
    for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16)):
        x = special_rows(generic_input(M, K, dtype, M + K + i))
        scaling = ("rceil", "floor")[i % 2]
        row, col = quantize_dual(x, scaling=scaling, backend="cute")
        ref_row, ref_col = quantize_dual(x, scaling=scaling, backend="reference")
        for got, want, what in ((row, ref_row, "row"), (col, ref_col, "col")):
            assert got.shape == want.shape and got.scale_layout == "blocked" and got.orig_dtype == x.dtype
            assert_same_bytes(got.data, want.data, f"{what} payload {dtype} {scaling}")
            assert_same_bytes(got.scale, want.scale, f"{what} scale {dtype} {scaling}")


def test_subnormal_and_huge_blocks():
    """FP32 blocks of subnormals (scale byte 0, payloads from x * 2^127), of FP32's largest values (rceil byte 247,
    floor 246) and maxima at the rceil rounding edges, through both casts of the dual cast."""
    M, K = 64, 256
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(5))
    x[0:32, 0:32] = 2.0**-127
    x[0:32, 32:64] = 2.0**-126 * torch.rand(32, 32, generator=torch.Generator().manual_seed(6))
    x[32:64, 0:32] = 3.4028234663852886e38
    x[32:64, 32:64] = -3.0e38
    x[5, 64:96] = 448.0 * 2.0**-127  # d = 2^-127 exactly: rceil byte 0
    x[6, 64:96] = 448.0 * 2.0**-127 * 1.0000001
    x[7, 96:128] = 480.0
    x = x.to(DEV)
    for scaling in ("rceil", "floor"):
        row, col = quantize_dual(x, scaling=scaling, backend="cute")
        ref_row, ref_col = quantize_dual(x, scaling=scaling, backend="reference")
        for got, want, what in ((row, ref_row, "row"), (col, ref_col, "col")):
            assert_same_bytes(got.data, want.data, f"{what} payload {scaling}")
            assert_same_bytes(got.scale, want.scale, f"{what} scale {scaling}")


@pytest.mark.slow  # the tuning space
@pytest.mark.parametrize("K,launches", [(1024, [NormLaunch(128, 8), NormLaunch(256, 4), NormLaunch(512, 2),
                                                NormLaunch(1024, 1)]),
                                        (4096, [NormLaunch(256, 16), NormLaunch(512, 8), NormLaunch(1024, 4)]),
                                        (96, [NormLaunch(128, 1)]), (640, [NormLaunch(128, 5), NormLaunch(384, 2)])])
def test_every_launch_writes_the_same_bytes(K, launches):
    """Other tile widths and clusters (K not a multiple of the cluster's columns included: zero-filled columns and
    the blocked layouts' K padding) write the same rstd and bytes."""
    M = 300
    x, w = exact_sum_input(M, K, torch.bfloat16, K), norm_weight(K, torch.bfloat16, K)
    want_rstd = cpu_rstd(x, 1e-5)
    refs = reference_casts(x, w, want_rstd.to(DEV), "rceil")
    for launch in launches:
        for blocked in (True, False):
            out = norm_mx_cast(x, w, 1e-5, blocked_scales=blocked, launch=launch)
            assert_same_floats(out.rstd, want_rstd, f"rstd {launch}")
            check_casts(out, refs, blocked, f"{launch} blocked={blocked}")
        out = norm_mx_cast(x, None, blocked_scales=True, launch=launch)
        check_casts(out, reference_casts(x, None, None, "rceil"), True, f"dual {launch}")


def test_eps_zero_and_zero_rows():
    """A zero row with eps = 0 has rstd = inf and y = 0 * inf = NaN: NaN blocks, as the reference."""
    x = exact_sum_input(40, 256, torch.bfloat16, 1)
    x[4] = 0.0
    w = norm_weight(256, torch.float32, 1)
    out = norm_mx_cast(x, w, 0.0, blocked_scales=False)
    want_rstd = cpu_rstd(x, 0.0)
    assert math.isinf(want_rstd[4].item())
    assert_same_floats(out.rstd, want_rstd, "rstd")
    check_casts(out, reference_casts(x, w, want_rstd.to(DEV), "rceil"), False, "eps=0")


@pytest.mark.parametrize("scale_layout", ["plain", "blocked"])
def test_public_op_dispatches_to_cute(scale_layout):
    """rms_norm_quantize: auto runs the cute kernel here (scales in the layout asked for), any rank of x,
    non-contiguous x copied first; the values equal the reference's (exact sums)."""
    x = exact_sum_input(2 * 77, 512, torch.bfloat16, 3).view(2, 77, 512)
    w = norm_weight(512, torch.bfloat16, 3)
    for inp in (x, x.transpose(0, 1)):
        got = rms_norm_quantize(inp, w, 1e-6, scale_layout=scale_layout)
        want = rms_norm_quantize(inp.cpu(), w.cpu(), 1e-6, scale_layout=scale_layout, backend="reference")
        cute = rms_norm_quantize(inp, w, 1e-6, scale_layout=scale_layout, backend="cute")
        for a in (got, cute):
            assert_same_floats(a.rstd, want.rstd, "rstd")
            for name in ("rowwise", "colwise"):
                ma, mb = getattr(a, name), getattr(want, name)
                assert ma.scale_layout == mb.scale_layout == scale_layout
                assert_same_bytes(ma.data, mb.data, f"{name} payload")
                assert_same_bytes(ma.scale, mb.scale, f"{name} scale")
                assert_same_floats(dequantize(ma), dequantize(mb), f"{name} values")
    empty = rms_norm_quantize(torch.empty(0, 256, device=DEV), torch.ones(256, device=DEV), backend="cute")
    assert empty.rowwise.data.shape == (0, 256) and empty.colwise.data.shape == (256, 0)


OPERAND_CASES = [(M, K, rows_extra) for M in (1, 31, 33, 127, 129, 32767) for K in (256, 1024, 4096)
                 for rows_extra in (0, 5)]


@pytest.mark.parametrize("M,K,extra", OPERAND_CASES, ids=[f"{m}x{k}+{e}" for m, k, e in OPERAND_CASES])
def test_operands_are_the_dequantized_casts(M, K, extra):
    """The BF16 operands (an RMSNorm + linear forward's row operand beside its colwise cast; a dY cast's two
    operands, both laid out as y) equal the reference casts dequantized and rounded to BF16, zeros in the
    `operand_rows` past M, NaN where a block holds NaN or Inf; the MX casts not asked for are None."""
    x = special_rows(generic_input(M, K, torch.bfloat16, M + K + extra))
    w = norm_weight(K, torch.float32, M)
    rows = M + extra
    fwd = norm_mx_cast(x, w, 1e-6, rowwise=False, row_operand=True, operand_rows=rows)
    assert fwd.row_data is None and fwd.row_scale is None and fwd.col_operand is None
    row_ref, col_ref = reference_casts(x, w, fwd.rstd, "rceil")
    assert_same_bytes(fwd.col_data, col_ref.data, "col payload")
    assert_same_bytes(fwd.col_scale, to_blocked(col_ref.scale), "col scale")
    assert fwd.row_operand.shape == (rows, K) and fwd.row_operand.dtype == torch.bfloat16
    assert_same_floats(fwd.row_operand[:M], dequantize(row_ref).to(torch.bfloat16), "row operand")
    assert not fwd.row_operand[M:].any()
    dual = norm_mx_cast(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True,
                        operand_rows=rows)
    assert dual.row_data is None and dual.col_data is None and dual.rstd is None
    row_ref, col_ref = reference_casts(x, None, None, "rceil")
    assert_same_floats(dual.row_operand[:M], dequantize(row_ref).to(torch.bfloat16), "dual row operand")
    assert dual.col_operand.shape == (rows, K) and dual.col_operand.is_contiguous()
    assert_same_floats(dual.col_operand[:M], dequantize(col_ref).t().to(torch.bfloat16), "dual col operand")
    assert not dual.col_operand[M:].any() and not dual.row_operand[M:].any()
    sums = norm_mx_cast(x, None, rowwise=False, colwise=False, row_operand=True, column_sums=True).column_sums
    # each row block's partial sums added atomically in any order: within M FP32 roundings of the exact sums
    exact, magnitude = x.double().sum(0), x.double().abs().sum(0)
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isnan(sums), torch.isnan(exact.float())) and torch.equal(sums[~finite].isinf(),
                                                                                       exact[~finite].isinf())
    bound = M * torch.finfo(torch.float32).eps * magnitude[finite] + 1e-30
    assert bool(((sums[finite].double() - exact[finite]).abs() <= bound).all()), "column sums beyond FP32 rounding"


@pytest.mark.parametrize("M,K", [(1, 1024), (33, 1024), (129, 4096), (32767, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_operands_are_those_of_torch_silu(M, K, dtype):
    """activation="silu": the operands equal the casts of torch's `F.silu(x)` on the GPU, dequantized (x's dtype;
    NaN, Inf and zero rows included), so an MLP's hidden activation needs not be stored."""
    x = special_rows(generic_input(M, K, dtype, M + K) * 0.01)  # the interesting range of SiLU, and the extremes
    act = torch.nn.functional.silu(x)
    row_ref, col_ref = reference_casts(act, None, None, "rceil")
    out = norm_mx_cast(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True, activation="silu")
    assert_same_floats(out.row_operand, dequantize(row_ref).to(torch.bfloat16), "silu row operand")
    assert_same_floats(out.col_operand, dequantize(col_ref).t().to(torch.bfloat16), "silu col operand")
    casts = norm_mx_cast(x, None, blocked_scales=False, activation="silu")
    check_casts(casts, (row_ref, col_ref), False, f"silu {M}x{K}")
