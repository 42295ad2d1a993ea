"""The Triton MX cast kernel (`gem_lp.mx.kernels.triton_cast`): RMSNorm + MX quantize, the dual cast without the norm,
its input activation and column sums, against the reference (the norm's backward kernel: tests/norm).

On CPU the kernels run in Triton's interpreter (tests/conftest.py) on tiny shapes; on a CUDA machine the
same tests run the compiled kernels, and the `gpu` tests add large shapes.

References run on the CPU (the oracle): torch's CUDA `rsqrt` and `mean` round differently.
Bit-identity is checked two ways. (1) On inputs whose FP32 sum of squares is exact (small integers times a
power of two per row), the sum has no order, so rstd and every byte must equal `rms_norm_quantize_reference`.
(2) On generic inputs, rstd must be within 2 ulp of the reference, and every byte must equal the reference
quantization of `y = (fp32(x) * rstd) * fp32(w)` computed with the kernel's rstd: everything after the sum
of squares is the reference's arithmetic.
"""
import functools
import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from byte_checks import assert_same_bytes, u8
import norm_inputs

from benchmarks.cast_candidates import CANDIDATE_CONFIGS, OPERAND_CAST_CANDIDATE_CONFIGS
from gem_lp.mx import dequantize, quantize_reference, to_blocked
from gem_lp.mx.kernels import triton_cast as triton_norm
from gem_lp.mx.kernels.triton_cast import (CONFIG_FIELDS, MEASURED_CONFIG, MEASURED_KS, MEASURED_UNALIGNED_KS,
                                           NormConfig, default_config, input_activation, rms_norm_mx, strip_config)
from gem_lp.norm import rms_norm_quantize
from gem_lp.norm.reference import rms_norm_quantize_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
generic_input = functools.partial(norm_inputs.generic_input, device=DEVICE)
norm_weight = functools.partial(norm_inputs.norm_weight, device=DEVICE)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MS = (1, 31, 33, 100, 129)
KS = (32, 64, 96)
# NaN/Inf inputs make numpy (the interpreter) warn about the invalid products it is asked to compute.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


GARBAGE_BYTE = 0xA5


@pytest.fixture(autouse=True)
def garbage_output_buffers(monkeypatch):
    """Every output buffer of `rms_norm_mx` starts full of 0xA5 bytes (it is allocated uninitialized): a byte the
    kernel does not write, such as the padding of a blocked scale layout, then differs from the reference."""
    def garbage(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.view(torch.uint8).fill_(GARBAGE_BYTE)
        return t

    monkeypatch.setattr(triton_norm, "_new_buffer", garbage)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def exact_sum_input(M, K, dtype, seed):
    """Integers in [-15, 15] times 2^e per row (e in [-8, 8]): every partial sum of squares is exact in FP32."""
    g = _gen(seed)
    ints = torch.randint(-15, 16, (M, K), generator=g).double()
    e = torch.randint(-8, 9, (M, 1), generator=g).double()
    return (ints * torch.exp2(e)).to(dtype).to(DEVICE)


def cpu_reference(x, w, eps, scaling):
    return rms_norm_quantize_reference(x.cpu(), w.cpu(), eps, scaling)


def assert_same_values(actual, expected, what):
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


def reference_casts_of_y(x, w, rstd, scaling):
    """The reference (rowwise, colwise) MX casts of `y = (x * rstd) * w`, computed on the CPU."""
    x, w, rstd = x.cpu(), w.cpu(), rstd.cpu()
    y = x.float() * rstd[:, None] * w.float()  # the reference's formula
    return (quantize_reference(y, axis=1, scaling=scaling),
            quantize_reference(y.t(), axis=1, scaling=scaling, allow_partial=True))


def check_outputs(out, x, w, eps, scaling, blocked, rstd, operand_dtype, tag, refs=None):
    """Every output of `rms_norm_mx` equals the reference quantization of y computed with `rstd` (on CPU; `refs`:
    `reference_casts_of_y`'s result when already made)."""
    row, col = reference_casts_of_y(x, w, rstd, scaling) if refs is None else refs
    assert_same_bytes(out.rowwise.data, row.data, f"row payload {tag}")
    assert_same_bytes(out.rowwise.scale, to_blocked(row.scale) if blocked else row.scale, f"row scale {tag}")
    assert_same_bytes(out.colwise.data, col.data, f"col payload {tag}")
    assert_same_bytes(out.colwise.scale, to_blocked(col.scale) if blocked else col.scale, f"col scale {tag}")
    assert (out.rowwise.scale_layout, out.colwise.scale_layout) == (("blocked",) * 2 if blocked else ("plain",) * 2)
    if out.row_operand is not None:
        assert_same_values(out.row_operand, dequantize(row).to(operand_dtype), f"row operand {tag}")
    if out.col_operand is not None:
        assert_same_values(out.col_operand, dequantize(col).t().to(operand_dtype), f"col operand {tag}")


# (dtype, scaling, blocked scales, operand dtype) rotated over the shapes, and so are the launch configurations:
# the default (one chunk covers K up to 128), multi-pass ones (block_k=32: the second sweep re-reads x chunk by
# chunk; with prefetch, the next chunk loaded before the current one is used), thread strips of 1..16 rows (1:
# the byte-wise colwise store; M even and > 1: the paired one), whole row blocks in a thread, and the persistent
# walk over row blocks (also with prefetch); row blocks of 32 to 128 rows, 1 or 2 warps.
COMBOS = list(itertools.product(DTYPES, ("rceil", "floor"), (True, False)))
CONFIGS = (dict(), dict(block_k=32), dict(block_m=64, block_k=32, thread_rows=16),
           dict(block_m=64, block_k=64, thread_rows=2, row_blocks_in_thread=True),
           dict(block_k=32, thread_rows=4, programs_per_sm=1), dict(thread_rows=1), dict(block_m=128, block_k=32),
           dict(block_m=64, block_k=64, thread_rows=4, num_warps=2), dict(block_k=32, prefetch=True),
           dict(block_k=32, thread_rows=2, row_blocks_in_thread=True, programs_per_sm=1, prefetch=True))
CASES = [(M, K, COMBOS[(3 * i) % len(COMBOS)], CONFIGS[i % len(CONFIGS)], 10 * i)
         for i, (M, K) in enumerate(itertools.product(MS, KS))]


@pytest.mark.parametrize("M,K,combo,cfg,seed", CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2][0]}-{c[2][1]}-{'blk' if c[2][2] else 'plain'}-{c[3]}"
                              for c in CASES])
def test_exact_sum_inputs_match_reference_bit_for_bit(M, K, combo, cfg, seed):
    dtype, scaling, blocked = combo
    x, w = exact_sum_input(M, K, dtype, seed), norm_weight(K, torch.float32, seed)
    op_dtype = torch.bfloat16 if seed % 20 else torch.float32
    out = rms_norm_mx(x, w, 1e-5, scaling=scaling, blocked_scales=blocked, row_operand=True, col_operand=True,
                      operand_dtype=op_dtype, **cfg)
    ref = cpu_reference(x, w, 1e-5, scaling)
    assert_same_values(out.rstd, ref.rstd, "rstd")
    check_outputs(out, x, w, 1e-5, scaling, blocked, ref.rstd, op_dtype, f"seed={seed}")
    # and directly against the reference object
    assert_same_bytes(out.rowwise.data, ref.rowwise.data, "row payload vs reference")
    assert_same_bytes(out.colwise.plain_scale(), ref.colwise.scale, "col scale vs reference")


@pytest.mark.parametrize("M,K,combo,cfg,seed", CASES[::2],
                         ids=[f"{c[0]}x{c[1]}-{c[2][0]}-{c[3]}" for c in CASES[::2]])
def test_generic_inputs_match_reference_given_rstd(M, K, combo, cfg, seed):
    dtype, scaling, blocked = combo
    x, w = generic_input(M, K, dtype, seed + 1), norm_weight(K, dtype, seed)
    out = rms_norm_mx(x, w, 1e-6, scaling=scaling, blocked_scales=blocked, row_operand=True, **cfg)
    ref = cpu_reference(x, w, 1e-6, scaling)
    ulp = torch.finfo(torch.float32).eps * ref.rstd.abs()
    assert bool(((out.rstd.cpu() - ref.rstd).abs() <= 2 * ulp).all()), "rstd more than 2 ulp from the reference"
    check_outputs(out, x, w, 1e-6, scaling, blocked, out.rstd, torch.bfloat16, f"seed={seed}")


def _tie_weight(x_row, rstd, seed):
    """A weight `w [K]` for which `(x * rstd) * w` lands exactly on E4M3 rounding ties (at scale 1) in many
    places where `x * (rstd * w)` does not: there the payload depends on the operation order."""
    f32 = np.float32
    rng = np.random.default_rng(seed)
    up, down = f32(np.inf), f32(-np.inf)
    w = np.empty(x_row.shape[0], np.float32)
    for j, xj in enumerate(x_row.astype(np.float32)):
        a = xj * f32(rstd)
        if a == 0:
            w[j] = 1.0
            continue
        if j % 32 == 0:  # the block max: y ~ 300 gives the rceil scale byte 127 (scale 1)
            w[j] = f32(300.0 / float(a))
            continue
        tie = f32(1.0 + (2 * rng.integers(0, 8) + 1) / 16.0)  # midpoint of two E4M3 values in [1, 2)
        w[j] = cand = f32(float(tie) / float(a))
        for direction in (up, down):
            c = cand
            for _ in range(4):
                if a * c == tie and xj * (f32(rstd) * c) != tie:
                    w[j] = c
                    break
                c = np.nextafter(c, direction)
    return torch.from_numpy(w)


def test_operation_order_of_y_is_the_references():
    """Payload bytes at E4M3 ties reveal the order of `x * rstd * w`; the kernel's must be `(x * rstd) * w`."""
    x = exact_sum_input(1, 256, torch.float32, 9).cpu()
    rstd = cpu_reference(x, torch.ones(256), 1e-6, "rceil").rstd
    w = _tie_weight(x[0].numpy(), rstd.item(), 9)
    y_ref_order = (x * rstd[:, None]) * w
    y_other_order = x * (rstd[:, None] * w)
    ref = quantize_reference(y_ref_order, axis=1)
    n_differ = int((u8(ref.data) != u8(quantize_reference(y_other_order, axis=1).data)).sum())
    assert n_differ >= 4, "the constructed input must make the operation order visible"
    x, w = x.to(DEVICE), w.to(DEVICE)
    for cfg in (dict(), dict(block_k=64)):
        out = rms_norm_mx(x, w, 1e-6, blocked_scales=False, **cfg)
        assert_same_values(out.rstd, rstd.to(DEVICE), "rstd")
        assert_same_bytes(out.rowwise.data, ref.data, f"row payload {cfg}")
        assert_same_bytes(out.rowwise.scale, ref.scale, f"row scale {cfg}")


def test_special_rows_match_reference():
    """NaN, Inf, all-zero rows (eps > 0 and eps = 0), huge values: the reference's NaN propagation exactly."""
    x = exact_sum_input(70, 96, torch.float32, 5)
    x[3, 7] = math.nan
    x[10, 40] = math.inf
    x[11] = -math.inf
    x[20] = 0.0
    x[40, :32] = 0.0
    x[50, 5] = 3.0e38
    w = norm_weight(96, torch.float32, 5)
    for eps in (1e-6, 0.0):
        out = rms_norm_mx(x, w, eps, row_operand=True, col_operand=True, operand_dtype=torch.float32)
        ref = cpu_reference(x, w, eps, "rceil")
        assert_same_values(out.rstd, ref.rstd, f"rstd eps={eps}")
        check_outputs(out, x, w, eps, "rceil", True, ref.rstd, torch.float32, f"eps={eps}")
        assert bool(out.row_operand[3].isnan().all()) and bool(u8(out.rowwise.data)[3].eq(0x7F).all())


def test_without_weight_is_the_dual_cast():
    x = generic_input(100, 96, torch.bfloat16, 3)
    x[7, 3] = math.nan
    out = rms_norm_mx(x, None, row_operand=True, col_operand=True, blocked_scales=False, block_k=32)
    assert out.rstd is None
    for scaling in ("rceil", "floor"):
        out = rms_norm_mx(x, None, scaling=scaling, row_operand=True, col_operand=True, blocked_scales=False)
        row = quantize_reference(x, axis=1, scaling=scaling)
        col = quantize_reference(x.t(), axis=1, scaling=scaling, allow_partial=True)
        for got, want, what in ((out.rowwise.data, row.data, "row"), (out.rowwise.scale, row.scale, "row scale"),
                                (out.colwise.data, col.data, "col"), (out.colwise.scale, col.scale, "col scale")):
            assert_same_bytes(got, want, f"{what} {scaling}")
        assert_same_values(out.col_operand, dequantize(col).t().bfloat16(), "col operand")


def check_dual_cast(out, x, scaling, blocked, operand_dtype, tag, refs=None):
    """`rms_norm_mx(x, None, ...)`'s requested outputs equal the reference dual cast of x (on CPU; `refs`: the
    reference (rowwise, colwise) MX tensors when already made)."""
    if refs is None:
        x = x.cpu()
        refs = (quantize_reference(x, axis=1, scaling=scaling),
                quantize_reference(x.t(), axis=1, scaling=scaling, allow_partial=True))
    row, col = refs
    assert out.rstd is None
    for got, want, what in ((out.rowwise, row, "row"), (out.colwise, col, "col")):
        if got is not None:
            assert_same_bytes(got.data, want.data, f"{what} payload {tag}")
            assert_same_bytes(got.scale, to_blocked(want.scale) if blocked else want.scale, f"{what} scale {tag}")
    if out.row_operand is not None:
        assert_same_values(out.row_operand, dequantize(row).to(operand_dtype), f"row operand {tag}")
    if out.col_operand is not None:
        assert_same_values(out.col_operand, dequantize(col).t().to(operand_dtype), f"col operand {tag}")


def assert_column_sums(sums, x, tag, rtol=1e-5):
    """`sums` (float32 [K]) equals `x.float().sum(0)` within `rtol` of the column's sum of magnitudes (another
    summation order: FP32 rounding apart, not bit for bit); NaN and infinities where torch has them."""
    want = x.float().sum(0).cpu()
    sums = sums.cpu()
    assert sums.dtype == torch.float32 and sums.shape == want.shape, tag
    finite = want.isfinite()
    assert torch.equal(sums.isnan(), want.isnan()), f"NaN columns differ {tag}"
    assert torch.equal(sums[~finite & ~want.isnan()], want[~finite & ~want.isnan()]), f"infinite columns {tag}"
    bound = rtol * x.float().abs().sum(0).cpu()[finite]
    err = (sums[finite] - want[finite]).abs()
    assert bool((err <= bound).all()), f"column sums off by up to {(err - bound).max().item():.3g} past the bound {tag}"


# Launches of the dual cast without the norm: the default, the loop over K chunks (also with prefetch), tile
# programs (a 2-D grid: several programs per row block, whose first zeroes the K padding of the blocked scales;
# whole row blocks in a thread; 1-row strips: the byte-wise colwise store), and 1-row strips sweeping K.
DUAL_CONFIGS = (dict(), dict(block_k=32), dict(block_k=32, thread_rows=4, prefetch=True),
                dict(block_k=32, tile_programs=True), dict(block_m=64, block_k=64, thread_rows=16, tile_programs=True),
                dict(block_k=64, thread_rows=2, row_blocks_in_thread=True, tile_programs=True),
                dict(block_k=32, thread_rows=1, tile_programs=True), dict(block_k=32, thread_rows=1))
DUAL_CASES = [(M, K, DUAL_CONFIGS[i % len(DUAL_CONFIGS)], DTYPES[i % 3], i)
              for i, (M, K) in enumerate(itertools.product((1, 33, 129), (32, 160)))]
DUAL_CASES += [(300, 160, cfg, torch.bfloat16, 50 + i) for i, cfg in enumerate(DUAL_CONFIGS[1:5])]


@pytest.mark.parametrize("M,K,cfg,dtype,seed", DUAL_CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[3]}-{c[2]}".replace(" ", "") for c in DUAL_CASES])
def test_dual_cast_column_sums_and_launches(M, K, cfg, dtype, seed):
    """Without the norm, every launch (tile programs among them; M = 300, K = 160: every kind of padding of the
    blocked scales, written into garbage-filled buffers) writes the reference's bytes, alone or with
    `column_sums`, which must equal `x.float().sum(0)` within FP32 rounding (a NaN and an infinity included)."""
    x = generic_input(M, K, dtype, seed)
    blocked = seed % 2 == 0 or M == 300
    out = rms_norm_mx(x, None, blocked_scales=blocked, column_sums=M == 300, **cfg)  # payloads and scales
    check_dual_cast(out, x, "rceil", blocked, torch.bfloat16, f"payloads {cfg}")
    if M == 300:  # the padding case (slow in the interpreter): once
        assert_column_sums(out.column_sums, x, f"{M}x{K} {cfg}")
        return
    assert out.column_sums is None
    x[M // 2, 3] = math.nan
    x[M - 1, K - 1] = math.inf
    out = rms_norm_mx(x, None, blocked_scales=blocked, row_operand=True, col_operand=True, column_sums=True, **cfg)
    check_dual_cast(out, x, "rceil", blocked, torch.bfloat16, f"operands with column sums {cfg}")
    assert_column_sums(out.column_sums, x, f"{M}x{K} {cfg}")


def silu_as_computed(x):
    """torch's SiLU of x in x's dtype as the kernels compute it: torch's own on the GPU (its CUDA kernel's math); in
    the interpreter, numpy's FP32 exp (torch's CPU exp differs from it in the last bit of some FP32 results; BF16
    results round that away) and division, rounded to x's dtype."""
    if x.is_cuda:
        return torch.nn.functional.silu(x)
    xf = x.float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy(xf / (np.float32(1) + np.exp(-xf))).to(x.dtype)


ACT_CASES = [(33, 64, dict(), torch.bfloat16), (129, 160, dict(block_k=32), torch.float32),
             (100, 64, dict(block_k=32, tile_programs=True), torch.bfloat16),
             (31, 96, dict(thread_rows=1, tile_programs=False), torch.float16),
             (65, 160, dict(thread_rows=16, block_m=64, block_k=32, prefetch=True), torch.bfloat16),
             (1, 32, dict(), torch.float32)]


@pytest.mark.parametrize("M,K,cfg,dtype", ACT_CASES, ids=[f"{c[0]}x{c[1]}-{c[3]}-{c[2]}".replace(" ", "")
                                                         for c in ACT_CASES])
def test_input_activation_casts_are_those_of_the_activated_input(M, K, cfg, dtype):
    """`activation="silu"`: every launch family (one chunk, a K loop, tile programs, 1-row strips, 16-row strips in a
    prefetching K loop) writes the bytes of the dual cast of torch's SiLU of x (NaN, infinities and -0 included)."""
    x = generic_input(M, K, dtype, M + K)
    x.view(-1)[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)
    out = rms_norm_mx(x, None, activation="silu", row_operand=True, col_operand=True, blocked_scales=M % 2 == 1,
                      **cfg)
    check_dual_cast(out, silu_as_computed(x), "rceil", M % 2 == 1, torch.bfloat16, f"silu {cfg}")


def test_input_activation_errors():
    x = generic_input(4, 32, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="activation must be None or one of"):
        rms_norm_mx(x, None, activation="gelu")
    with pytest.raises(ValueError, match="needs weight=None and, without activation_input, column_sums=False"):
        rms_norm_mx(x, norm_weight(32, torch.float32, 0), activation="silu")
    with pytest.raises(ValueError, match="needs weight=None and, without activation_input, column_sums=False"):
        rms_norm_mx(x, None, activation="silu", column_sums=True)


def test_column_sums_of_float32_rows_and_no_rows():
    """FP32 x over many row blocks (rounding in every partial sum), K not a multiple of the chunk; M = 0."""
    x = generic_input(257, 96, torch.float32, 21)
    for cfg in (dict(), dict(block_k=64, tile_programs=True), dict(block_k=64, prefetch=True), dict(thread_rows=1)):
        out = rms_norm_mx(x, None, rowwise=False, colwise=True, column_sums=True, **cfg)
        assert_column_sums(out.column_sums, x, f"fp32 {cfg}")
    out = rms_norm_mx(torch.empty(0, 64, device=DEVICE), None, column_sums=True)
    assert torch.equal(out.column_sums.cpu(), torch.zeros(64))


@pytest.mark.parametrize("cfg", [dict(block_k=32, prefetch=True), dict(block_k=64, thread_rows=4, prefetch=True),
                                 dict(block_k=32, programs_per_sm=1, prefetch=True, thread_rows=16, block_m=64)],
                         ids=["prefetch", "prefetch-r4", "prefetch-persistent"])
@pytest.mark.parametrize("M,K", [(1, 96), (33, 160), (64, 128)])
def test_prefetch_matches_reference(M, K, cfg):
    """The prefetching sweeps (the last prefetch past K reads nothing: masked loads at partial tiles, a uniform
    predicate at full ones, M = 64) write the reference's bytes and rstd."""
    x, w = exact_sum_input(M, K, torch.bfloat16, M + K), norm_weight(K, torch.float32, M)
    out = rms_norm_mx(x, w, 1e-6, row_operand=True, **cfg)
    ref = cpu_reference(x, w, 1e-6, "rceil")
    assert_same_values(out.rstd, ref.rstd, f"rstd {cfg}")
    check_outputs(out, x, w, 1e-6, "rceil", True, ref.rstd, torch.bfloat16, f"{M}x{K} {cfg}")


def test_only_the_requested_outputs_and_public_wrapper():
    x, w = exact_sum_input(33, 64, torch.bfloat16, 8), norm_weight(64, torch.bfloat16, 8)
    out = rms_norm_mx(x, w, rowwise=False, colwise=False, row_operand=True)
    assert out.rowwise is None and out.colwise is None and out.col_operand is None
    ref = cpu_reference(x, w, 1e-6, "rceil")
    assert_same_values(out.row_operand, dequantize(ref.rowwise).bfloat16(), "row operand alone")
    got = rms_norm_quantize(x, w, 1e-6, backend="triton")  # plain scales, as the reference returns them
    for a, b in ((got.rowwise, ref.rowwise), (got.colwise, ref.colwise)):
        assert a.shape == b.shape and a.scale_layout == b.scale_layout == "plain"
        assert (a.block, a.axis, a.scaling, a.orig_dtype) == (b.block, b.axis, b.scaling, b.orig_dtype)
        assert_same_bytes(a.data, b.data, "payload")
        assert_same_bytes(a.scale, b.scale, "scale")
    assert_same_values(got.rstd, ref.rstd, "rstd")


def test_empty_and_strided_rows():
    w = norm_weight(64, torch.float32, 0)
    out = rms_norm_mx(torch.empty(0, 64, device=DEVICE), w, row_operand=True)
    assert out.rowwise.shape == (0, 64) and out.colwise.shape == (64, 0) and out.rstd.shape == (0,)
    assert out.colwise.scale.numel() == 0 and out.row_operand.shape == (0, 64)
    base = exact_sum_input(40, 128, torch.float32, 4)
    x = base[:, 32:96]  # row stride 128
    out = rms_norm_mx(x, w, blocked_scales=False)
    ref = cpu_reference(x.contiguous(), w, 1e-6, "rceil")
    assert_same_values(out.rstd, ref.rstd, "strided rstd")
    assert_same_bytes(out.colwise.data, ref.colwise.data, "strided col payload")


@pytest.mark.parametrize("K", [160, 128])
@pytest.mark.parametrize("cfg", [dict(), dict(block_m=256, block_k=32), dict(block_m=64, block_k=64, programs_per_sm=1),
                                 dict(block_m=64, block_k=64, thread_rows=1), dict(max_registers=128)],
                         ids=["default", "two-groups-a-program", "persistent", "1-row-strips", "max-registers"])
def test_blocked_scale_padding_written_by_the_kernel(cfg, K):
    """M = 300 (the last 128-row group partial; ceil(M/32) = 10 colwise scale columns, not a multiple of 4: the
    extra program's padding) and K = 160 (5 rowwise scale columns; K not a multiple of 128: the row blocks'
    padding) or 128: every kind of padding of both blocked layouts, in buffers that start as garbage, must come
    out as the reference's zeros."""
    M = 300
    x, w = exact_sum_input(M, K, torch.bfloat16, 11), norm_weight(K, torch.float32, 11)
    out = rms_norm_mx(x, w, 1e-6, **cfg)
    ref = cpu_reference(x, w, 1e-6, "rceil")
    for got, want, what in ((out.rowwise, ref.rowwise, "rowwise"), (out.colwise, ref.colwise, "colwise")):
        assert_same_bytes(got.scale, to_blocked(want.scale), f"{what} blocked scales {cfg}")
        assert_same_bytes(got.data, want.data, f"{what} payload {cfg}")
    assert_same_values(out.rstd, ref.rstd, f"rstd {cfg}")


def test_default_config_on_the_gpu(monkeypatch):
    """The measured launch where it was measured (K 1024 and 4096, M a multiple of 32, and any M at K = 4096;
    hardware conversion, no operands); the instruction-count choice everywhere else."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for K in MEASURED_KS:
        assert default_config(K) == MEASURED_CONFIG
        assert (default_config(K, False) == MEASURED_CONFIG) == (K in MEASURED_UNALIGNED_KS)
        for flags in ((True, True, True), (True, False, False)) + (() if K in MEASURED_UNALIGNED_KS else
                                                                   ((False, False, True),)):
            assert default_config(K, *flags) == strip_config(K, *flags) != MEASURED_CONFIG
        assert default_config(K, normalize=False) == strip_config(K) != MEASURED_CONFIG
    for K in (32, 96, 512, 2048):
        assert default_config(K) == strip_config(K)
    for K, configs in CANDIDATE_CONFIGS.items():  # the tuning space (benchmarks) holds the measured launch
        assert MEASURED_CONFIG in configs and all(c[3] > 0 for c in configs), K
        assert len(set(configs)) == len(configs), K


def test_norm_config_fields():
    c = NormConfig(32, 256, 4, 8, False, 2, 168)
    assert dict(zip(CONFIG_FIELDS, c)) == dict(block_m=32, block_k=256, num_warps=4, thread_rows=8,
                                               row_blocks_in_thread=False, programs_per_sm=2, max_registers=168,
                                               prefetch=False, tile_programs=False)
    assert repr(c) == "32x256 w4 r8 2/SM maxreg168"
    assert repr(NormConfig(32, 128, 4, 4, prefetch=True)) == "32x128 w4 r4 prefetch"
    assert repr(NormConfig(32, 64, 2, 4, tile_programs=True)) == "32x64 w2 r4 tiles"
    assert NormConfig(32, 64, 1) == (32, 64, 1, 8, False, 0, 0, False, False)
    for configs in OPERAND_CAST_CANDIDATE_CONFIGS.values():
        assert len(set(configs)) == len(configs) and all(c[3] > 0 and not c[5] for c in configs)


def test_repeated_calls_reuse_a_launch_plan():
    """Calls with the default launch keep a plan per (shapes, strides, dtypes, options): a call met before skips
    the checks and the launch choice (on the GPU also the JIT) and writes the same bytes as the first. Token
    counts interleaved as in training (every layer of a step, then the next batch)."""
    w = norm_weight(64, torch.float32, 3)
    inputs = {M: exact_sum_input(M, 64, torch.bfloat16, M) for M in (33, 100, 64)}
    refs = {M: cpu_reference(x, w, 1e-6, "rceil") for M, x in inputs.items()}
    triton_norm._NORM_PLANS.clear()
    for M in (33, 100, 33, 64, 100, 33):
        out = rms_norm_mx(inputs[M], w, 1e-6)
        assert_same_values(out.rstd, refs[M].rstd, f"rstd M={M}")
        check_outputs(out, inputs[M], w, 1e-6, "rceil", True, refs[M].rstd, torch.bfloat16, f"M={M}")
    assert len(triton_norm._NORM_PLANS) == 3
    launches = [plan.launch for plan in triton_norm._NORM_PLANS.values()]
    assert all(launch is not None for launch in launches)
    if DEVICE.type == "cuda":  # relaunched directly after the first call of each plan
        assert all(launch.compiled for launch in launches)
    # a launch configuration given by the caller is not cached (it is checked on every call)
    rms_norm_mx(inputs[33], w, 1e-6, block_k=32)
    assert len(triton_norm._NORM_PLANS) == 3


def test_operand_rows_pad_the_operands_with_zero_rows():
    x = exact_sum_input(33, 64, torch.bfloat16, 5)
    plain = rms_norm_mx(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True)
    out = rms_norm_mx(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True, operand_rows=40)
    for got, want in ((out.row_operand, plain.row_operand), (out.col_operand, plain.col_operand)):
        assert got.shape == (40, 64)
        assert_same_values(got[:33], want, "operand rows")
        assert not got[33:].any()
    with pytest.raises(ValueError, match="operand_rows must be an int >= M=33, got 32"):
        rms_norm_mx(x, None, row_operand=True, operand_rows=32)


def test_a_cached_plan_does_not_skip_the_checks_of_other_arguments():
    x, w = torch.randn(8, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    rms_norm_mx(x, w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm_mx(torch.randn(64, 8, device=DEVICE).t(), w)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[K=64\] tensor"):
        rms_norm_mx(x, torch.randn(128, device=DEVICE)[::2])
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        rms_norm_mx(x.double(), w)
    with pytest.raises(ValueError, match="scaling must be one of"):
        rms_norm_mx(x, w, scaling="round")


def test_errors():
    x, w = torch.randn(8, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match="K must be a multiple of 32, got K=40"):
        rms_norm_mx(torch.randn(8, 40, device=DEVICE), torch.randn(40, device=DEVICE))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        rms_norm_mx(x.double(), w)
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\]"):
        rms_norm_mx(x.reshape(2, 4, 64), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm_mx(torch.randn(64, 8, device=DEVICE).t(), w)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[K=64\] tensor"):
        rms_norm_mx(x, torch.randn(32, device=DEVICE))
    with pytest.raises(ValueError, match="at least one of rowwise"):
        rms_norm_mx(x, w, rowwise=False, colwise=False)
    with pytest.raises(ValueError, match="operand_dtype must be one of"):
        rms_norm_mx(x, w, row_operand=True, operand_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 32, got 16"):
        rms_norm_mx(x, w, block_m=16)
    for thread_rows in (0, 3, 64):  # thread strips only (the 32x32-block tile kernel is gone)
        with pytest.raises(ValueError, match=f"thread_rows must be a power of two in 1..32, got {thread_rows}"):
            rms_norm_mx(x, w, thread_rows=thread_rows)
    with pytest.raises(ValueError, match="programs_per_sm must be >= 0, got -1"):
        rms_norm_mx(x, w, programs_per_sm=-1)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32, got 48"):
        rms_norm_mx(x, w, block_k=48)
    with pytest.raises(ValueError, match=r"max_registers must be 0 \(no cap\) or in 16..255, got 8"):
        rms_norm_mx(x, w, max_registers=8)
    with pytest.raises(ValueError, match="tile_programs needs programs_per_sm=0, got programs_per_sm=1"):
        rms_norm_mx(x, None, programs_per_sm=1, tile_programs=True)
    with pytest.raises(ValueError, match="tile_programs=True needs weight=None"):
        rms_norm_mx(x, w, tile_programs=True)
    with pytest.raises(ValueError, match="column_sums=True needs weight=None"):
        rms_norm_mx(x, w, column_sums=True)
    with pytest.raises(ValueError, match="scaling must be one of"):
        rms_norm_mx(x, w, scaling="round")


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        rms_norm_mx(torch.randn(32, 32), torch.randn(32))


# ----------------------------------------------------------------------------- compiled for sm_90

_HOPPER_COMPILE = """
import json, torch
from benchmarks.tune_casts import build_norm
from gem_lp.mx.kernels.triton_cast import default_config
operands = dict(normalize=False, rowwise=False, colwise=False, row_operand=True, col_operand=True)
builds = [(K, {}) for K in (32, 256, 512, 1024, 4096)]  # RMSNorm + rowwise + colwise MX (the benchmark's)
builds += [(1024, dict(normalize=False)), (1024, dict(normalize=False, x_dtype=torch.float32)),  # dual casts
           (1024, dict(colwise=True, rowwise=False, row_operand=True)),  # the RMSNorm+MXLinear producer
           (4096, operands), (3072, dict(operands, column_sums=True)),  # MXLinear's dY cast (bias gradient: sums)
           # the MLP down-projection's casts with SiLU as input activation: the operand cast, the colwise cast alone
           # (row chunks), and the up-projection's dY cast of SiLU's gradient
           (1024, dict(operands, activation="silu")), (1024, dict(normalize=False, rowwise=False, activation="silu")),
           (1024, dict(operands, activation="silu", activation_input=True, column_sums=True)),
           (1024, dict(hw_cast=False))]
# token counts per K of RMSNorm + both casts: every tile full (the instruction count), then where the default launch
# depends on M (the measured K), a masked last row block and an odd M (the colwise payload in pairs for every M:
# padded rows); the other outputs at a full and an odd M
MS = {1024: (4096, 4064, 4095), 4096: (4096, 4064, 4095)}
for K, kw in builds:
    has_operands = kw.get("row_operand", False) or kw.get("col_operand", False)
    ms = MS.get(K, (4096,)) if not kw else (4096,) if kw.get("column_sums") or kw.get("x_dtype") else (4096, 4095)
    for M in ms:
        # TRITON_INTERPRET=0: the GPU's choice
        config = default_config(K, M % 32 == 0, has_operands, kw.get("hw_cast", True), kw.get("normalize", True))
        b = build_norm(M, K, config, **kw)
        print(json.dumps(dict(K=K, M=M, kw={k: str(v) for k, v in kw.items()}, config=list(config), **b)))
"""


def test_default_configs_compile_for_hopper():
    """The sm_90 builds (no GPU needed) of the GPU's default launch configurations for each set of outputs the
    product makes (the MLP's SiLU casts and dY's casts with their column sums among them) and M even, masked or odd:
    no register spills (the integer rounding, a GPU-test path, may spill a few bytes), registers within a launch's
    cap, 16-byte loads, the hardware E4M3 conversion, vector stores of the paired y^T payload for every M (its rows
    are padded to a multiple of 16 bytes), float32 atomics exactly where column sums are made, and at most 22
    instructions per element for RMSNorm + both casts on full tiles (the 32x32-block tiles took 49-51); 25 where K
    is not a multiple of 128 and the kernel also zeroes the padding of the blocked scales (K = 32: three padding
    bytes per rowwise scale)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="0")  # a compiled, not interpreted, kernel object
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(builds) == 24, done.stdout
    for b in builds:
        assert b["ld_v4"] > 0 and b["programs_per_sm"] >= 1, b
        assert b["config"][6] == 0 or b["regs"] <= b["config"][6], b
        if b["kw"].get("hw_cast") != "False":
            assert b["cvt"] > 0 and b["spills"] == 0, b
        else:  # 28 bytes at M = 4096 and 4064 since the stride became an argument of its own; none at odd M
            assert b["spills"] <= 64, b
        if b["kw"].get("colwise", "True") == "True":
            assert b["st_vec"] > 0, b
        assert (b["atomics"] > 0) == (b["kw"].get("column_sums") == "True"), b
        if not b["kw"] and b["M"] == 4096:
            assert b["instructions_per_element"] <= (22 if b["K"] % 128 == 0 else 25), b
    assert [b["config"] for b in builds if not b["kw"] and b["K"] in MEASURED_KS
            and (b["M"] % 32 == 0 or b["K"] in MEASURED_UNALIGNED_KS)] == (
        [list(MEASURED_CONFIG)] * (2 * len(MEASURED_KS) + len(MEASURED_UNALIGNED_KS)))


_HOPPER_COMPILE_CANDIDATES = """
import json, torch
from benchmarks.cast_candidates import CANDIDATE_CONFIGS, OPERAND_CAST_CANDIDATE_CONFIGS
from benchmarks.tune_casts import build_norm
operands = dict(normalize=False, rowwise=False, colwise=False, row_operand=True, col_operand=True)
builds = [(3072, c, dict(operands, column_sums=sums)) for c in OPERAND_CAST_CANDIDATE_CONFIGS[3072][:2]
          for sums in (False, True)]
builds += [(1024, c, {}) for c in CANDIDATE_CONFIGS[1024] if c[7] or c[1] == 1024]  # prefetch and one pass
for K, config, kw in builds:
    for M in (4096, 4064):
        b = build_norm(M, K, config, **kw)
        print(json.dumps(dict(K=K, M=M, sums=kw.get("column_sums", False), config=list(config), **b)))
"""


@pytest.mark.slow
def test_candidate_launches_compile_for_hopper():
    """The tuning space (`benchmarks/cast_candidates.py`): sm_90 builds of the tile-program operand casts (with and
    without column sums: float32 atomics only with) and of the prefetching and one-pass RMSNorm candidates: no spills,
    registers within a launch's cap, 16-byte loads, and for the tile programs fewer registers than the default
    operand cast's 226 (8 warps an SM)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE_CANDIDATES], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    n_norm = sum(1 for c in CANDIDATE_CONFIGS[1024] if c[7] or c[1] == 1024)
    assert len(builds) == 2 * (4 + n_norm), done.stdout
    for b in builds:
        assert b["spills"] == 0 and b["ld_v4"] > 0, b
        assert b["config"][6] == 0 or b["regs"] <= b["config"][6], b
        assert (b["atomics"] > 0) == b["sums"], b
        if b["config"][8]:
            assert b["regs"] <= 160, b


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(32768, 1024), (5000, 4096), (1000, 8192), (4097, 96)])
def test_gpu_large_shapes_match_reference_given_rstd(M, K):
    x = generic_input(M, K, torch.bfloat16, M)
    w = norm_weight(K, torch.float32, K)
    out = rms_norm_mx(x, w, 1e-6, row_operand=True, col_operand=True)
    ref = cpu_reference(x, w, 1e-6, "rceil")
    ulp = torch.finfo(torch.float32).eps * ref.rstd.abs()
    assert bool(((out.rstd.cpu() - ref.rstd).abs() <= 4 * ulp).all())
    check_outputs(out, x, w, 1e-6, "rceil", True, out.rstd, torch.bfloat16, f"{M}x{K}")
    exact = exact_sum_input(M, K, torch.bfloat16, K)
    out = rms_norm_mx(exact, w, 1e-6)
    ref = cpu_reference(exact, w, 1e-6, "rceil")
    assert_same_values(out.rstd, ref.rstd, "exact-sum rstd")
    check_outputs(out, exact, w, 1e-6, "rceil", True, ref.rstd, torch.bfloat16, f"exact {M}x{K}")


@triton.jit
def _silu_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, input_activation(x, 2).to(tl.bfloat16), mask=m)  # 2: ACT_SILU_BF16


def _every_bf16():
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.gpu
def test_silu_bf16_equals_torch_on_every_input():
    """The casts' SiLU for BF16 (approximate exp2 and division, then BF16 rounding) is torch's `F.silu` bit for bit
    on all 65536 BF16 values (NaN, infinities, subnormals, -0): so every cast of it, in any block, is the cast of
    torch's SiLU."""
    x = _every_bf16().to(DEVICE)
    y = torch.empty_like(x)
    _silu_bf16_kernel[(x.numel() // 1024,)](x, y, x.numel(), BLOCK=1024)
    want = torch.nn.functional.silu(x)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} inputs differ, e.g. {x[~same][:8].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile_programs", (False, True))
def test_silu_bf16_casts_of_every_input(tile_programs):
    """The casts with SiLU as input activation over every BF16 value, in two arrangements of the blocks: the bytes
    of the casts of torch's `F.silu`."""
    x = _every_bf16().view(2048, 32).to(DEVICE)
    for inp in (x, x.t().contiguous().view(2048, 32)):  # rows of 32 consecutive bit patterns, then 32 apart
        out = rms_norm_mx(inp, None, activation="silu", row_operand=True, col_operand=True,
                          tile_programs=tile_programs)
        check_dual_cast(out, torch.nn.functional.silu(inp), "rceil", True, torch.bfloat16, "silu, every BF16 input")


@pytest.mark.gpu
def test_gpu_hardware_and_integer_conversions_agree():
    x, w = generic_input(4096, 2048, torch.bfloat16, 1), norm_weight(2048, torch.bfloat16, 1)
    x[5, 9] = math.nan
    kw = dict(row_operand=True, col_operand=True)
    hw = rms_norm_mx(x, w, hw_cast=True, **kw)
    sw = rms_norm_mx(x, w, hw_cast=False, **kw)
    for name in ("rowwise", "colwise"):
        assert_same_bytes(getattr(hw, name).data, getattr(sw, name).data, name)
        assert_same_bytes(getattr(hw, name).scale, getattr(sw, name).scale, name)
    assert_same_values(hw.row_operand, sw.row_operand, "row operand")
    assert_same_values(hw.col_operand, sw.col_operand, "col operand")


GPU_CONFIGS = [(K, c) for K, configs in CANDIDATE_CONFIGS.items() for c in configs]


@functools.lru_cache(maxsize=8)
def _candidate_case(M, K):
    """Inputs of the candidate test for [M, K] and what of their references does not depend on the launch, made
    once: w; the exact-sum x (a NaN, an Inf row) with its reference rstd and casts; the generic x with its
    reference rstd."""
    w = norm_weight(K, torch.float32, K)
    exact = exact_sum_input(M, K, torch.bfloat16, M)
    exact[3 % M, 5] = math.nan
    if M > 7:
        exact[7] = math.inf
    exact_rstd = cpu_reference(exact, w, 1e-6, "rceil").rstd
    x = generic_input(M, K, torch.bfloat16, M + 1)
    return (w, exact, exact_rstd, reference_casts_of_y(exact, w, exact_rstd, "rceil"), x,
            cpu_reference(x, w, 1e-6, "rceil").rstd)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 4097, 33, 1])
@pytest.mark.parametrize("K,config", GPU_CONFIGS, ids=[f"K{K}-{c!r}".replace(" ", "_") for K, c in GPU_CONFIGS])
def test_gpu_every_candidate_config_matches_reference(K, config, M):
    """Every launch the benchmark times (the default among them), on full and partial row blocks, even and odd M
    (paired and byte-wise colwise stores; a partial last 128-row group, whose scale padding the kernel writes into
    garbage-filled buffers), with NaN/Inf rows: exact-sum inputs bit for bit, generic ones given the kernel's
    rstd."""
    kw = dict(zip(CONFIG_FIELDS, config))
    assert len(kw) == len(config) == len(CONFIG_FIELDS)
    w, exact, exact_rstd, exact_refs, x, ref_rstd = _candidate_case(M, K)
    out = rms_norm_mx(exact, w, 1e-6, **kw)
    assert_same_values(out.rstd, exact_rstd, f"exact-sum rstd {config!r} M={M}")
    check_outputs(out, exact, w, 1e-6, "rceil", True, exact_rstd, torch.bfloat16, f"exact {config!r} M={M}",
                  exact_refs)
    out = rms_norm_mx(x, w, 1e-6, **kw)
    ulp = torch.finfo(torch.float32).eps * ref_rstd.abs()
    assert bool(((out.rstd.cpu() - ref_rstd).abs() <= 4 * ulp).all()), f"rstd {config!r} M={M}"
    check_outputs(out, x, w, 1e-6, "rceil", True, out.rstd, torch.bfloat16, f"generic {config!r} M={M}")


OPERAND_CAST_GPU_CONFIGS = [(K, c) for K, configs in OPERAND_CAST_CANDIDATE_CONFIGS.items()
                            for c in (strip_config(K, True, True),) + configs]


@functools.lru_cache(maxsize=4)
def _operand_cast_case(M, K):
    """x [M, K] bf16 with a NaN and a -Inf, and its reference (rowwise, colwise) casts on the CPU, made once for
    all the launches that are checked on it."""
    x = generic_input(M, K, torch.bfloat16, M + K)
    x[M // 2, 5] = math.nan
    x[M - 1, 7] = -math.inf
    xc = x.cpu()
    return x, (quantize_reference(xc, axis=1), quantize_reference(xc.t(), axis=1, allow_partial=True))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 4097, 33, 1])
@pytest.mark.parametrize("K,config", OPERAND_CAST_GPU_CONFIGS,
                         ids=[f"K{K}-{c!r}".replace(" ", "_") for K, c in OPERAND_CAST_GPU_CONFIGS])
def test_gpu_operand_cast_candidates_match_reference(K, config, M):
    """Every launch the benchmark times for the dual-operand cast without the norm (MXLinear's dY), the
    default among them: even, odd and tiny M, NaN and Inf in x, garbage-filled outputs; the operands and the
    payloads byte for byte, and the column sums within FP32 rounding of torch's."""
    kw = dict(zip(CONFIG_FIELDS, config))
    x, refs = _operand_cast_case(M, K)
    out = rms_norm_mx(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True, column_sums=True,
                      **kw)
    check_dual_cast(out, x, "rceil", True, torch.bfloat16, f"{config!r} M={M}", refs)
    assert_column_sums(out.column_sums, x, f"{config!r} M={M}")
    out = rms_norm_mx(x, None, **kw)
    check_dual_cast(out, x, "rceil", True, torch.bfloat16, f"payloads {config!r} M={M}", refs)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_programs", [False, True])
def test_gpu_column_sums_of_a_large_dy(tile_programs):
    """32768 x 3072 (MXLinear's dY in the benchmark): the column sums against torch's FP32 sum on the GPU."""
    x = torch.randn(32768, 3072, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(3))
    cfg = dict(block_m=32, block_k=64, num_warps=2, thread_rows=4, tile_programs=True) if tile_programs else {}
    out = rms_norm_mx(x, None, rowwise=False, colwise=False, row_operand=True, col_operand=True, column_sums=True,
                      **cfg)
    assert_column_sums(out.column_sums, x, f"tile_programs={tile_programs}")


@pytest.mark.gpu
@pytest.mark.parametrize("programs_per_sm", [1, 2])
def test_gpu_persistent_walk_covers_every_row_block(programs_per_sm):
    """More row blocks than programs: each program walks several (the last one partial, M odd)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    M, K = 3 * programs_per_sm * sms * 32 + 17, 128
    x, w = exact_sum_input(M, K, torch.bfloat16, M), norm_weight(K, torch.float32, M)
    out = rms_norm_mx(x, w, 1e-6, block_m=32, block_k=64, num_warps=1, thread_rows=8,
                      programs_per_sm=programs_per_sm)
    ref = cpu_reference(x, w, 1e-6, "rceil")
    assert_same_values(out.rstd, ref.rstd, "rstd")
    check_outputs(out, x, w, 1e-6, "rceil", True, ref.rstd, torch.bfloat16, f"{programs_per_sm}/SM")


@pytest.mark.up_front_builds
@pytest.mark.gpu
def test_gpu_token_counts_of_a_training_run_compile_nothing_new():
    """Once the launches have run for one token count M that is a multiple of 32 and one that is not, other counts
    (even or odd, divisible by 16 or not, scale padding or not) reuse compiled builds: no compile in the middle of
    training.
    Fails if a build again depends on M beyond the classes `_compile_token_count_variants` compiles up front."""
    import triton

    K = 1024
    w = torch.randn(K, device="cuda")
    compiles = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    try:
        def step(M):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = triton_norm.rms_norm_mx(x, w, 1e-6, rowwise=True, colwise=True)
            torch.cuda.synchronize()
            return y

        step(4000)  # first use of each class: compiles the builds of every M of that class
        step(4001)
        triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiles.append(k.get("fn", a))
        for M in (4096, 4128, 12288, 4110, 8192 + 16, 30002, 4097, 4065, 30001, 12289):
            step(M)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    assert compiles == [], f"{len(compiles)} new builds for other even token counts"


@pytest.mark.up_front_builds
@pytest.mark.parametrize("config", [MEASURED_CONFIG, triton_norm.NormConfig(32, 64, 1, 8),
                                    triton_norm.NormConfig(64, 128, 4, 8)], ids=repr)
@pytest.mark.parametrize("rowwise,colwise", [(True, True), (False, True), (True, False)])
def test_up_front_builds_cover_every_token_count_of_a_class(config, rowwise, colwise, monkeypatch):
    """The builds compiled at a launch's first use (`_compile_token_count_variants`) are every build that any
    other M of the same class (a multiple of 32 or not) selects: Triton's M % 16 specialization and the
    M-dependent constexprs, as `forward_launch` sets them."""
    from gem_lp.mx.layout import blocked_size
    from gem_lp.mx.kernels.triton_cast import _M_ARG, _VARIANTS_COMPILED, _compile_token_count_variants

    K = 256
    kernel = triton_norm._rms_norm_mx_strips_kernel
    warmed = []
    monkeypatch.setattr(kernel, "warmup", lambda *args, grid, **kw: warmed.append(
        (args[_M_ARG] % 16 == 0, kw["EVEN_M"], kw["PAIRED_COLWISE"], kw["M_PADDING"], kw["LARGE_OFFSETS"])),
        raising=False)
    monkeypatch.setattr(triton_norm, "_VARIANTS_COMPILED", set())

    def launch(M):
        x = torch.empty(M, K, device="meta", dtype=torch.bfloat16)
        row = ((torch.empty(M, K, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(blocked_size(M, K // 32), dtype=torch.uint8, device="meta")) if rowwise else None)
        col = ((triton_norm.colwise_payload_buffer(K, M, torch.device("meta")),
                torch.empty(blocked_size(K, -(-M // 32)), dtype=torch.uint8, device="meta")) if colwise else None)
        return triton_norm.forward_launch(x, torch.empty(K, device="meta"), 1e-6, torch.empty(M, device="meta"),
                                          row, col, None, None, blocked_scales=True, rceil=True, hw_cast=True,
                                          config=config)

    for aligned in (True, False):
        ms = [m for m in range(33, 1200) if (m % 32 == 0) == aligned]
        needed = set()
        for M in ms:
            _, _, args, kw = launch(M)
            needed.add((M % 16 == 0, kw["EVEN_M"], kw["PAIRED_COLWISE"], kw["M_PADDING"], kw["LARGE_OFFSETS"]))
        warmed.clear()
        first = ms[0]
        kernel_, _, args, kw = launch(first)
        _compile_token_count_variants(kernel_, args, kw, config)
        have = set(warmed) | {(first % 16 == 0, kw["EVEN_M"], kw["PAIRED_COLWISE"], kw["M_PADDING"],
                               kw["LARGE_OFFSETS"])}
        assert needed <= have, f"aligned={aligned}: builds compiled mid-run: {needed - have}"
        n = len(warmed)
        _compile_token_count_variants(kernel_, args, kw, config)  # the next call: nothing more
        assert len(warmed) == n


@pytest.mark.up_front_builds
def test_first_use_builds_both_classes_of_token_count(monkeypatch):
    """The first call of a launch (here MXLinear's forward cast: no norm, the colwise MX and the BF16 operand, as on
    the GPU with the hardware conversion) also builds the launch that the other class of M (a multiple of 32 or not) takes
    with its own default config: a run whose first batches fall in one class builds nothing when the other comes."""
    K = 128
    kernel = triton_norm._rms_norm_mx_strips_kernel
    warmed = []
    monkeypatch.setattr(kernel, "warmup", lambda *args, grid, **kw: warmed.append(
        (args[triton_norm._M_ARG] % 32 == 0, kw["BLOCK_M"], kw["num_warps"])), raising=False)
    monkeypatch.setattr(triton_norm, "_VARIANTS_COMPILED", set())
    monkeypatch.setattr(triton_norm, "_NORM_PLANS", {})
    monkeypatch.setattr(triton_norm.KernelLaunch, "__call__", lambda self, args, on_gpu: None)
    # the host logic of a GPU call, on meta tensors: the GPU's launch choices, no device check, nothing launched
    monkeypatch.setattr(triton_norm, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(triton_norm, "_check_2d", lambda x, name: None)
    for aligned in (True, False):
        configs = {(c[0], c[2]) for c in [triton_norm.default_config(K, a, True, True, False) for a in (True, False)]}
        warmed.clear()
        triton_norm._VARIANTS_COMPILED.clear()
        x = torch.empty(4096 if aligned else 4097, K, device="meta", dtype=torch.bfloat16)
        triton_norm.rms_norm_mx(x, None, rowwise=False, colwise=True, row_operand=True, hw_cast=True)
        assert {a for a, _, _ in warmed} == {True, False}  # both classes built at the first call
        assert {(bm, nw) for _, bm, nw in warmed} == configs
        n = len(warmed)
        triton_norm.rms_norm_mx(torch.empty(4000 if aligned else 4001, K, device="meta", dtype=torch.bfloat16), None,
                                rowwise=False, colwise=True, row_operand=True, hw_cast=True)
        triton_norm.rms_norm_mx(torch.empty(4001 if aligned else 4000, K, device="meta", dtype=torch.bfloat16), None,
                                rowwise=False, colwise=True, row_operand=True, hw_cast=True)
        assert len(warmed) == n  # later token counts of either class: nothing more
