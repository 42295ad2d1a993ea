"""The colwise payload of `rms_norm_mx` (`y^T [K, M]`) as a view with rows a multiple of 32 bytes apart.

Whatever M is, the payload is the `[:, :M]` view of a `[K, M rounded up to 32]` buffer, so that the kernel's
colwise stores stay vectors (see `triton_norm.colwise_payload_buffer`). Checked here: the bytes and scales
equal the reference for odd and unaligned M under several launches, the view's layout, that the kernel
writes nothing outside the buffer's rows, and that every consumer (the dequantize pass, the dW GEMM of each route:
the cuBLAS route's on the dequantized operands, the block-scaled `scaled_mm` on the payloads, the MXLinear backward,
the public `rms_norm_quantize`) reads the view as its values.
"""
import pytest
import torch
from byte_checks import assert_same_bytes, u8

from gem_lp.linear import gemm as lg
from gem_lp.linear import operands as lo
from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction
from gem_lp.linear.reference import MXLinearReference, RMSNormMXLinearReference
from gem_lp.mx import MXTensor, dequantize, quantize_reference, to_blocked
from gem_lp.mx.kernels import triton_cast as triton_norm
from gem_lp.mx.formats import COLWISE_ROW_ALIGN, COLWISE_ROW_PAD
from gem_lp.mx.kernels.triton_cast import (NormConfig, colwise_payload_buffer, colwise_row_stride,
                                           forward_launch, rms_norm_mx)
from gem_lp.mx.kernels.triton_dequantize import mx_dequantize_operand
from gem_lp.norm import rms_norm_quantize
from gem_lp.norm.reference import rms_norm_quantize_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# scaled_mm needs block-scaled MMA (sm_100): on Hopper cuBLAS refuses it; on the CPU it is emulated
BLOCK_SCALED = not ON_GPU or torch.cuda.get_device_capability()[0] == 10
ROUTES = lg.ROUTES if BLOCK_SCALED else ("cublas",)
MS = (1, 31, 33, 100, 129)
GARBAGE_BYTE = 0xA5
# The default launch, 1-row strips (byte-wise colwise stores), 16-row strips (paired stores, 64-row blocks), the
# persistent walk.
CONFIGS = (None, NormConfig(32, 64, 1, 1), NormConfig(64, 32, 1, 16), NormConfig(32, 32, 1, 4, False, 1))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_padded_view(data, K, M):
    """`data` is the `[K, M]` view of a buffer with rows a multiple of 32 bytes apart (contiguous when M is)."""
    assert data.shape == (K, M) and data.dtype == torch.float8_e4m3fn
    assert data.stride(0) % COLWISE_ROW_ALIGN == 0 and data.stride(0) == colwise_row_stride(M), data.stride()
    assert data.stride(1) == 1 or M <= 1, data.stride()
    assert data.stride(0) - M < COLWISE_ROW_PAD
    assert data.is_contiguous() == (M % COLWISE_ROW_PAD == 0 or K == 1)


@pytest.fixture(autouse=True)
def garbage_output_buffers(monkeypatch):
    """Output buffers start full of 0xA5 bytes, so that a byte the kernel should write and does not shows."""
    def garbage(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.view(torch.uint8).fill_(GARBAGE_BYTE)
        return t

    monkeypatch.setattr(triton_norm, "_new_buffer", garbage)


def test_row_stride_rounds_up_to_32():
    assert [colwise_row_stride(m) for m in (0, 1, 15, 16, 17, 32, 33, 32766, 32767, 32768, 300001)] == [
        32, 32, 32, 32, 32, 32, 64, 32768, 32768, 32768, 300032]
    buf = colwise_payload_buffer(3, 33, torch.device("cpu"))
    assert buf.shape == (3, 33) and buf.stride() == (64, 1) and buf.untyped_storage().nbytes() == 3 * 64


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_colwise_bytes_equal_reference_for_every_m(M, config):
    K = 64
    g = _gen(M)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-4, 5, (M, 1), generator=g).float())).to(
        torch.bfloat16).to(DEVICE)
    w = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    kw = {} if config is None else dict(zip(triton_norm.CONFIG_FIELDS, config))
    blocked = M % 2 == 1
    out = rms_norm_mx(x, w, 1e-6, blocked_scales=blocked, **kw)
    assert_padded_view(out.colwise.data, K, M)
    y = x.cpu().float() * out.rstd.cpu()[:, None] * w.cpu().float()  # the reference's y with the kernel's rstd
    col = quantize_reference(y.t(), axis=1, allow_partial=True)
    row = quantize_reference(y, axis=1)
    assert_same_bytes(out.colwise.data, col.data, f"col payload M={M}")
    assert_same_bytes(out.colwise.scale, to_blocked(col.scale) if blocked else col.scale, f"col scale M={M}")
    assert_same_bytes(out.rowwise.data, row.data, f"row payload M={M}")


@pytest.mark.parametrize("M", (31, 100))
def test_dual_cast_without_norm_pads_the_colwise_rows(M):
    """The producer pass of the MX GEMMs (weight None), also by tile programs."""
    K = 96
    x = torch.randn(M, K, generator=_gen(M + 1)).to(DEVICE)
    want = quantize_reference(x.cpu().t(), axis=1, allow_partial=True)
    for kw in ({}, dict(block_m=32, block_k=32, num_warps=1, thread_rows=4, tile_programs=True)):
        out = rms_norm_mx(x, None, **kw)
        assert_padded_view(out.colwise.data, K, M)
        assert_same_bytes(out.colwise.data, want.data, f"col payload {kw}")
        assert_same_bytes(out.colwise.scale, to_blocked(want.scale), f"col scale {kw}")


def test_kernel_writes_only_inside_the_rows():
    """A payload view into a bigger buffer (rows 64 bytes apart, a guard row below): the kernel may write the
    padding columns of its K rows and nothing else; the view's bytes equal the reference."""
    M, K = 33, 64
    x = torch.randn(M, K, generator=_gen(5)).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(K, generator=_gen(6)) + 0.5).to(DEVICE)
    buf = torch.full((K + 1, 64), GARBAGE_BYTE, dtype=torch.uint8, device=DEVICE)
    data = buf.view(torch.float8_e4m3fn)[:K, :M]
    scale = torch.empty(K * 2, dtype=torch.uint8, device=DEVICE)  # plain [K, ceil(M/32)]
    rstd = torch.empty(M, dtype=torch.float32, device=DEVICE)
    config = triton_norm.default_config(K, False, hw_cast=False)
    kernel, grid, args, kwargs = forward_launch(x, w, 1e-6, rstd, None, (data, scale), None, None,
                                                blocked_scales=False, rceil=True, hw_cast=False, config=config)
    kernel[grid](*args, **kwargs)
    assert bool((buf[K] == GARBAGE_BYTE).all()), "the guard row below the payload was written"
    y = x.cpu().float() * rstd.cpu()[:, None] * w.cpu().float()
    want = quantize_reference(y.t(), axis=1, allow_partial=True)
    assert_same_bytes(data, want.data, "col payload in a 64-byte-row buffer")
    assert_same_bytes(scale.view(K, 2), want.scale, "col scale")


def test_launch_rejects_an_unaligned_payload():
    M, K = 33, 32
    x = torch.randn(M, K).to(DEVICE)
    scale = torch.empty(K * 2, dtype=torch.uint8, device=DEVICE)
    config = triton_norm.default_config(K, False, hw_cast=False)
    bad = (torch.empty(K, M, dtype=torch.float8_e4m3fn, device=DEVICE),  # contiguous: rows 33 bytes apart
           torch.empty(M, K, dtype=torch.float8_e4m3fn, device=DEVICE).t())  # transposed: last dim strided
    for data in bad:
        with pytest.raises(ValueError, match="row stride that is a multiple of 16"):
            forward_launch(x, None, 1e-6, None, None, (data, scale), None, None, blocked_scales=False, rceil=True,
                           hw_cast=False, config=config)


@pytest.mark.parametrize("M", (31, 100))
def test_public_rms_norm_quantize_values(M):
    """`rms_norm_quantize` (Triton backend) against the reference as values; its colwise payload is the view."""
    K = 64
    g = _gen(M + 2)
    x = (torch.randint(-15, 16, (M, K), generator=g).float() * 0.25).to(DEVICE)  # exact sums: rstd equal
    w = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    got = rms_norm_quantize(x, w, 1e-6, backend="triton")
    ref = rms_norm_quantize_reference(x.cpu(), w.cpu(), 1e-6, "rceil")
    assert_padded_view(got.colwise.data, K, M)
    assert torch.equal(got.rstd.cpu(), ref.rstd)
    for a, b in ((got.rowwise, ref.rowwise), (got.colwise, ref.colwise)):
        assert torch.equal(u8(a.data).cpu(), u8(b.data)) and torch.equal(a.scale.cpu(), b.scale)
        torch.testing.assert_close(dequantize(a).cpu(), dequantize(b), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("M", (31, 100))
def test_dequantize_and_dw_gemms_read_the_padded_view(M):
    """The dequantize pass and the dW GEMM of each route (contracting over M) take the padded payload: the cuBLAS
    route's on the dequantized operands (`saved_col_operand`), scaled_mm's on the payloads themselves."""
    K, N = 64, 32
    x = torch.randn(M, K, generator=_gen(M + 3)).to(DEVICE)
    dy = torch.randn(M, N, generator=_gen(M + 4)).to(DEVICE)
    x_col = rms_norm_mx(x, None, rowwise=False).colwise  # X^T [K, M], padded rows, blocked scales
    dy_col = rms_norm_mx(dy, None, rowwise=False).colwise  # dY^T [N, M]
    assert_padded_view(x_col.data, K, M)
    want = dequantize(MXTensor(x_col.data.cpu().contiguous(), x_col.scale.cpu(), "1d", 1, "rceil", torch.float32,
                               "blocked"))
    torch.testing.assert_close(mx_dequantize_operand(x_col, torch.float32).cpu(), want, rtol=0, atol=0)
    dw_ref = dequantize(MXTensor(dy_col.data.cpu().contiguous(), dy_col.scale.cpu(), "1d", 1, "rceil",
                                 torch.float32, "blocked")) @ want.t()
    for route in ROUTES:
        a, b = (lo.saved_col_operand(t.data, t.scale, "rceil", route, torch.float32) for t in (dy_col, x_col))
        dw = lg.gemm_nt(a, b, route, torch.float32)
        torch.testing.assert_close(dw.cpu(), dw_ref, rtol=1e-5, atol=1e-5 * dw_ref.abs().max().item(),
                                   msg=lambda m: f"{route}: {m}")
    with pytest.raises(ValueError, match="contiguous last dim"):
        mx_dequantize_operand(MXTensor(x_col.data.t().contiguous().t(), x_col.scale, "1d", 1, "rceil",
                                       torch.float32, "blocked"))


def _exact(rows, cols, seed, dtype):
    """Integers in [-8, 8] times 2^-2..2^2: every MX cast and GEMM sum is exact (bit-equal results)."""
    g = _gen(seed)
    v = torch.randint(-8, 9, (rows, cols), generator=g).float() * torch.exp2(
        torch.randint(-2, 3, (rows, cols), generator=g).float())
    return v.to(dtype).to(DEVICE)


def _run(fn, args, dy):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("M", (31, 100))
def test_mx_linear_gradients_equal_reference(route, M):
    """MXLinear's backward reads the saved padded colwise payload (dW) and dY's (MX route): gradients equal
    the reference backward bit for bit on exact inputs."""
    K, N = 64, 32
    x, w, dy = _exact(M, K, M, torch.float32), _exact(N, K, N, torch.float32), _exact(M, N, M + N, torch.float32)
    y, grads = _run(lambda a, b: MXLinearFunction.apply(a, b, None, "rceil", route, None), (x, w), dy)
    y_ref, grads_ref = _run(lambda a, b: MXLinearReference.apply(a, b, None, "rceil"), (x, w), dy)
    for got, want, what in zip([y] + grads, [y_ref] + grads_ref, ("Y", "dX", "dW")):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{route} {what} M={M}")
    saved = []  # what the forward saves, seen as autograd packs it
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        MXLinearFunction.apply(x.clone().requires_grad_(), w.clone().requires_grad_(), None, "rceil", route, None)
    assert_padded_view(saved[0], K, M)


@pytest.mark.parametrize("route", ROUTES)
def test_rms_norm_mx_linear_gradients_match_reference(route):
    M, K, N = 31, 64, 32
    g = _gen(12)
    x = (torch.randn(M, K, generator=g) * 3).to(DEVICE)
    gw = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE)
    dy = torch.randn(M, N, generator=g).to(DEVICE)
    y, grads = _run(lambda *a: RMSNormMXLinearFunction.apply(*a, None, 1e-6, "rceil", route), (x, gw, w), dy)
    y_ref, grads_ref = _run(lambda *a: RMSNormMXLinearReference.apply(*a, None, 1e-6, "rceil"), (x, gw, w), dy)
    rel = 1e-5  # FP32 sums in another order
    for got, want, what in zip([y] + grads, [y_ref] + grads_ref, ("Y", "dX", "dnorm_weight", "dW")):
        scale = want.abs().max().item() or 1.0
        assert (got - want).abs().max().item() <= max(1e-4, 4 * rel) * scale, what


@pytest.mark.gpu
@pytest.mark.parametrize("M", (32766, 32767, 4097))
@pytest.mark.parametrize("K", (1024, 4096))
def test_gpu_default_launch_at_unaligned_token_counts(M, K):
    """The compiled default launch (and the measured one) at token counts of a jagged batch: padded colwise
    rows, bytes equal to the reference quantization of y computed with the kernel's rstd."""
    x = torch.randn(M, K, generator=_gen(M + K)).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(K, generator=_gen(K)) + 0.5).to(DEVICE)
    for kw in ({}, dict(zip(triton_norm.CONFIG_FIELDS, triton_norm.MEASURED_CONFIG))):
        out = rms_norm_mx(x, w, 1e-6, **kw)
        assert_padded_view(out.colwise.data, K, M)
        y = x.float() * out.rstd[:, None] * w.float()
        col = quantize_reference(y.t(), axis=1, allow_partial=True)
        row = quantize_reference(y, axis=1)
        assert_same_bytes(out.colwise.data, col.data, f"col payload {kw}")
        assert_same_bytes(out.colwise.scale, to_blocked(col.scale), f"col scale {kw}")
        assert_same_bytes(out.rowwise.data, row.data, f"row payload {kw}")
        assert_same_bytes(out.rowwise.scale, to_blocked(row.scale), f"row scale {kw}")
