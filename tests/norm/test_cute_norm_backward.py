"""The RMSNorm backward on the CuTe kernel (`gem_lp.norm.kernels.cute_backward`) on the GPU, against the FP64 formula and the
Triton kernel, at odd token counts, the model's widths, strided rows; and inside the MX norm linear's backward.
sm_90 / sm_100 with the CuTe DSL stack only."""
import pytest
import torch

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu()

from gem_lp.linear.ops import rms_norm_mx_linear  # noqa: E402
from gem_lp.norm.kernels.cute_backward import rms_norm_backward_cute  # noqa: E402
from gem_lp.norm.kernels.triton_backward import rms_norm_backward  # noqa: E402
from gem_lp.runtime import dispatch  # noqa: E402

DEV = "cuda"
EPS = 1e-6


def _inputs(M, K, dy_dtype, seed, row_stride=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    base = torch.randn(M, row_stride or K, device=DEV, generator=g)
    x = (base * torch.exp2(torch.randint(-8, 9, (M, 1), device=DEV, generator=g).float())).bfloat16()[:, :K]
    w = torch.rand(K, device=DEV, generator=g) + 0.5
    dy = torch.randn(M, K, device=DEV, generator=g).to(dy_dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    return x, w, rstd, dy


def _want(x, w, rstd, dy):
    xhat = x.double() * rstd.double()[:, None]
    dxhat = dy.double() * w.double()
    dx = rstd.double()[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, (dy.double() * xhat).sum(0), (dy.double() * xhat).abs().sum(0)


@pytest.mark.parametrize("K", [256, 512, 1024, 4096])
@pytest.mark.parametrize("M", [0, 1, 31, 33, 127, 129, 32767])
@pytest.mark.parametrize("dy_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_formula_and_the_triton_kernel(M, K, dy_dtype):
    x, w, rstd, dy = _inputs(M, K, dy_dtype, seed=M * 7 + K)
    dx, dw = rms_norm_backward_cute(x, w, rstd, dy)
    assert dx.dtype == x.dtype and dx.shape == (M, K) and dw.dtype == torch.float32 and dw.shape == (K,)
    want_dx, want_dw, dw_mag = _want(x, w, rstd, dy)
    if M:
        # BF16 dx: within a BF16 rounding of each element (FP32 math, another summation order than the formula's)
        err = (dx.double() - want_dx).abs()
        assert bool((err <= want_dx.abs() * 2.0 ** -8 + want_dx.abs().max() * 2.0 ** -20).all())
        t_dx, t_dw = rms_norm_backward(x, w, rstd, dy)
        assert (dx.float() - t_dx.float()).abs().max() <= t_dx.float().abs().max() * 2.0 ** -7
    # dW: FP32 partial sums per CTA, summed: within FP32 rounding of the sum of magnitudes
    assert bool(((dw.double() - want_dw).abs() <= dw_mag * 1e-5 + 1e-30).all())


def test_strided_rows_give_the_contiguous_rows_result():
    x, w, rstd, dy = _inputs(1000, 256, torch.float32, seed=3, row_stride=384)
    assert not x.is_contiguous()
    dx, dw = rms_norm_backward_cute(x, w, rstd, dy)
    dx_c, dw_c = rms_norm_backward_cute(x.contiguous(), w, rstd, dy)
    assert torch.equal(dx, dx_c) and torch.allclose(dw, dw_c, rtol=1e-6, atol=0)


@pytest.fixture
def norm_backward_impl(monkeypatch):
    """`use(impl)`: the dispatch table gives the RMSNorm backward `impl` ("cute" or "triton") on this GPU's arch."""
    key = ("rms_norm_backward", "fp32")

    def use(impl: str) -> None:
        monkeypatch.setitem(dispatch.TABLE, key, {arch: (impl,) for arch in ("sm_90", "sm_100", "cuda")})
        dispatch.clear()

    yield use
    dispatch.clear()


@pytest.mark.parametrize("M", [33, 4097])
def test_the_norm_linear_backward_on_either_kernel(norm_backward_impl, M):
    g = torch.Generator(device=DEV).manual_seed(M)
    x = torch.randn(M, 256, device=DEV, generator=g).bfloat16()
    norm_w = torch.rand(256, device=DEV, generator=g) + 0.5
    weight = (torch.randn(512, 256, device=DEV, generator=g) / 16).bfloat16()
    dy = torch.randn(M, 512, device=DEV, generator=g).bfloat16()
    grads = []
    for impl in ("cute", "triton"):
        norm_backward_impl(impl)
        assert dispatch.choose("rms_norm_backward", "fp32", x.device) == impl
        xi, gi = x.clone().requires_grad_(), norm_w.clone().requires_grad_()
        rms_norm_mx_linear(xi, gi, weight, eps=EPS, backend="triton").backward(dy)
        grads.append((xi.grad.float(), gi.grad.float()))
    (dx_c, dg_c), (dx_t, dg_t) = grads
    assert (dx_c - dx_t).abs().max() <= dx_t.abs().max() * 2.0 ** -7
    assert torch.allclose(dg_c, dg_t, rtol=1e-4, atol=1e-4 * float(dg_t.abs().max()))
