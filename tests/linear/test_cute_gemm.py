"""The sm_90 MX GEMM (`gem_lp.linear.kernels.cute_gemm.mx_gemm_sm90`) on the GPU against the plain-PyTorch oracle.

Y = deq(A) @ B^T (+ bias) with FP32 accumulation: the kernel's sum order differs from the oracle's, so Y is not
expected bit for bit. Checked per element against an FP64 oracle within
    |Y - Y_ref| <= 2^-8 |Y_ref| (BF16 output; 2^-23 for FP32) + K 2^-23 (|deq A| |B|^T) + K 2^-133 max|B|
(FP32 accumulation of K products, the output rounding, and the BF16 operand's 2^-133 subnormal step for scale bytes
0-2), and against cuBLAS `torch.mm` on the dequantized BF16 operands (the current route) within twice that.
NaN scale bytes (255) must give NaN in every column of their rows.
"""
import pytest
import torch

from gem_lp.linear.kernels.cute_gemm_reference import dequantize_a, mx_gemm_reference
from gem_lp.mx.layout import to_blocked

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu(9)

from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90  # noqa: E402
from benchmarks.launch_candidates import GEMM_LAUNCH_CANDIDATES as LAUNCH_CANDIDATES  # noqa: E402

DEV = "cuda"
MS = (0, 1, 31, 33, 127, 128, 129, 4097, 32767)
# (K, N) of the model's linears
SHAPES = ((1024, 3072), (1024, 4096), (4096, 1024), (256, 768), (512, 1536))


def make_operands(M, K, N, seed, specials=True):
    """Random finite E4M3 payloads (no NaN encodings), scale bytes mostly in [117, 137] with rows holding bytes
    0, 127, 254 (one block, tiny payloads so the products stay finite) and 255 (NaN); B randn-like BF16."""
    g = torch.Generator().manual_seed(seed)
    pay = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    pay = torch.where((pay & 0x7F) == 0x7F, pay & 0xF0, pay)  # no NaN payloads
    scale = torch.randint(117, 138, (M, K // 32), generator=g, dtype=torch.uint8)
    nan_rows = []
    if specials and M:
        for r, byte in ((0, 0), (M // 3, 127), (M // 2, 254), (M - 1, 255)):
            blk = (r * 7) % (K // 32)
            scale[r, blk] = byte
            if byte == 254:  # payloads below 2^-6: 2^121 * |b| * 32 stays finite
                pay[r, blk * 32:(blk + 1) * 32] &= 0x87
            if byte == 0:
                pay[r, blk * 32:(blk + 1) * 32] &= 0x87  # subnormal / tiny payloads: the BF16 2^-133 corner
        nan_rows = [M - 1]
    b = (torch.randn(N, K, generator=g) * torch.exp2(torch.randint(-3, 4, (N, 1), generator=g).float())).bfloat16()
    return pay.view(torch.float8_e4m3fn).to(DEV), scale.to(DEV), b.to(DEV), nan_rows


def check(y, a, s, b, bias, nan_rows, out_dtype):
    M, K = a.shape
    ref = mx_gemm_reference(a, s, b, bias, dtype=torch.float64)
    deq = dequantize_a(a, s, torch.float64)
    absprod = deq.abs().nan_to_num(0.0) @ b.double().abs().t()
    rel_out = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23
    bound = rel_out * ref.abs() + K * 2.0 ** -23 * absprod + K * 2.0 ** -133 * b.double().abs().max()
    finite = torch.ones(M, dtype=torch.bool, device=DEV)
    finite[nan_rows] = False
    yd = y.double()
    assert y.shape == ref.shape and y.dtype == out_dtype
    if nan_rows:
        assert torch.isnan(y[nan_rows]).all(), "a NaN scale byte must give NaN across its row"
    err = (yd - ref).abs()[finite]
    assert torch.isfinite(yd[finite]).all(), "non-finite output in a finite row"
    over = err > bound[finite]
    assert not over.any(), (f"{int(over.sum())} elements over the FP32-accumulation bound; max err "
                            f"{err.max().item():.3e}, max ratio {(err / bound[finite]).max().item():.3f}")
    # the current route: dequantize to BF16 (same rounding as ours), cuBLAS BF16 GEMM
    mm = torch.mm(deq.to(torch.bfloat16), b.t()).double()
    if bias is not None:
        mm = mm + bias.double()
    assert ((yd - mm).abs()[finite] <= 2 * bound[finite] + 2.0 ** -8 * mm.abs()[finite]).all()


@pytest.mark.parametrize("K,N", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
@pytest.mark.parametrize("M", MS)
def test_model_shapes_blocked_scales(M, K, N):
    a, s, b, nan_rows = make_operands(M, K, N, seed=M * 31 + K + N)
    y = mx_gemm_sm90(a, to_blocked(s), b)
    check(y, a, s, b, None, nan_rows, torch.bfloat16)


@pytest.mark.parametrize("M", (1, 129, 4097))
@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float32))
def test_bias_plain_scales_and_fp32_out(M, out_dtype):
    K, N = 1024, 3072
    a, s, b, nan_rows = make_operands(M, K, N, seed=M)
    bias = torch.randn(N, device=DEV).bfloat16()
    y = mx_gemm_sm90(a, s, b, bias, out_dtype=out_dtype)  # plain [M, K/32] scales
    check(y, a, s, b, bias, nan_rows, out_dtype)


@pytest.mark.parametrize("K,N", ((96, 64), (160, 200), (32, 8)))
@pytest.mark.parametrize("M", (1, 200))
def test_odd_shapes(M, K, N):
    """K a multiple of 32 but not of the 128-wide k-tile, N a multiple of 8 but not of the tile."""
    a, s, b, nan_rows = make_operands(M, K, N, seed=K + N + M)
    check(mx_gemm_sm90(a, to_blocked(s), b), a, s, b, None, nan_rows, torch.bfloat16)


def test_exact_on_small_integers():
    """Payloads and B small integers times powers of two: every partial sum is exact in FP32, so Y is exact."""
    M, K, N = 300, 1024, 768
    g = torch.Generator().manual_seed(5)
    ints = torch.randint(-8, 9, (M, K), generator=g).float()
    a = ints.to(torch.float8_e4m3fn).to(DEV)
    s = torch.randint(120, 131, (M, K // 32), generator=g, dtype=torch.uint8).to(DEV)
    b = torch.randint(-8, 9, (N, K), generator=g).bfloat16().to(DEV)
    y = mx_gemm_sm90(a, to_blocked(s), b, out_dtype=torch.float32)
    torch.testing.assert_close(y, mx_gemm_reference(a, s, b), rtol=0, atol=0)


@pytest.mark.slow  # the tuning space
@pytest.mark.parametrize("launch", LAUNCH_CANDIDATES, ids=str)
def test_launch_candidates_agree(launch):
    M, K, N = 4097, 1024, 3072
    a, s, b, nan_rows = make_operands(M, K, N, seed=11)
    check(mx_gemm_sm90(a, to_blocked(s), b, launch=launch), a, s, b, None, nan_rows, torch.bfloat16)


def test_strided_payload_rows():
    """A payload view with padded rows (a larger buffer's first K columns) gives the same Y."""
    M, K, N = 333, 512, 1536
    a, s, b, nan_rows = make_operands(M, K, N, seed=3)
    big = torch.zeros(M, K + 64, dtype=torch.uint8, device=DEV)
    big[:, :K] = a.view(torch.uint8)
    y = mx_gemm_sm90(big[:, :K].view(torch.float8_e4m3fn), to_blocked(s), b)
    torch.testing.assert_close(y, mx_gemm_sm90(a, to_blocked(s), b), rtol=0, atol=0, equal_nan=True)
