"""RMSNorm ops on the CPU (`gem_lp.norm`): `rms_norm` in both precisions, the `RMSNorm` module, `rms_norm_quantize`
on each backend, the reference backward, against explicit computations and torch."""
import pytest
import torch
import torch.nn.functional as F

from gem_lp.mx import quantize_reference, to_blocked
from gem_lp.norm import RMSNorm, rms_norm, rms_norm_quantize, rms_norm_quantize_reference
from gem_lp.norm.reference import rms_norm_backward_reference

M, K = 100, 256  # M = 100 ends the colwise (along M) blocks in a partial block of 4


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_quantize_is_bit_exact_quantization_of_fp32_output(dtype):
    x = (torch.randn(M, K) * 3).to(dtype)
    w = (torch.rand(K) + 0.5).to(dtype)
    got = rms_norm_quantize(x, w, 1e-5)
    x32 = x.float()
    rstd = torch.rsqrt(x32.square().mean(-1) + 1e-5)
    y = x32 * rstd[:, None] * w.float()
    row = quantize_reference(y, axis=1)
    col = quantize_reference(y.t(), axis=1, allow_partial=True)
    assert torch.equal(got.rstd, rstd) and got.rstd.dtype == torch.float32
    assert got.rowwise.data.shape == (M, K) and got.rowwise.scale.shape == (M, K // 32)
    assert got.colwise.data.shape == (K, M) and got.colwise.scale.shape == (K, 4)
    assert torch.equal(_u8(got.rowwise.data), _u8(row.data)) and torch.equal(got.rowwise.scale, row.scale)
    assert torch.equal(_u8(got.colwise.data), _u8(col.data)) and torch.equal(got.colwise.scale, col.scale)


def test_rms_norm_quantize_flattens_leading_dims_and_floor_scaling():
    x, w = torch.randn(4, 25, 64), torch.randn(64)
    a = rms_norm_quantize(x, w, scaling="floor")
    b = rms_norm_quantize(x.reshape(100, 64), w, scaling="floor")
    assert a.rowwise.data.shape == (100, 64) and a.rowwise.scaling == "floor"
    assert torch.equal(_u8(a.colwise.data), _u8(b.colwise.data)) and torch.equal(a.colwise.scale, b.colwise.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch_and_differentiates(dtype):
    x = torch.randn(3, 5, 96, dtype=dtype, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == dtype
    want = F.rms_norm(x.detach().float(), (96,), w.detach(), 1e-6).to(dtype)
    torch.testing.assert_close(y, want)
    y.float().sum().backward()
    assert x.grad.dtype == dtype and w.grad.shape == (96,)
    module = RMSNorm(96)
    assert torch.equal(module(x.detach()), rms_norm(x.detach(), module.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_precision_is_torchs_rms_norm(dtype):
    """`precision="bf16"` (the BF16 recipe's norm): torch's `F.rms_norm` on x's dtype, on every backend the CPU has
    (auto and reference; the CuTe kernels need a GPU), gradients included; the module's `recipe="bf16"` too."""
    x = (torch.randn(3, 5, 96) * 3).to(dtype).requires_grad_()
    w = (torch.rand(96) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 96).to(dtype)
    want = F.rms_norm(x, (96,), w, 1e-6)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    for backend in ("auto", "reference"):
        y = rms_norm(x, w, 1e-6, precision="bf16", backend=backend)
        assert y.dtype == dtype and torch.equal(y, want), backend
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y, (x, w), dy), want_grads)), backend
    module = RMSNorm(96, recipe="bf16")
    with torch.no_grad():
        module.weight.copy_(w)
    assert torch.equal(module(x.detach().float()), F.rms_norm(x.detach().float(), (96,), module.weight, 1e-6))
    assert "recipe='bf16'" in repr(module) and "recipe" not in repr(RMSNorm(96))


def test_fp32_precision_rounds_once_from_fp32_math():
    """`precision="fp32"` (the default): `fp32(x) * rstd * fp32(w)` rounded once to x's dtype."""
    x, w = torch.randn(7, 64).bfloat16(), torch.randn(64).bfloat16()
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-5) * w.float()).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5), want) and torch.equal(rms_norm(x, w, 1e-5, precision="fp32"), want)


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
@pytest.mark.parametrize("scale_layout", ["plain", "blocked"])
def test_rms_norm_quantize_backends_give_the_references_values(backend, scale_layout):
    """Exact sums of squares (integers times a quarter): every backend's rstd, scales (in the layout asked for) and
    payload bytes equal the reference; the kernels' colwise payload is a padded view, compared as values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-15, 16, (33, 64), generator=g).float() * 0.25
    w = torch.rand(64, generator=g) + 0.5
    got = rms_norm_quantize(x, w, 1e-6, scale_layout=scale_layout, backend=backend)
    ref = rms_norm_quantize_reference(x, w, 1e-6, "rceil")
    assert torch.equal(got.rstd, ref.rstd)
    for a, b in ((got.rowwise, ref.rowwise), (got.colwise, ref.colwise)):
        assert a.scale_layout == scale_layout and b.scale_layout == "plain"
        assert torch.equal(_u8(a.data), _u8(b.data))
        assert torch.equal(a.scale, to_blocked(b.scale) if scale_layout == "blocked" else b.scale)
        assert torch.equal(a.plain_scale(), b.scale)


def test_rms_norm_quantize_names_a_bad_scale_layout():
    with pytest.raises(ValueError, match=r"scale_layout must be one of \('plain', 'blocked'\), got 'tiled'"):
        rms_norm_quantize(torch.ones(4, 32), torch.ones(32), scale_layout="tiled")


def test_reference_backward_is_autograds():
    x = (torch.randn(33, 64) * 2).bfloat16()
    w = torch.rand(64) + 0.5
    dy = torch.randn(33, 64)
    xx, ww = x.float().requires_grad_(), w.clone().requires_grad_()
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    y = xx * torch.rsqrt(xx.square().mean(-1, keepdim=True) + 1e-6) * ww
    dx_want, dw_want = torch.autograd.grad(y, (xx, ww), dy)
    dx, dw = rms_norm_backward_reference(x, w, rstd, dy)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    torch.testing.assert_close(dx.float(), dx_want.bfloat16().float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(dw, dw_want, rtol=1e-4, atol=1e-5)


def test_errors():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="precision must be one of"):
        rms_norm(x, torch.ones(64), precision="fp16")
    with pytest.raises(ValueError, match="recipe must be one of"):
        RMSNorm(64, recipe="mxfp8")
    with pytest.raises(ValueError, match="dim must be positive"):
        RMSNorm(0)
    with pytest.raises(ValueError, match=r"weight must be \[K=64\]"):
        rms_norm(x, torch.ones(32), precision="bf16")
    with pytest.raises(ValueError, match="backend='cute' cannot run rms_norm"):
        rms_norm(x, torch.ones(64), precision="bf16", backend="cute")
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_quantize(torch.randn(8, 40), torch.randn(40), backend="triton")
