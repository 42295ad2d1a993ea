"""`mx_activation`: the plain activation forward; the backward multiplies by the MX-rounded derivative, kept as MX."""
import pytest
import torch

from gem_lp.mx import dequantize, quantize
from gem_lp.norm_gemm.activation import ACTIVATIONS, mx_activation

BACKENDS = ["reference", "triton"]
SHAPES = [((33, 96), torch.bfloat16), ((1, 32), torch.float32), ((0, 64), torch.bfloat16), ((3, 31, 64), torch.bfloat16),
          ((129, 128), torch.float16)]


def _x(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if x.numel():
        x.view(-1)[:: 7] *= 40  # blocks with a large element: their small ones round coarsely
    return x.to(dtype).to(device)


def _expected_grad(x, dy, name):
    """dy times the derivative at x (autograd's, in x's dtype), rounded by the reference quantization."""
    xr = x.detach().cpu().requires_grad_()
    (slope,) = torch.autograd.grad(ACTIVATIONS[name](xr), xr, torch.ones_like(xr))
    rows = slope.reshape(-1, x.shape[-1])
    return dy.cpu() * dequantize(quantize(rows, axis=-1, backend="reference")).to(x.dtype).view(x.shape)


def _check(backend, name, shape, dtype, device):
    x = _x(shape, dtype, seed=len(shape) * 100 + shape[-1], device=device).requires_grad_()
    y = mx_activation(x, name, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, ACTIVATIONS[name](x.detach()))
    dy = _x(shape, dtype, seed=7, device=device)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype
    # the same function of the same rounded values: equal on the CPU; on the GPU up to its elementwise math (an ulp)
    rtol = 0 if device == "cpu" else (1e-6 if dtype == torch.float32 else 2 ** -7)
    torch.testing.assert_close(dx.cpu(), _expected_grad(x, dy, name), rtol=rtol, atol=rtol * 1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_forward_is_the_function_and_gradient_takes_the_rounded_derivative(backend, name, shape, dtype):
    _check(backend, name, shape, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("shape,dtype", SHAPES + [((32767, 1024), torch.bfloat16)])
def test_gpu_forward_and_gradient(name, shape, dtype):
    _check("auto", name, shape, dtype, "cuda")


def test_the_gradient_differs_from_the_unrounded_one_by_the_rounding():
    """The test above could not tell the recipe from the plain function if rounding never moved the gradient; the
    rounding error of a bounded derivative stays within a 1/16 of its block's largest value."""
    x = _x((64, 64), torch.float32, seed=3).requires_grad_()
    dy = torch.ones_like(x)
    (dx,) = torch.autograd.grad(mx_activation(x, "silu", backend="reference"), x, dy)
    (plain,) = torch.autograd.grad(ACTIVATIONS["silu"](x), x, dy)
    assert not torch.equal(dx, plain)
    assert (dx - plain).abs().max() <= 1.1 / 16


def test_what_autograd_keeps_is_mx():
    x = _x((64, 256), torch.bfloat16, seed=4).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mx_activation(x, "gelu", backend="reference")
    assert {t.dtype for t in saved} == {torch.float8_e4m3fn, torch.uint8} and len(saved) == 2
    assert sum(t.numel() * t.element_size() for t in saved) == 64 * 256 + 64 * 256 // 32


def test_no_grad_calls_keep_nothing():
    x = _x((4, 32), torch.bfloat16, seed=5)
    assert torch.equal(mx_activation(x, "relu"), torch.relu(x))


def test_errors():
    x = _x((4, 48), torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        mx_activation(x, "silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        mx_activation(x[:, :32], "tanh")
    with pytest.raises(TypeError, match="x must be a float32"):
        mx_activation(x.to(torch.int32), "silu")
