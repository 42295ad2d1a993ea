"""RMSNorm's backward in Triton (`gem_lp.norm.kernels.triton_backward`, the MX norm linears' norm backward where the
dispatch table gives it) against autograd of the FP32 reference, and the dispatch of
`gem_lp.norm.kernels.rms_norm_backward` by implementation.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py) on tiny shapes; on a CUDA machine the compiled
kernel, and the `gpu` test adds a large shape.
"""
import functools

import pytest
import torch

import norm_inputs

from gem_lp.mx.reference import rms_norm_fp32
from gem_lp.norm.kernels import rms_norm_backward as rms_norm_backward_by_impl
from gem_lp.norm.kernels.triton_backward import rms_norm_backward
from gem_lp.norm.reference import rms_norm_backward_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
generic_input = functools.partial(norm_inputs.generic_input, device=DEVICE)
norm_weight = functools.partial(norm_inputs.norm_weight, device=DEVICE)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def reference_backward(x, w, eps, dy):
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y, rstd = rms_norm_fp32(xr, wr, eps)
    y.backward(dy.float())
    return xr.grad, wr.grad, rstd.detach()


def assert_close_to_reference(dx, dw, dx_ref, dw_ref, x, dy, rstd, dtype):
    K = x.shape[1]
    assert dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == (K,)
    # FP32 math in another order: a few FP32 ulps of the terms, then the rounding to x's dtype
    tol = 8 * K * torch.finfo(torch.float32).eps
    scale = dx_ref.abs().amax(dim=1, keepdim=True)
    assert bool(((dx.float() - dx_ref).abs() <= tol * scale + torch.finfo(dtype).eps * dx_ref.abs()).all())
    dw_scale = (dy.float() * x.float() * rstd[:, None]).abs().sum(0)
    assert bool(((dw - dw_ref).abs() <= tol * dw_scale + 1e-30).all())


@pytest.mark.parametrize("M,K,dtype,cfg", [
    (1, 32, torch.float32, dict()), (31, 96, torch.bfloat16, dict()), (33, 64, torch.float32, dict(block_k=32)),
    (100, 96, torch.float16, dict(block_k=32, block_m=8)), (129, 32, torch.bfloat16, dict(block_m=32)),
])
def test_backward_matches_reference(M, K, dtype, cfg):
    x, w = generic_input(M, K, dtype, M + K), norm_weight(K, dtype, M)
    dy = torch.randn(M, K, generator=_gen(M * K)).to(DEVICE)
    dx_ref, dw_ref, rstd = reference_backward(x, w, 1e-6, dy)
    dx, dw = rms_norm_backward(x, w, rstd, dy, **cfg)
    assert_close_to_reference(dx, dw, dx_ref, dw_ref, x, dy, rstd, dtype)


def test_backward_empty():
    w = norm_weight(32, torch.float32, 0)
    dx, dw = rms_norm_backward(torch.empty(0, 32, device=DEVICE), w, torch.empty(0, device=DEVICE),
                               torch.empty(0, 32, device=DEVICE))
    assert dx.shape == (0, 32) and torch.equal(dw, torch.zeros(32, device=DEVICE))


def test_each_implementation_of_the_table_gives_the_reference_gradients():
    """`rms_norm_backward(..., impl)`: "triton" the kernel (CPU tensors: in the interpreter), "reference" the FP32
    formula (`rms_norm_backward_reference`), "cute" the CuTe kernel on CUDA tensors (on the CPU the Triton kernel);
    each within FP32 rounding of autograd's."""
    M, K, dtype = 33, 96, torch.bfloat16
    x, w = generic_input(M, K, dtype, 5), norm_weight(K, torch.float32, 5)
    dy = torch.randn(M, K, generator=_gen(6)).to(dtype).to(DEVICE)
    dx_ref, dw_ref, rstd = reference_backward(x, w, 1e-6, dy)
    for impl in ("triton", "reference") + (() if DEVICE.type == "cuda" else ("cute",)):
        dx, dw = rms_norm_backward_by_impl(x, w, rstd, dy, impl)
        assert_close_to_reference(dx, dw, dx_ref, dw_ref, x, dy, rstd, dtype)
    dx, dw = rms_norm_backward_reference(x, w, rstd, dy)
    t_dx, t_dw = rms_norm_backward(x, w, rstd, dy)
    assert torch.equal(dx, rms_norm_backward_by_impl(x, w, rstd, dy, "reference")[0])
    torch.testing.assert_close(t_dw, dw, rtol=1e-5, atol=1e-6 * float(dw.abs().max()))


def test_errors():
    x, w = torch.randn(8, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"rstd must be a contiguous float32 \[M=8\]"):
        rms_norm_backward(x, w, torch.ones(8, dtype=torch.float64, device=DEVICE), x)
    with pytest.raises(ValueError, match=r"dy must be \[M=8, K=64\]"):
        rms_norm_backward(x, w, torch.ones(8, device=DEVICE), x[:4])
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[K=64\] tensor"):
        rms_norm_backward(x, w[:32], torch.ones(8, device=DEVICE), x)
    with pytest.raises(ValueError, match="block_m must be a power of two, got 3"):
        rms_norm_backward(x, w, torch.ones(8, device=DEVICE), x, block_m=3)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        rms_norm_backward(torch.randn(4, 32), torch.randn(32), torch.ones(4), torch.randn(4, 32))


@pytest.mark.gpu
def test_gpu_backward_large():
    M, K = 8192, 4096
    x, w = generic_input(M, K, torch.bfloat16, 2), norm_weight(K, torch.bfloat16, 2)
    dy = torch.randn(M, K, device="cuda")
    dx_ref, dw_ref, rstd = reference_backward(x, w, 1e-6, dy)
    dx, dw = rms_norm_backward(x, w, rstd, dy)
    torch.testing.assert_close(dx.float(), dx_ref, rtol=1e-2, atol=1e-2 * dx_ref.abs().max().item())
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-4 * dw_ref.abs().max().item())
