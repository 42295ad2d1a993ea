"""The MLP op (`rms_norm_mx_mlp`) and the casts of an activation's gradient it is built on.

On the GPU routes the up-projection's dY casts compute SiLU's backward from the down-projection's dX (the gradient
of SiLU's output) and the pre-activation: the fused op must give the values of the two layers composed, on every
route, and the gradient casts the bytes of casting torch's `silu_backward`. CPU: Triton's interpreter (the `scaled_mm`
route emulated from exact values, as the emulated Blackwell plan runs it); with CUDA, the kernels.
"""
import contextlib

import pytest
import torch

from gem_lp.models.blocks import FeedForward, OpSettings
from gem_lp.linear import mx_linear, rms_norm_mx_linear, rms_norm_mx_mlp
from gem_lp.linear import operands as lo
from gem_lp.linear.gemm import ROUTES as ALL_ROUTES
from gem_lp.mx.kernels.triton_cast import rms_norm_mx
from gem_lp.runtime import dispatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# scaled_mm needs block-scaled MMA (sm_100): on Hopper cuBLAS refuses it; on the CPU it is emulated
ROUTES = ("cublas",) if ON_GPU else ALL_ROUTES


def _gen(seed):
    return torch.Generator().manual_seed(seed)


CAST_CASES = [(0, 64), (1, 32), (31, 64), (33, 64), (127, 96), (129, 256), (130, 256)]
if ON_GPU:
    CAST_CASES += [(32767, 1024), (4096, 256), (5000, 4096)]


@pytest.mark.parametrize("M,K", CAST_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_cast_equals_the_cast_of_torchs_silu_backward(M, K, dtype):
    """Every output of `rms_norm_mx(dy, activation="silu", activation_input=z)` equals that of casting torch's
    `silu_backward(dy, z)` (column sums within FP32 rounding: atomics add them in another order)."""
    if dtype == torch.float32 and not ON_GPU:
        pytest.skip("FP32 SiLU in the interpreter is numpy's exp, which differs from torch's in the last bit")
    g = _gen(M + K)
    dy = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    z = (torch.randn(M, K, generator=g) * 4).to(dtype).to(DEVICE)
    if M:
        z.view(-1)[:3] = torch.tensor([-0.0, 60.0, -100.0], dtype=dtype)  # exp overflows / underflows
    want_in = torch.ops.aten.silu_backward(dy, z)
    kw = dict(rowwise=True, colwise=True, row_operand=True, col_operand=True, column_sums=True, blocked_scales=True)
    want = rms_norm_mx(want_in, None, **kw)
    got = rms_norm_mx(dy, None, activation="silu", activation_input=z, **kw)
    for name in ("row_operand", "col_operand"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("rowwise", "colwise"):
        g_mx, w_mx = getattr(got, name), getattr(want, name)
        assert torch.equal(g_mx.data.view(torch.uint8), w_mx.data.view(torch.uint8)), f"{name} payload"
        assert torch.equal(g_mx.scale, w_mx.scale), f"{name} scales"
    bound = 1e-5 * want_in.float().abs().sum(0) + 1e-30
    assert bool(((got.column_sums - want.column_sums).abs() <= bound).all())


@pytest.mark.parametrize("M,K", [(0, 64), (33, 64), (130, 256)] + ([(32767, 1024)] if ON_GPU else []))
def test_gradient_cast_writes_its_row_operand_over_its_input(M, K):
    """`row_operand_out` = the padded buffer x is the first rows of: the same operands as into new memory, the
    padding rows zeroed."""
    g = _gen(M + K + 1)
    rows = M + 7
    dy = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    z = (torch.randn(M, K, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    kw = dict(rowwise=False, colwise=False, row_operand=True, col_operand=True, column_sums=True,
              operand_rows=rows, activation="silu", activation_input=z)
    want = rms_norm_mx(dy, None, **kw)
    buf = torch.full((rows, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    buf[:M] = dy
    got = rms_norm_mx(buf[:M], None, row_operand_out=buf, **kw)
    assert got.row_operand.data_ptr() == buf.data_ptr()
    assert torch.equal(buf, want.row_operand) and torch.equal(got.col_operand, want.col_operand)
    with pytest.raises(ValueError, match="row_operand_out needs"):
        rms_norm_mx(buf[:M], None, row_operand_out=buf[:, :32], **kw)


def test_gradient_cast_checks_its_activation_input():
    x = torch.randn(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="activation_input must be"):
        rms_norm_mx(x, None, activation="silu", activation_input=torch.randn(64, 64, device=DEVICE))
    with pytest.raises(ValueError, match="activation_input must be"):
        rms_norm_mx(x, None, activation="silu", activation_input=x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="needs an activation"):
        rms_norm_mx(x, None, activation_input=x)


def _mlp_inputs(M, D, H, dtype, bias, seed=0):
    g = _gen(seed + M)
    x = (torch.randn(M, D, generator=g) * 2).to(dtype).to(DEVICE).requires_grad_()
    nw = (torch.rand(D, generator=g) + 0.5).to(DEVICE).requires_grad_()
    w1 = (torch.randn(H, D, generator=g) / D**0.5).to(DEVICE).requires_grad_()
    w2 = (torch.randn(D, H, generator=g) / H**0.5).to(DEVICE).requires_grad_()
    b1 = torch.randn(H, generator=g).to(DEVICE).requires_grad_() if bias else None
    b2 = torch.randn(D, generator=g).to(DEVICE).requires_grad_() if bias else None
    dy = torch.randn(M, D, generator=g).to(dtype).to(DEVICE)
    return (x, nw, w1, b1, w2, b2), dy


def _run(fn, ins, dy):
    y = fn(*ins)
    wrt = [t for t in ins if t is not None]
    return y, torch.autograd.grad(y, wrt, dy)


MLP_CASES = [(0, 64, 128, True), (1, 32, 64, False), (31, 64, 128, True), (33, 64, 128, True), (129, 96, 64, True)]
if ON_GPU:
    MLP_CASES += [(32767, 256, 1024, True), (4097, 1024, 256, False)]


# (backend, the arch whose plan CPU tensors take): the cuBLAS route (`backend="triton"`), the reference, and on the CPU
# the emulated Blackwell plan, whose `auto` takes the scaled_mm route
PLANS = [("triton", None), ("reference", None)] + ([] if ON_GPU else [("auto", "sm_100")])


@pytest.mark.parametrize("M,D,H,bias", MLP_CASES)
@pytest.mark.parametrize("backend,arch", PLANS, ids=[f"{b}-{a}" if a else b for b, a in PLANS])
def test_mlp_equals_the_layers_composed(M, D, H, bias, backend, arch):
    """Y and every gradient of the fused op equal those of `rms_norm_mx_linear` then `mx_linear(input_activation=
    "silu")` on the same backend and route (BF16 activations). The bias gradients are FP32 column sums that atomics
    add in an order that changes between runs: equal within FP32 rounding of the sums of the summed values'
    magnitudes."""
    if backend == "reference" and M > 1000:
        pytest.skip("the reference at the GPU sizes adds nothing")
    if arch is not None and M not in (0, 33):
        pytest.skip("the emulated scaled_mm route: M = 0 and 33 (a partial block) cover it")
    with dispatch.emulate(arch) if arch else contextlib.nullcontext():
        if arch:
            assert dispatch.choose("linear", "mxfp8", DEVICE, backend) == "scaled_mm"
        _check_mlp_equals_the_layers_composed(M, D, H, bias, backend)


def _check_mlp_equals_the_layers_composed(M, D, H, bias, backend):
    ins, dy = _mlp_inputs(M, D, H, torch.bfloat16, bias)
    d_hidden = []  # the gradient of the up-projection's output, whose column sums db_up is

    def composed(x, nw, w1, b1, w2, b2):
        h = rms_norm_mx_linear(x, nw, w1, b1, 1e-6, backend=backend)
        if h.requires_grad:
            h.register_hook(d_hidden.append)
        return mx_linear(h, w2, b2, input_activation="silu", backend=backend)

    y0, grads0 = _run(composed, ins, dy)
    y, grads = _run(lambda *a: rms_norm_mx_mlp(*a, 1e-6, backend=backend), ins, dy)
    assert torch.equal(y, y0)
    names = [n for n, t in zip(("dx", "dnorm_weight", "dw_up", "db_up", "dw_down", "db_down"), ins) if t is not None]
    summed = {"db_up": d_hidden[0] if d_hidden else None, "db_down": dy}
    for got, want, name in zip(grads, grads0, names):
        if name in summed:
            v = summed[name].float().abs()
            bound = 1e-5 * v.sum(0) + 1e-30
            if name == "db_up" and not ON_GPU:
                # the interpreter's SiLU backward (numpy's exp) can round a BF16 element one unit off torch's CPU
                # one; the MX operands absorb it (compared bit for bit above), db_up sums the BF16 values themselves
                bound = bound + (v.amax(0) if v.numel() else 0.0) * 2.0**-8
            assert bool(((got - want).abs() <= bound).all()), name
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("route", ROUTES)
def test_mlp_never_stores_the_activation_gradient(route, monkeypatch):
    """On the GPU routes the up-projection's dY casts compute SiLU's backward (no `silu_backward` runs on the cuBLAS
    route's Triton kernels; the emulated scaled_mm route's CPU model of the casts runs torch's) and (cuBLAS route) write
    the row operand over their input (act's gradient), whose memory then serves again."""
    ins, dy = _mlp_inputs(33, 64, 128, torch.bfloat16, True)
    calls = []
    original = lo.casts

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        if kwargs.get("activation_input") is not None and route == "cublas":  # written over act's gradient
            assert out.row_operand.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        calls.append(kwargs.get("activation_input") is not None)
        return out

    monkeypatch.setattr(lo, "casts", recording)
    plan = contextlib.nullcontext() if route == "cublas" else dispatch.emulate("sm_100")
    with plan, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert dispatch.choose("linear", "mxfp8", DEVICE, "triton" if route == "cublas" else "auto") == route
        _run(lambda *a: rms_norm_mx_mlp(*a, 1e-6, backend="triton" if route == "cublas" else "auto"), ins, dy)
    names = {e.name for e in prof.events()}
    if route == "cublas":
        assert not any("silu_backward" in n for n in names), sorted(n for n in names if "silu" in n)
    assert calls.count(True) == 1  # the up-projection's dY cast (rows, columns and column sums in one pass)


def test_mlp_checks_its_arguments():
    (x, nw, w1, b1, w2, b2), _ = _mlp_inputs(8, 32, 64, torch.float32, True)
    with pytest.raises(ValueError, match="w_down must be"):
        rms_norm_mx_mlp(x, nw, w1, b1, w2[:, :32], b2)
    with pytest.raises(ValueError, match="b_down must be"):
        rms_norm_mx_mlp(x, nw, w1, b1, w2, b2[:16])
    with pytest.raises(ValueError, match="activation must be"):
        rms_norm_mx_mlp(x, nw, w1, b1, w2, b2, activation=None)


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])
def test_feed_forward_runs_the_mlp_op_for_mxfp8(recipe, monkeypatch):
    """The model's MLP block: one `rms_norm_mx_mlp` call with the MXFP8 recipe (the same values as its layers
    composed), the layers themselves otherwise."""
    ops = OpSettings(recipe, "auto", "const_p", 1e-6)
    block = FeedForward(ops, 64, 128, "silu").to(DEVICE)
    x = torch.randn(40, 64, device=DEVICE).to(torch.bfloat16)
    import gem_lp.models.blocks as blocks

    calls = []
    monkeypatch.setattr(blocks, "rms_norm_mx_mlp", lambda *a, **k: calls.append(1) or rms_norm_mx_mlp(*a, **k))
    y = block(x)
    assert len(calls) == (recipe == "mxfp8")
    want = block.down(block.up(x))
    assert torch.equal(y, want)
