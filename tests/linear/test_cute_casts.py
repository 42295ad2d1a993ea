"""The MX linears' casts on the CuTe cast kernel (forced for every cast, or for none, through the per-arch table
`cute_cast_config.LINEAR_CASTS_FROM_K`): every cast the layers make gives the bytes of `rms_norm_mx`'s, and a layer's
forward and backward give the same tensors either way (sm_90 / sm_100 with the CuTe DSL stack only)."""
import pytest
import torch
from byte_checks import assert_same_bytes

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu()

from gem_lp.accuracy import sqnr_db  # noqa: E402
from gem_lp.linear import gemm as lg  # noqa: E402
from gem_lp.linear import operands as lo  # noqa: E402
from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction  # noqa: E402
from gem_lp.mx.kernels import cute_cast_config  # noqa: E402
from gem_lp.runtime import dispatch  # noqa: E402
from gem_lp.runtime.device import build_arch  # noqa: E402

DEV = "cuda"


@pytest.fixture
def cute_casts(monkeypatch):
    """`use(on)`: the table sends every cast the CuTe kernel can take to it (K from 0, with and without the norm), or
    none. The dispatch table must give the CuTe RMSNorm + MX cast on this GPU."""
    assert dispatch.choose("rms_norm_quantize", "mxfp8", torch.device(DEV)) == "cute"
    arch = build_arch(torch.device(DEV))

    def use(on: bool):
        monkeypatch.setattr(cute_cast_config, "LINEAR_CASTS_FROM_K", {arch: (0, 0) if on else (None, None)})
    return use


CALLS = {  # what each call site of the MX linears asks for (cuBLAS route)
    "forward operand": dict(norm=True, rowwise=False, colwise=True, row_operand=True, padded=True),
    "forward operand, no norm": dict(norm=False, rowwise=False, colwise=True, row_operand=True, padded=True),
    "weight operands": dict(norm=False, rowwise=False, colwise=False, row_operand=True, col_operand=True),
    "dY operands": dict(norm=False, rowwise=False, colwise=False, row_operand=True, col_operand=True, padded=True,
                        column_sums=True),
    "MX casts": dict(norm=False, rowwise=True, colwise=True),
    "SiLU row operand": dict(norm=False, rowwise=False, colwise=False, row_operand=True, padded=True,
                             activation="silu"),
    "SiLU col operand": dict(norm=False, rowwise=False, colwise=False, col_operand=True, padded=True,
                             activation="silu"),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("M,K", [(1, 256), (33, 1024), (129, 768), (32767, 1024), (4097, 4096)])
def test_each_cast_writes_the_triton_bytes(cute_casts, call, M, K):
    opts = dict(CALLS[call])
    norm, padded = opts.pop("norm"), opts.pop("padded", False)
    g = torch.Generator().manual_seed(M + K)
    # integers times a power of two per row: exact sums of squares, so both kernels' rstd (and bytes) are equal
    x = (torch.randint(-15, 16, (M, K), generator=g) * torch.exp2(torch.randint(-8, 9, (M, 1), generator=g).float()))
    x = x.to(torch.bfloat16).to(DEV)
    if M > 2:
        x[M // 2, :32] = float("nan")  # a NaN block: NaN scale byte, NaN operand values
    w = (torch.rand(K, generator=g) + 0.5).to(DEV) if norm else None
    rows = lg.gemm_rows(M) + 3 if padded else None  # zero rows past M
    outs = []
    for on in (False, True):
        cute_casts(on)
        assert lo._cute_cast(x, w) == on
        outs.append(lo.casts(x, w, 1e-6, scaling="rceil", operand_rows=rows, **opts))
    triton, cute = outs
    for name in ("rowwise", "colwise"):
        a, b = getattr(triton, name), getattr(cute, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.scale_layout == b.scale_layout == "blocked" and a.orig_dtype == b.orig_dtype
            assert a.data.shape == b.data.shape and a.data.stride() == b.data.stride(), name
            assert_same_bytes(b.data, a.data, f"{call} {name} payload")
            assert_same_bytes(b.scale, a.scale, f"{call} {name} scale")
    for name in ("row_operand", "col_operand"):
        a, b = getattr(triton, name), getattr(cute, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16, name
            assert_same_bytes(b, a, f"{call} {name}")
    if norm:
        assert_same_bytes(cute.rstd, triton.rstd, f"{call} rstd")
    if opts.get("column_sums"):
        # atomics in other orders: each within FP32 rounding of the exact sum, which scales with the column's sum of
        # magnitudes (x's columns cancel, so the sums themselves can be far smaller)
        finite = ~torch.isnan(triton.column_sums)
        assert torch.equal(finite, ~torch.isnan(cute.column_sums)), "NaN columns"
        bound = 1e-5 * x.float().abs().sum(0)
        error = (cute.column_sums - triton.column_sums).abs()
        assert (error[finite] <= bound[finite]).all(), f"column sums differ by up to {error[finite].max()}"


@pytest.mark.parametrize("layer", ["linear", "linear_silu", "norm_linear"])
@pytest.mark.parametrize("M,K,N", [(32767, 1024, 3072), (4097, 256, 768), (33, 512, 1536)])
def test_a_layer_trains_the_same(cute_casts, layer, M, K, N):
    """Forward and backward of an MX linear (with a SiLU input activation too) and an RMSNorm + MX linear with the
    CuTe casts: the Triton casts' outputs and gradients (the norm's rstd may differ in its last bits: the two kernels
    sum the squares in other orders)."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    weight = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV)
    bias = torch.randn(N, generator=g).to(DEV)
    gamma = (torch.rand(K, generator=g) + 0.5).to(DEV)
    dy = torch.randn(M, N, generator=g).to(torch.bfloat16).to(DEV)
    results = []
    for on in (False, True):
        cute_casts(on)
        lo.clear_weight_cache()
        leaves = [t.clone().requires_grad_() for t in ((x, gamma, weight, bias) if layer == "norm_linear"
                                                        else (x, weight, bias))]
        if layer == "norm_linear":
            y = RMSNormMXLinearFunction.apply(*leaves, 1e-6, "rceil", "cublas")
        else:
            y = MXLinearFunction.apply(*leaves, "rceil", "cublas", "silu" if layer == "linear_silu" else None)
        y.backward(dy)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for i, (a, b) in enumerate(zip(*results)):
        if layer != "norm_linear" and i != len(results[0]) - 1:
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"output {i}: {m}")
        else:
            # the bias gradient comes from column sums added atomically (in another order each run); with the
            # norm, the two kernels' rstd may differ in the last bits (other summation orders), which moves an
            # element across an E4M3 rounding boundary now and then: a few elements of Y and the gradients differ
            # by one E4M3 step of one product, far below the MX recipe's own error (~30 dB)
            assert sqnr_db(b.float(), a.float()) >= 45, f"output {i}: {sqnr_db(b.float(), a.float()):.1f} dB"
