"""The MX linears on their GPU routes (`gem_lp.linear.gemm`): `cublas` (MX-exact BF16 operands) and `scaled_mm`
(MX payloads into a block-scaled GEMM; on the CPU its product is computed from the exact values, the emulated
Blackwell plan), against the reference recipe, and the operand caches and host work per call.

On CPU machines the casts run in Triton's interpreter. Two kinds of inputs:

* exact: payloads are small integers and scales 2^-2..2^2, so every FP32 sum is exact whatever its order:
  every route must equal the reference bit for bit;
* generic: randn; the routes differ from the reference only by the order of FP32 sums (and one output rounding).
"""
import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from byte_checks import assert_same_bytes, u8
from torch.utils._python_dispatch import TorchDispatchMode

from gem_lp.linear import functions as tg
from gem_lp.linear import gemm as lg
from gem_lp.linear import operands as lo
from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction
from gem_lp.linear.ops import mx_linear, rms_norm_mx_linear
from gem_lp.linear.reference import MXLinearReference, RMSNormMXLinearReference
from gem_lp.mx import MXTensor, dequantize, quantize_reference, to_blocked
from gem_lp.mx.kernels.triton_cast import rms_norm_mx

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# scaled_mm needs block-scaled MMA (sm_100): on Hopper cuBLAS refuses it; on the CPU it is emulated
ROUTES = ("cublas",) if ON_GPU else lg.ROUTES


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_same_values(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


def mx_linear_route(x, w, b=None, scaling="rceil", route="cublas", activation=None):
    return MXLinearFunction.apply(x, w, b, scaling, route, activation)


def rms_norm_mx_linear_route(x, gw, w, b=None, eps=1e-6, scaling="rceil", route="cublas"):
    return RMSNormMXLinearFunction.apply(x, gw, w, b, float(eps), scaling, route)


def exact_linear_tensor(rows, cols, seed, dtype):
    """Integers in [-8, 8] times 2^-2..2^2: every MX cast along either dim is exact, so are the GEMM sums."""
    g = _gen(seed)
    v = torch.randint(-8, 9, (rows, cols), generator=g).float() * torch.exp2(
        torch.randint(-2, 3, (rows, cols), generator=g).float())
    return v.to(dtype).to(DEVICE)


def run_linear(fn, args, dy):
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("M,K,N", [(1, 32, 32), (33, 96, 64), (100, 64, 32), (129, 32, 64)])
def test_mx_linear_exact_inputs_equal_reference(M, K, N):
    i = M % len(ROUTES)
    route, dtype = ROUTES[i], (torch.float32, torch.bfloat16)[M % 2]
    x, w = exact_linear_tensor(M, K, M, dtype), exact_linear_tensor(N, K, N, torch.float32)
    dy = exact_linear_tensor(M, N, M + N, dtype)
    y, grads = run_linear(lambda a, b: mx_linear_route(a, b, None, "rceil", route), (x, w), dy)
    y_ref, grads_ref = run_linear(lambda a, b: MXLinearReference.apply(a, b, None, "rceil"), (x, w), dy)
    assert_same_values(y, y_ref, f"{route} Y")
    for got, want, what in zip(grads, grads_ref, ("dX", "dW")):
        assert_same_values(got, want, f"{route} {what}")


def test_gemm_rows_buckets():
    assert [lg.gemm_rows(m) for m in (0, 1, 33, 63, 64, 100, 129, 300, 32767, 32768, 262145)] == [
        0, 1, 33, 63, 64, 100, 132, 304, 32768, 32768, 262144 + 8192]
    for m in range(1, 5000, 7):
        assert m <= lg.gemm_rows(m) < m * (1 + 1 / 32)


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "rmsnorm+linear"])
@pytest.mark.parametrize("M", [129, 300])
def test_cublas_route_at_a_padded_token_count(norm, M, monkeypatch):
    """At an M that `gemm_rows` pads (129 -> 132, 300 -> 304) the cuBLAS route's GEMMs run on zero-padded
    operands: Y and every gradient have the true shapes and equal, on exact inputs, the same computation without
    padding and the reference."""
    K, N = 64, 96
    dtype = torch.bfloat16
    x, w = exact_linear_tensor(M, K, M, dtype), exact_linear_tensor(N, K, N, torch.float32)
    dy = exact_linear_tensor(M, N, M + N, dtype)
    gw = torch.full((K,), 0.5, device=DEVICE)
    if norm:
        def ours(a, g, b):
            return rms_norm_mx_linear_route(a, g, b, None, 1e-6, "rceil", "cublas")
        ins = (x, gw, w)
    else:
        def ours(a, b):
            return mx_linear_route(a, b, None, "rceil", "cublas")
        ins = (x, w)
    y, grads = run_linear(ours, ins, dy)
    assert y.shape == (M, N) and [g.shape for g in grads] == [t.shape for t in ins]
    monkeypatch.setattr(tg, "route_rows", lambda M, route: None)
    y0, grads0 = run_linear(ours, ins, dy)
    assert_same_values(y, y0, "Y")
    for got, want in zip(grads, grads0):
        assert_same_values(got, want, "gradient")
    if not norm:
        y_ref, grads_ref = run_linear(lambda a, b: MXLinearReference.apply(a, b, None, "rceil"), ins, dy)
        assert_same_values(y, y_ref, "Y vs reference")
        for got, want in zip(grads, grads_ref):
            assert_same_values(got, want, "gradient vs reference")


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "rmsnorm+linear"])
@pytest.mark.parametrize("M,chunk,in_place", [(64, 32, [True, True]), (200, 32, [True] * 7),
                                              (323, 128, [True, True, False])])
def test_forward_in_row_chunks_computes_the_same(norm, M, chunk, in_place, monkeypatch):
    """An operand above `FORWARD_OPERAND_CHUNK_BYTES` is cast and multiplied in row chunks (a power of two rows):
    full chunks, and a last one the row buckets leave unpadded (200 = 6 x 32 + 8), write Y in place; a padded last
    one (67 rows -> 68) is copied. Y and every gradient equal the unchunked computation's, bias included."""
    K, N = 64, 96
    dtype = torch.bfloat16
    x, w = exact_linear_tensor(M, K, M, dtype), exact_linear_tensor(N, K, N, torch.float32)
    dy = exact_linear_tensor(M, N, M + N, dtype)
    gw = torch.full((K,), 0.5, device=DEVICE)
    bias = exact_linear_tensor(1, N, 7, torch.float32)[0]
    if norm:
        def ours(a, g, b, c):
            return rms_norm_mx_linear_route(a, g, b, c, 1e-6, "rceil", "cublas")
        ins = (x, gw, w, bias)
    else:
        def ours(a, b, c):
            return mx_linear_route(a, b, c, "rceil", "cublas")
        ins = (x, w, bias)
    y0, grads0 = run_linear(ours, ins, dy)
    calls = []
    original = tg.gemm_nt

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(tg, "gemm_nt", counting)
    monkeypatch.setattr(tg, "FORWARD_OPERAND_MAX_BYTES", 32 * K * 2)
    monkeypatch.setattr(tg, "FORWARD_OPERAND_CHUNK_BYTES", (chunk + chunk // 4) * K * 2)  # rounded down: `chunk`
    y, grads = run_linear(ours, ins, dy)
    assert calls[:-2] == in_place  # the backward's dX and dW GEMMs come last
    assert_same_values(y, y0, "Y")
    for got, want in zip(grads, grads0):
        assert_same_values(got, want, "gradient")


# FP32 inputs only on the GPU: in the interpreter the kernel's FP32 SiLU is numpy's, which differs from torch's CPU
# SiLU in the last bit of some values (BF16 rounds that away; test_triton_norm checks the FP32 casts against numpy's).
ACT_LINEAR_CASES = [(33, 64, 96, "cublas", torch.bfloat16, 0), (129, 64, 64, "cublas", torch.bfloat16, 32)]
if not ON_GPU:
    ACT_LINEAR_CASES += [(100, 96, 32, "scaled_mm", torch.bfloat16, 0)]
if ON_GPU:
    ACT_LINEAR_CASES += [(4097, 1024, 256, "cublas", torch.float32, 0), (5000, 1024, 256, "cublas", torch.bfloat16, 0)]


@pytest.mark.parametrize("M,K,N,route,dtype,chunk", ACT_LINEAR_CASES)
def test_input_activation_equals_the_composition(M, K, N, route, dtype, chunk, monkeypatch):
    """`activation="silu"` (SiLU computed inside the casts, X kept for its backward): Y and every gradient equal
    those of the linear of torch's `F.silu(x)` bit for bit, also in row chunks (`chunk` rows, the last partial)."""
    g = _gen(M + K)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype).to(DEVICE)
    x.view(-1)[:3] = torch.tensor([-0.0, 40.0, -90.0], dtype=dtype)  # SiLU: -0, x, -0 (exp overflows)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE)
    dy = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    y0, grads0 = run_linear(lambda a, b, c: mx_linear_route(torch.nn.functional.silu(a), b, c, "rceil", route),
                            (x, w, bias), dy)
    if chunk:
        monkeypatch.setattr(tg, "FORWARD_OPERAND_MAX_BYTES", chunk * K * 2)
        monkeypatch.setattr(tg, "FORWARD_OPERAND_CHUNK_BYTES", chunk * K * 2)
    y, grads = run_linear(lambda a, b, c: mx_linear_route(a, b, c, "rceil", route, activation="silu"), (x, w, bias),
                          dy)
    assert_same_values(y, y0, "Y")
    for got, want, name in zip(grads, grads0, ("dX", "dW", "db")):
        if name == "db":  # column sums by atomics, in another order: within FP32 rounding of the sums of |dY|
            assert bool(((got - want).abs() <= 1e-5 * dy.float().abs().sum(0)).all()), "db"
        else:
            assert_same_values(got, want, name)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_inference_forward_in_row_chunks_computes_the_same(activation, monkeypatch):
    """Without gradients (no colwise cast to make) a large operand is also cast in row chunks: the same Y."""
    M, K, N = 100, 64, 32
    x, w = exact_linear_tensor(M, K, 5, torch.bfloat16), exact_linear_tensor(N, K, 6, torch.float32)
    with torch.no_grad():
        y0 = mx_linear_route(x, w, None, activation=activation)
        monkeypatch.setattr(tg, "FORWARD_OPERAND_MAX_BYTES", 32 * K * 2)
        monkeypatch.setattr(tg, "FORWARD_OPERAND_CHUNK_BYTES", 32 * K * 2)
        calls = []
        original = tg.gemm_nt
        monkeypatch.setattr(tg, "gemm_nt", lambda *a, **k: calls.append(1) or original(*a, **k))
        y = mx_linear_route(x, w, None, activation=activation)
    assert len(calls) == 4  # 3 x 32 rows and 4
    assert_same_values(y, y0, "Y")


def test_backward_of_a_large_dy_casts_it_in_two_passes(monkeypatch):
    """Above `FORWARD_OPERAND_MAX_BYTES`, dY's colwise operand is made (with the bias gradient's sums) and used for
    dW before the rowwise one is made for dX; the gradients equal those of the one-pass cast."""
    M, K, N = 70, 64, 96
    x, w = exact_linear_tensor(M, K, 1, torch.bfloat16), exact_linear_tensor(N, K, 2, torch.float32)
    bias, dy = exact_linear_tensor(1, N, 3, torch.float32)[0], exact_linear_tensor(M, N, 4, torch.bfloat16)
    y0, grads0 = run_linear(lambda a, b, c: mx_linear_route(a, b, c), (x, w, bias), dy)
    casts = []
    original = tg.dy_operands

    def recording(*args, **kwargs):
        casts.append((kwargs.get("row", True), kwargs.get("col", True), bool(args[3])))
        return original(*args, **kwargs)

    monkeypatch.setattr(tg, "dy_operands", recording)
    run_linear(lambda a, b, c: mx_linear_route(a, b, c), (x, w, bias), dy)
    assert casts == [(True, True, True)]
    casts.clear()
    monkeypatch.setattr(tg, "FORWARD_OPERAND_MAX_BYTES", M * N * 2 - 1)
    y, grads = run_linear(lambda a, b, c: mx_linear_route(a, b, c), (x, w, bias), dy)
    assert casts == [(False, True, True), (True, False, False)]
    assert_same_values(y, y0, "Y")
    for got, want in zip(grads, grads0):
        assert_same_values(got, want, "gradient")


def test_input_activation_keeps_the_input_only_for_its_gradient():
    """X is saved (for SiLU's backward) only when its gradient is asked for, and then in place of the colwise cast
    of SiLU(X) (made again in the backward); an unknown activation is refused."""
    x = torch.randn(40, 64).bfloat16().to(DEVICE)
    w = torch.randn(32, 64).to(DEVICE).requires_grad_()
    y = mx_linear_route(x.requires_grad_(), w, None, activation="silu")
    data, scale, _, kept = y.grad_fn.saved_tensors
    assert data is None and scale is None and kept.data_ptr() == x.data_ptr()
    y = mx_linear_route(x.detach(), w, None, activation="silu")
    data, scale, _, kept = y.grad_fn.saved_tensors
    assert kept is None and data.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="activation must be None or one of"):
        mx_linear_route(x, w, None, activation="gelu")


def _fp32_rel(route):
    """Relative error of FP32 results: the accumulation order."""
    return 1e-5


def _close(got, want, what, rel):
    scale = want.float().abs().max().item() or 1.0
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3e} > {rel:.1e} * {scale:.3e}"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mx_linear_generic_inputs_match_reference(route, dtype):
    M, K, N = 100, 96, 64
    g = _gen(7)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w, b = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    dy = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    y, grads = run_linear(lambda *a: mx_linear_route(*a, "rceil", route), (x, w, b), dy)
    y_ref, grads_ref = run_linear(lambda *a: MXLinearReference.apply(*a, "rceil"), (x, w, b), dy)
    # FP32 sums in another order; in bf16 one output rounding (cuBLAS also rounds the bias to bf16 first)
    rel32 = _fp32_rel(route)
    rel = rel32 if dtype == torch.float32 else 2.0**-7
    _close(y, y_ref, "Y", rel)
    for got, want, what in zip(grads, grads_ref, ("dX", "dW", "db")):
        assert got.dtype == want.dtype and got.shape == want.shape
        _close(got, want, what, rel if what == "dX" else rel32)


@pytest.mark.parametrize("route", ROUTES)
def test_rms_norm_mx_linear_matches_reference(route):
    M, K, N = 33, 64, 32
    g = _gen(11)
    x = (torch.randn(M, K, generator=g) * 3).to(DEVICE)
    gw = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    w, b = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    dy = torch.randn(M, N, generator=g).to(DEVICE)
    y, grads = run_linear(lambda *a: rms_norm_mx_linear_route(*a, 1e-6, "rceil", route), (x, gw, w, b), dy)
    y_ref, grads_ref = run_linear(lambda *a: RMSNormMXLinearReference.apply(*a, 1e-6, "rceil"), (x, gw, w, b), dy)
    _close(y, y_ref, "Y", _fp32_rel(route))
    for got, want, what in zip(grads, grads_ref, ("dX", "dnorm_weight", "dW", "db")):
        assert got.dtype == want.dtype and got.shape == want.shape
        _close(got, want, what, max(1e-4, 4 * _fp32_rel(route)))


def test_saved_activation_is_the_colwise_mx_cast():
    M, K, N = 70, 64, 32
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device=DEVICE, requires_grad=True)
    y = mx_linear_route(x, w)
    data, scale, weight, x_for_activation = y.grad_fn.saved_tensors
    assert x_for_activation is None  # X itself is kept only with an input activation
    assert data.dtype == torch.float8_e4m3fn and data.shape == (K, M) and scale.dtype == torch.uint8
    assert weight is w or weight.data_ptr() == w.data_ptr()
    ref = quantize_reference(x.detach().t(), axis=1, allow_partial=True)
    assert_same_bytes(data, ref.data, "saved payload")
    assert_same_bytes(scale, to_blocked(ref.scale), "saved scales")
    assert data.numel() + scale.numel() < x.numel() * x.element_size()  # about half of BF16 X
    with torch.no_grad():  # inference: nothing saved, no colwise cast needed
        y2 = mx_linear_route(x, w)
    assert_same_values(y2, y.detach(), "no_grad forward")


@pytest.mark.parametrize("M", [1, 33, 70, 128, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_saved_operand_is_read_along_its_features(M, dtype):
    """The dW GEMM's B operand (X^T [K, M], from the saved colwise cast) is the transposed view of a contiguous
    [M, K] tensor (cuBLAS reads it along K, as it reads BF16 X: an M not a multiple of 8 then costs nothing),
    with the dequantized values of the saved colwise cast."""
    K = 64
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    col = rms_norm_mx(x, None, rowwise=False, colwise=True).colwise
    op = lo.saved_col_operand(col.data, col.scale, "rceil", "cublas", dtype)
    assert op.shape == (K, M) and op.t().is_contiguous()
    want = dequantize(MXTensor(col.data.contiguous(), col.plain_scale(), "1d", 1))
    assert_same_values(op, want.to(op.dtype), "saved operand")
    # the pass reads whole padded rows of the payload: what the padding holds (here NaN bytes) never shows
    stride = col.data.stride(0)
    if stride > M:
        full = col.data.as_strided((K, stride), (stride, 1))
        u8(full)[:, M:] = 0x7F
        op = lo.saved_col_operand(col.data, col.scale, "rceil", "cublas", dtype, rows=M + 5)
        assert op.shape == (K, M + 5) and not op[:, M:].any()
        assert_same_values(op[:, :M], want.to(op.dtype), "saved operand, NaN bytes in the payload's padding")


def test_weight_quantizations_are_cached_until_the_weight_changes():
    lo.clear_weight_cache()
    M, K, N = 33, 64, 32
    x = exact_linear_tensor(M, K, 1, torch.float32)
    w = exact_linear_tensor(N, K, 2, torch.float32).requires_grad_()
    mx_linear_route(x, w).sum().backward()
    (entry,) = lo._WEIGHT_CACHE.get(w).values()
    assert entry.row is not None and entry.col is None  # x needs no grad: no dX, no W along N
    xg = x.clone().requires_grad_()
    mx_linear_route(xg, w).sum().backward()
    (entry2,) = lo._WEIGHT_CACHE.get(w).values()
    assert entry2.col is not None and entry2.version == entry.version
    mx_linear_route(xg, w).sum().backward()
    (entry3,) = lo._WEIGHT_CACHE.get(w).values()
    assert entry3 is entry2  # same step: no new quantization
    with torch.no_grad():  # an optimizer step
        w.mul_(-2.0)
    y = mx_linear_route(x, w)
    (entry4,) = lo._WEIGHT_CACHE.get(w).values()
    assert entry4 is not entry3 and entry4.version == w._version
    assert_same_values(y.detach(), MXLinearReference.apply(x, w.detach(), None, "rceil"), "after the update")


def test_bias_cast_is_cached_until_the_bias_changes():
    """The cuBLAS route adds the bias in Y's dtype: cast once per bias version, remade after an update."""
    lo.clear_weight_cache()
    M, K, N = 33, 64, 32
    g = _gen(21)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE)
    b = torch.randn(N, generator=g).to(DEVICE).requires_grad_()
    mx_linear_route(x, w, b)
    version, _, cast = lg._BIAS_CACHE.get(b)
    assert cast.dtype == torch.bfloat16 and version == b._version
    assert_same_values(cast, b.detach().bfloat16(), "cached bias cast")
    mx_linear_route(x, w, b)
    assert lg._BIAS_CACHE.get(b)[2] is cast  # no new cast
    with torch.no_grad():  # an optimizer step
        b.add_(100.0)
    y = mx_linear_route(x, w, b)
    assert_same_values(lg._BIAS_CACHE.get(b)[2], b.detach().bfloat16(), "bias cast after the update")
    _close(y, MXLinearReference.apply(x, w, b.detach(), "rceil"), "Y after the bias update", 2.0**-7)


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=0.5, fused=True),
    lambda params: torch.optim.SGD(params, lr=0.5, fused=True),
    lambda params: torch.optim.AdamW(params, lr=0.5),
], ids=["adamw_fused", "sgd_fused", "adamw_foreach"])
def test_cached_operands_are_remade_after_any_optimizer_step(make_optimizer):
    """Fused optimizers write the parameters without bumping their version: the next call must still see the new
    weight and bias (a stale quantization would keep the layer at its first weights, with no error)."""
    lo.clear_weight_cache()
    M, K, N = 33, 64, 32
    g = _gen(22)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE).requires_grad_()
    b = torch.randn(N, generator=g).to(DEVICE).requires_grad_()
    optimizer = make_optimizer([w, b])
    for step in range(3):
        y = mx_linear_route(x, w, b)
        _close(y, MXLinearReference.apply(x, w.detach(), b.detach(), "rceil"), f"Y at step {step}", 2.0**-7)
        y.float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_caches_are_neither_read_nor_written_while_a_graph_is_captured(monkeypatch):
    """A captured call must quantize the weight inside the graph: a graph that read the cached quantization would
    replay it after every later update of the weight."""
    lo.clear_weight_cache()
    g = _gen(23)
    x = torch.randn(33, 64, generator=g).bfloat16().to(DEVICE)
    w, b = (torch.randn(32, 64, generator=g) * 0.1).to(DEVICE), torch.randn(32, generator=g).to(DEVICE)
    mx_linear_route(x, w, b)
    (cached,) = lo._WEIGHT_CACHE.get(w).values()
    cached_bias = lg._BIAS_CACHE.get(b)[2]
    monkeypatch.setattr(lo, "capturing", lambda t: True)
    monkeypatch.setattr(lg, "capturing", lambda t: True)
    (scaling, mx_route, operand_dtype), = lo._WEIGHT_CACHE.get(w)
    entry = lo.weight_operands(w, scaling, "scaled_mm" if mx_route else "cublas", operand_dtype, need_col=False)
    assert entry is not cached
    assert_same_values(entry.row, cached.row, "the weight quantized again")
    cast = lg.bias_as(b, torch.bfloat16)
    assert cast is not cached_bias and torch.equal(cast, cached_bias)
    assert tuple(lo._WEIGHT_CACHE.get(w).values()) == (cached,) and lg._BIAS_CACHE.get(b)[2] is cached_bias


def test_cache_entries_leave_with_their_tensors():
    lo.clear_weight_cache()
    x = torch.randn(40, 64, device=DEVICE, dtype=torch.bfloat16)
    w, b = torch.randn(32, 64, device=DEVICE), torch.randn(32, device=DEVICE)
    with torch.no_grad():
        mx_linear_route(x, w, b)
    assert len(lo._WEIGHT_CACHE) == 1 and len(lg._BIAS_CACHE) == 1
    w2 = torch.randn(32, 64, device=DEVICE)
    assert lo._WEIGHT_CACHE.get(w2) is None
    del w, b
    gc.collect()
    assert len(lo._WEIGHT_CACHE) == 0 and len(lg._BIAS_CACHE) == 0


def test_linear_argument_errors():
    x = torch.randn(40, 64, device=DEVICE)
    w, b, gw = torch.randn(32, 64, device=DEVICE), torch.randn(32, device=DEVICE), torch.ones(64, device=DEVICE)
    bad = [
        ((x.int(), w, b), TypeError, "x must be float32, bfloat16 or float16"),
        ((x, w[:, :48], b), ValueError, "x's last dim must equal weight's K=48"),
        ((x[:, :48], w[:, :48], b), ValueError, "multiples of 32"),
        ((x, w[:16], b[:16]), ValueError, "multiples of 32"),
        ((x, w, b[:16]), ValueError, r"bias must be \[N=32\]"),
        ((x, w, b.int()), TypeError, "bias must be float32"),
    ]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            mx_linear(*args, backend="triton")
    with pytest.raises(ValueError, match="scaling"):
        mx_linear(x, w, b, scaling="nearest", backend="triton")
    with pytest.raises(ValueError, match=r"norm_weight must be \[K=64\]"):
        rms_norm_mx_linear(x, gw[:32], w, b, backend="triton")
    with pytest.raises(ValueError, match="backend='cute' is not available for the MX linears"):
        mx_linear(x, w, b, backend="cute")
    if not ON_GPU:
        with pytest.raises(ValueError, match="weight must be on x's device"):
            mx_linear(x, w.to("meta"), b, backend="triton")


# ----------------------------------------------------------------------------- host work per call
#
# At small and mid shapes the GPU waits for the host: a call must make its launches and little else. The
# kernels' launches are recorded instead of run (their outputs stay uninitialized: only the calls are counted),
# with every aten op the call dispatches.

_FREE_OPS = {"empty", "empty_strided", "view", "t", "detach", "alias", "transpose", "as_strided"}


class _AtenOps(TorchDispatchMode):
    """The aten ops dispatched inside, by name, allocations and views left out."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _FREE_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def recorded_launches(monkeypatch):
    """Names of the Triton kernels launched (not run) while the fixture is active."""
    launches = []
    from gem_lp.mx.kernels import triton_cast

    kernel_type = type(triton_cast._rms_norm_mx_strips_kernel)  # every kernel of the path is of this class
    monkeypatch.setattr(kernel_type, "run", lambda self, *args, grid, warmup, **kwargs: launches.append(
        self.__name__))
    return launches


def _linear_call(norm: bool, route: str, dtype: torch.dtype, backward: bool):
    M, K, N = 40, 64, 32
    g = _gen(5)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE).requires_grad_()
    gw = (torch.rand(K, generator=g) + 0.5).to(DEVICE).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE).requires_grad_()
    b = torch.randn(N, generator=g).to(DEVICE).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    inputs = (x, gw, w, b) if norm else (x, w, b)

    def call():
        y = (rms_norm_mx_linear_route(x, gw, w, b, 1e-6, "rceil", route) if norm
             else mx_linear_route(x, w, b, "rceil", route))
        return torch.autograd.grad(y, inputs, dy) if backward else y

    return call, w


# (norm, route) -> (Triton launches of a forward, of a forward + backward; the other aten ops of each), FP32
# activations (on the CPU a BF16 dW takes FP32 copies of its operands; cuBLAS takes BF16 with an FP32 output).
# dY's column sums (the bias gradient): a `zeros` for the buffer dY's cast adds them to
_EXPECTED_PER_CALL = {
    (False, "cublas"): (1, 3, ["addmm"], ["addmm", "mm", "mm", "zeros"]),
    (True, "cublas"): (1, 4, ["addmm"], ["addmm", "mm", "mm", "zeros", "sum"]),
}


@pytest.mark.skipif(ON_GPU, reason="counted in the interpreter; on the GPU, test_gpu_linear_calls_never_sync")
@pytest.mark.parametrize("norm,route", list(_EXPECTED_PER_CALL), ids=lambda v: str(v))
def test_launches_and_ops_per_call(norm, route, recorded_launches):
    """Steady state (W quantized at the first call): the launches of the section comment, the GEMMs and dY's
    column sums (the RMSNorm variant also sums its norm weight's partial gradients), and nothing else: no
    copy, no cast, no read of a device value on the host (`item`, `_local_scalar_dense`, `nonzero`)."""
    n_fwd, n_step, ops_fwd, ops_step = _EXPECTED_PER_CALL[(norm, route)]
    for backward, n_launches, ops in ((False, n_fwd, ops_fwd), (True, n_step, ops_step)):
        call, w = _linear_call(norm, route, torch.float32, backward)
        call()  # quantizes W (both casts: x needs a gradient)
        recorded_launches.clear()
        with _AtenOps() as aten:
            call()
        what = f"{'fwd+bwd' if backward else 'fwd'} norm={norm} route={route}"
        assert len(recorded_launches) == n_launches, f"{what}: launches {recorded_launches}"
        assert sorted(aten.ops) == sorted(ops), f"{what}: aten ops {aten.ops}"
        with torch.no_grad():  # an optimizer step: W's two casts are remade by one more launch
            w.mul_(0.5)
        recorded_launches.clear()
        call()
        assert len(recorded_launches) == n_launches + 1, f"{what} after a weight update: {recorded_launches}"


@pytest.mark.skipif(ON_GPU, reason="counted in the interpreter; on the GPU, test_gpu_linear_calls_never_sync")
def test_bf16_forward_casts_nothing(recorded_launches):
    """BF16 activations with an FP32 bias (the cuBLAS route adds it in BF16): after the first call the
    forward is the producer launch and the addmm, the bias cast coming from the cache."""
    call, _ = _linear_call(False, "cublas", torch.bfloat16, False)
    call()
    recorded_launches.clear()
    with _AtenOps() as aten:
        call()
    assert len(recorded_launches) == 1 and aten.ops == ["addmm"], (recorded_launches, aten.ops)




# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("route", ROUTES)
def test_gpu_mx_linear_and_norm_linear(route):
    M, K, N = 4097, 1024, 768
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    gw = torch.rand(K, device="cuda") + 0.5
    w, b = torch.randn(N, K, device="cuda") * 0.05, torch.randn(N, device="cuda")
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    y, grads = run_linear(lambda *a: mx_linear_route(*a, "rceil", route), (x, w, b), dy)
    y_ref, grads_ref = run_linear(lambda *a: MXLinearReference.apply(*a, "rceil"), (x, w, b), dy)
    _close(y, y_ref, "Y", 2.0**-7)
    for got, want, what in zip(grads, grads_ref, ("dX", "dW", "db")):
        _close(got, want, what, 2.0**-7 if what == "dX" else 1e-4)
    y, grads = run_linear(lambda *a: rms_norm_mx_linear_route(*a, 1e-6, "rceil", route), (x, gw, w, b), dy)
    y_ref, grads_ref = run_linear(lambda *a: RMSNormMXLinearReference.apply(*a, 1e-6, "rceil"), (x, gw, w, b), dy)
    _close(y, y_ref, "norm Y", 2.0**-6)
    # On CUDA the reference's rstd (torch.rsqrt, approximate; its own summation order) can differ from the
    # kernel's correctly rounded FP32 steps by an ulp, which flips a rare E4M3 rounding of the normalized
    # activation; one flip moves a dW entry by up to ulp_e4m3(y) * |dY| (~1 here), so dW and the norm weight's
    # gradient get the activation's bound, not the GEMM's.
    for got, want, what in zip(grads, grads_ref, ("dX", "dnorm_weight", "dW", "db")):
        _close(got, want, f"norm {what}", 1e-3 if what == "db" else 2.0**-6)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ROUTES)
def test_gpu_linear_calls_never_sync(route):
    """No forward or backward call waits for the GPU or copies device memory to the host (both would stall the
    launch queue): CUDA's sync debug mode turns any such call into an error. Includes the first call after a
    weight and bias update (W re-quantized, the bias re-cast)."""
    M, K, N = 1000, 256, 96
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gw = (torch.rand(K, device="cuda") + 0.5).requires_grad_()
    w = (torch.randn(N, K, device="cuda") * 0.05).requires_grad_()
    b = torch.randn(N, device="cuda", requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def steps():
        y = mx_linear_route(x, w, b, "rceil", route)
        torch.autograd.grad(y, (x, w, b), dy)
        y = rms_norm_mx_linear_route(x, gw, w, b, 1e-6, "rceil", route)
        torch.autograd.grad(y, (x, gw, w, b), dy)
        with torch.no_grad():
            mx_linear_route(x, w, b, "rceil", route)

    steps()  # compiles the kernels
    with torch.no_grad():
        w.mul_(0.5)
        b.add_(1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps()
        steps()
    finally:
        torch.cuda.set_sync_debug_mode("default")
