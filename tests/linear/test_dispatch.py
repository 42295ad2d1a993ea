"""The public norm/linear ops route `backend="triton"` to the kernels and agree with the reference."""
import torch

from gem_lp.linear import mx_linear
from gem_lp.norm import rms_norm_quantize
from gem_lp.linear.ops import rms_norm_mx_linear
from gem_lp.accuracy import sqnr_db

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_rms_norm_quantize_triton_matches_reference():
    """The sum of squares is accumulated in another order than torch's, so rstd may differ by an ulp and a
    payload byte by one code where that ulp crosses an E4M3 rounding boundary (bit-identity on inputs with
    exact sums is tested in test_triton_norm.py)."""
    x = torch.randn(45, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(64, device=DEV, dtype=torch.bfloat16)
    a = rms_norm_quantize(x, w, backend="triton")
    b = rms_norm_quantize(x, w, backend="reference")
    torch.testing.assert_close(a.rstd, b.rstd, rtol=1e-6, atol=0)
    for name in ("rowwise", "colwise"):
        ma, mb = getattr(a, name), getattr(b, name)
        assert torch.equal(ma.plain_scale(), mb.plain_scale()), name
        da, db = ma.data.view(torch.uint8).int(), mb.data.view(torch.uint8).int()
        assert (da - db).abs().max() <= 1 and (da != db).float().mean() < 0.01, name


def _grads(fn, *args):
    args = [a.detach().clone().requires_grad_() for a in args]
    y = fn(*args)
    g = torch.randn_like(y)
    y.backward(g)
    return [y] + [a.grad for a in args]


def test_mx_linear_triton_matches_reference():
    x = torch.randn(33, 64, device=DEV)
    w = torch.randn(96, 64, device=DEV) / 8
    b = torch.randn(96, device=DEV)
    torch.manual_seed(1)
    ref = _grads(lambda *a: mx_linear(*a, backend="reference"), x, w, b)
    torch.manual_seed(1)
    tri = _grads(lambda *a: mx_linear(*a, backend="triton"), x, w, b)
    for r, t in zip(ref, tri):
        assert sqnr_db(t, r) > 60  # same quantized operands; only the fp32 accumulation order differs


def test_rms_norm_mx_linear_triton_matches_reference():
    x = torch.randn(40, 64, device=DEV)
    nw = torch.rand(64, device=DEV) + 0.5
    w = torch.randn(32, 64, device=DEV) / 8
    torch.manual_seed(2)
    ref = _grads(lambda *a: rms_norm_mx_linear(*a, backend="reference"), x, nw, w)
    torch.manual_seed(2)
    tri = _grads(lambda *a: rms_norm_mx_linear(*a, backend="triton"), x, nw, w)
    for r, t in zip(ref, tri):
        assert sqnr_db(t, r) > 60


def test_mx_linear_input_activation_on_each_backend_equals_the_composition():
    """`input_activation="silu"`: the reference applies torch's SiLU then the recipe; the Triton path computes it
    inside its casts. Each equals `mx_linear(F.silu(x))` on the same backend (BF16 x: bit for bit, bias
    gradient apart, whose column sums the Triton cast adds in another order)."""
    x = (torch.randn(37, 64, device=DEV) * 3).bfloat16()
    w = torch.randn(96, 64, device=DEV) / 8
    b = torch.randn(96, device=DEV)
    for backend in ("reference", "triton"):
        torch.manual_seed(3)
        fused = _grads(lambda *a: mx_linear(*a, input_activation="silu", backend=backend), x, w, b)
        torch.manual_seed(3)
        composed = _grads(lambda a, *r: mx_linear(torch.nn.functional.silu(a), *r, backend=backend), x, w, b)
        for got, want, name in zip(fused, composed, ("Y", "dX", "dW", "db")):
            if name == "db":
                torch.testing.assert_close(got, want)
            else:
                assert torch.equal(got, want), f"{backend} {name}"


def test_mx_linear_input_activation_errors():
    import pytest

    with pytest.raises(ValueError, match="input_activation must be None or one of"):
        mx_linear(torch.randn(4, 32), torch.randn(32, 32), input_activation="tanh")


def test_auto_takes_the_route_of_the_emulated_plan(monkeypatch):
    """CPU tensors under `dispatch.emulate(arch)` take that arch's plan, its kernels' CPU models: `auto` runs the MX
    linears on scaled_mm for sm_100 (the block-scaled GEMM from exact values) and on cublas for sm_90, each with the
    reference's values (only the FP32 summation order differs)."""
    import gem_lp.linear.functions as functions

    from gem_lp.runtime import dispatch

    routes = []
    original = functions.MXLinearFunction.apply
    monkeypatch.setattr(functions.MXLinearFunction, "apply", lambda *a: routes.append(a[4]) or original(*a))
    x = torch.randn(33, 64)
    w = torch.randn(96, 64) / 8
    b = torch.randn(96)
    torch.manual_seed(4)
    ref = _grads(lambda *a: mx_linear(*a, backend="reference"), x, w, b)
    for arch, route in (("sm_100", "scaled_mm"), ("sm_90", "cublas")):
        with dispatch.emulate(arch):
            assert dispatch.choose("linear", "mxfp8", x.device) == route
            torch.manual_seed(4)
            got = _grads(lambda *a: mx_linear(*a), x, w, b)
        for r, t in zip(ref, got):
            assert sqnr_db(t, r) > 60
    assert routes == ["scaled_mm", "cublas"]
    assert dispatch.choose("linear", "mxfp8", x.device) == "reference"  # outside: the CPU's plan
