"""The weight-gradient MX GEMM (`gem_lp.linear.kernels.cute_gemm.mx_weight_grad_sm90`) on the GPU: dW = dY_c^T deq(X_c)
from X's colwise MX cast (what a layer's forward saves) and dY's colwise MX-exact BF16 operand, against an FP64
oracle per element within
    |dW - dW_ref| <= 2^-8 |dW_ref| (BF16 dW; 2^-23 for FP32) + M 2^-23 (|deq X_c| |dY_c|)
(FP32 accumulation over the M tokens, the output rounding), at odd token counts, and bit-identical from run to run
(the split-K partials commit in split order); with the payload's padding bytes poisoned (NaN encodings) before the
call, which must not reach dW; replayed from a CUDA graph with the eager bits. Also the layers' backward with and
without the kernel (`linear_weight_grad` in the plan): the same dW within FP32 summation order, every other gradient
bit-identical.
"""
import pytest
import torch

from gem_lp.mx.layout import from_blocked
from gem_lp.mx.reference import scale_f32

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu(9)

from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90  # noqa: E402
from gem_lp.linear.selfchecks import weight_grad_operands  # noqa: E402
from gem_lp.runtime import dispatch  # noqa: E402

DEV = torch.device("cuda")
MS = (1, 31, 33, 127, 128, 129, 1000, 4097, 32767, 273044)
SHAPES = ((256, 768), (1024, 256), (256, 256), (96, 32))  # (K, N): the trainer's linears, and a thin odd one


def oracle(data, scale, dy_col_t):
    K, M = data.shape
    blocks = -(-M // 32)
    factor = scale_f32(from_blocked(scale.view(torch.uint8), K, blocks)).double().repeat_interleave(32, dim=1)[:, :M]
    deq = data.float().double() * factor  # [K, M]: blocks of 32 tokens, the last one partial
    dyc = dy_col_t[:, :M].double()
    return dyc @ deq.t(), dyc.abs() @ deq.abs().t()


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", MS)
def test_against_the_fp64_oracle(M, K, N):
    if M == 273044 and (K, N) != (1024, 256):
        pytest.skip("the trainer's token count at its 1024 -> 256 layer only")
    data, scale, dy_col_t = weight_grad_operands(M, K, N, DEV, seed=M + K)
    stride = data.stride(0)
    pad = data.as_strided((K, stride - M), (stride, 1), data.storage_offset() + M)
    pad.view(torch.uint8).fill_(0x7F)  # NaN payloads where no data is: read, they would poison dW
    ref, absprod = oracle(data, scale, dy_col_t)
    for dtype, rel in ((torch.float32, 2.0 ** -23), (torch.bfloat16, 2.0 ** -8)):
        dw = mx_weight_grad_sm90(data, scale, dy_col_t, dtype)
        assert dw.shape == (N, K) and dw.dtype == dtype and dw.is_contiguous()
        assert torch.isfinite(dw).all()
        err = (dw.double() - ref).abs()
        bound = rel * ref.abs() + M * 2.0 ** -23 * absprod + 1e-30
        assert (err <= bound).all(), f"max err {err.max().item():.3e}, max ratio {(err / bound).max().item():.3f}"
        again = mx_weight_grad_sm90(data, scale, dy_col_t, dtype)
        assert torch.equal(dw, again), "two runs differ"


@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_every_split_gives_the_oracle(split_k):
    data, scale, dy_col_t = weight_grad_operands(20011, 1024, 256, DEV, seed=split_k)
    ref, absprod = oracle(data, scale, dy_col_t)
    dw = mx_weight_grad_sm90(data, scale, dy_col_t, torch.float32, split_k=split_k)
    assert ((dw.double() - ref).abs() <= 2.0 ** -23 * ref.abs() + 20011 * 2.0 ** -23 * absprod).all()


@pytest.mark.parametrize("layer", ["linear", "norm linear", "mlp"])
@pytest.mark.parametrize("M", [1000, 4097])
def test_layers_backward_with_and_without_the_kernel(layer, M, monkeypatch):
    from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction, RMSNormMXMLPFunction

    K, N, H = 256, 256, 512  # dW's N within the table's N tiles: the kernel runs in every layer
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
    gw = (torch.rand(K, generator=g) + 0.5).to(DEV)
    w, b = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV), torch.randn(N, generator=g).to(DEV)
    wu, bu = (torch.randn(H, K, generator=g) / K ** 0.5).to(DEV), torch.randn(H, generator=g).to(DEV)
    wd, bd = (torch.randn(N, H, generator=g) / H ** 0.5).to(DEV), torch.randn(N, generator=g).to(DEV)
    dy = torch.randn(M, N, generator=g).to(DEV, torch.bfloat16)
    call, ins = {
        "linear": (lambda *a: MXLinearFunction.apply(*a, "rceil", "cublas", None), (x, w, b)),
        "norm linear": (lambda *a: RMSNormMXLinearFunction.apply(*a, 1e-6, "rceil", "cublas"), (x, gw, w, b)),
        "mlp": (lambda *a: RMSNormMXMLPFunction.apply(*a, 1e-6, "rceil", "cublas", "silu"), (x, gw, wu, bu, wd, bd)),
    }[layer]

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        return torch.autograd.grad(call(*leaves), leaves, dy)

    key = ("linear_weight_grad", "mxfp8", x.device, "auto")  # the device the layers ask with (cuda:<index>)
    assert dispatch.choose("linear_weight_grad", "mxfp8", x.device, "cute") == "cute"
    calls = []
    from gem_lp.linear.kernels import cute_gemm
    real = cute_gemm.mx_weight_grad_sm90
    monkeypatch.setattr(cute_gemm, "mx_weight_grad_sm90", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setitem(dispatch._CHOSEN, key, dispatch.Choice("linear_weight_grad", "mxfp8", "sm_90", "cute"))
    with_kernel = grads()
    assert calls, "the kernel did not run"
    monkeypatch.setitem(dispatch._CHOSEN, key, dispatch.Choice("linear_weight_grad", "mxfp8", "sm_90", "reference"))
    n = len(calls)
    without = grads()
    assert len(calls) == n
    weights = {id(t) for t in (w, wu, wd)}
    for t, a, c in zip(ins, with_kernel, without):
        if id(t) in weights:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5 * c.abs().max().item())
        elif t.dim() == 1 and t is not gw:  # bias gradients: column sums by atomics, in any order
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6 * c.abs().max().item())
        else:
            assert torch.equal(a, c)


def test_a_cuda_graph_replays_the_eager_bits():
    """Captured as the trainer's sequence graphs capture it (after an eager warm-up on a side stream): the split-K
    semaphore and workspace, the padding's zero fill and the launch replay with the eager call's bits."""
    from gem_lp.linear.selfchecks import _captured_as_eager

    assert _captured_as_eager(DEV)
