"""The BF16 recipe's RMSNorm on the CuTe kernels (`gem_lp.norm.kernels.cute_forward.RMSNormCute`: quack's forward, the
backward of `gem_lp.norm.kernels.cute_backward`) on the GPU, against torch's `F.rms_norm` and the FP64 formula, at odd token
counts and the model's widths; and inside `RMSNormMXLinear(recipe="bf16")`. sm_90 / sm_100 with the CuTe DSL stack
only."""
import pytest
import torch
import torch.nn.functional as F

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu()

from gem_lp.runtime.builds import cute_kernel_builds  # noqa: E402
from gem_lp.norm.kernels.cute_forward import RMSNormCute  # noqa: E402
from gem_lp.linear import RMSNormMXLinear  # noqa: E402

DEV = "cuda"
EPS = 1e-6


@pytest.mark.parametrize("K", [256, 1024, 4096])
@pytest.mark.parametrize("M", [0, 1, 31, 33, 127, 129, 32767])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_torch_and_the_formula(M, K, dtype):
    g = torch.Generator(device=DEV).manual_seed(M * 3 + K)
    x = (torch.randn(M, K, device=DEV, generator=g) * 4).to(dtype).requires_grad_()
    w = (torch.rand(K, device=DEV, generator=g) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(M, K, device=DEV, generator=g).to(dtype)
    y = RMSNormCute.apply(x, w, EPS)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype and y.shape == dx.shape == (M, K) and dw.shape == (K,)
    y_t = F.rms_norm(x, (K,), w, EPS)
    dx_t, dw_t = torch.autograd.grad(y_t, (x, w), dy)
    if M == 0:
        assert bool((dw == 0).all())
        return
    # FP32 math on both sides, rounded once to 16 bits: within one rounding of each other
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(y.float(), y_t.float(), rtol=ulp, atol=1e-5)
    xd, wd = x.detach().double(), w.detach().double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    xhat = xd * rstd
    dxhat = dy.double() * wd
    want_dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    err = (dx.double() - want_dx).abs()
    assert bool((err <= want_dx.abs() * 2 * ulp + want_dx.abs().max() * 2.0 ** -18).all())
    want_dw = (dy.double() * xhat).sum(0)
    mag = (dy.double() * xhat).abs().sum(0)
    assert bool(((dw.double() - want_dw).abs() <= want_dw.abs() * ulp + mag * 2.0 ** -18).all())


def test_the_bf16_norm_linear_takes_it_with_one_build_per_width():
    """`RMSNormMXLinear(recipe="bf16")` on the GPU runs the CuTe norm: the output and gradients of torch's norm up to
    its roundings, and new token counts build nothing."""
    torch.manual_seed(0)
    layer = RMSNormMXLinear(256, 512, recipe="bf16").to(DEV)
    layer.norm_weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1000, 256, device=DEV).bfloat16().requires_grad_()
    y = layer(x)
    y.float().pow(2).sum().backward()
    weight, bias = layer.effective_parameters()
    x2 = x.detach().clone().requires_grad_()
    w2 = layer.norm_weight.detach().clone().requires_grad_()
    y2 = F.linear(F.rms_norm(x2, (256,), w2.bfloat16(), layer.eps), weight.bfloat16(), bias.bfloat16())
    y2.float().pow(2).sum().backward()
    torch.testing.assert_close(y.float(), y2.float(), rtol=2 ** -6, atol=2e-2)
    cos = F.cosine_similarity(x.grad.float().flatten(), x2.grad.float().flatten(), dim=0)
    assert cos > 0.9999 and F.cosine_similarity(layer.norm_weight.grad, w2.grad, dim=0) > 0.9999
    before = cute_kernel_builds()
    for m in (1, 77, 4097):
        layer(torch.randn(m, 256, device=DEV).bfloat16().requires_grad_()).sum().backward()
    assert cute_kernel_builds() == before
