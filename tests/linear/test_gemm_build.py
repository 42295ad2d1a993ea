"""The CuTe MX GEMMs on a machine without a GPU: argument checks, the compile targets, the oracle's NaN / zero-scale
semantics, and the builds `gem_lp.compile_check` makes (read from its dump: see tests/compile_dump.py): sm_90a's
PTX holds the RS WGMMA, the E4M3 decode and the BF16 scale multiply without flushing subnormals; sm_100a's the
block-scaled MMA and the quantizing epilogue."""
import math
import re

import pytest
import torch

from compile_dump import ptx_texts, stack_missing
from gem_lp.runtime.device import cute_stack_missing
from gem_lp.linear.kernels.cute_gemm_reference import dequantize_a, mx_gemm_reference
from gem_lp.mx.layout import blocked_size, to_blocked

needs_stack = pytest.mark.skipif(cute_stack_missing() is not None, reason=str(cute_stack_missing()))
needs_builds = pytest.mark.skipif(stack_missing() is not None, reason=str(stack_missing()))


def operands(M=4, K=64, N=16):
    a = torch.zeros(M, K).to(torch.float8_e4m3fn)
    s = torch.full((M, K // 32), 127, dtype=torch.uint8)
    return a, to_blocked(s), torch.zeros(N, K, dtype=torch.bfloat16)


@needs_stack
@pytest.mark.parametrize("change,err,match", [
    (lambda a, s, b: (a.float(), s, b), TypeError, "a_payload must be torch.float8_e4m3fn"),
    (lambda a, s, b: (a[:, :48], s, b[:, :48]), ValueError, r"a_payload \[M, K\] needs K a positive multiple of 32"),
    (lambda a, s, b: (a, s, b[:, :32]), ValueError, r"b_bf16 must be a 2-D \[N, K=64\] tensor"),
    (lambda a, s, b: (a, s, b.float()), TypeError, "b_bf16 must be torch.bfloat16"),
    (lambda a, s, b: (a, s, b[:12]), ValueError, r"b_bf16 \[N, K\] needs N a positive multiple of 8, got N=12"),
    (lambda a, s, b: (a, s[:100], b), ValueError, r"a_scale \(flat, blocked 128x4 layout\) must hold"),
    (lambda a, s, b: (a, s.view(-1, 1)[:4].view(4, 1), b), ValueError, r"a_scale \(plain layout\) must be \[M, K/32\]"),
    (lambda a, s, b: (a, s.float(), b), TypeError, "a_scale must be uint8 E8M0 bytes"),
    (lambda a, s, b: (a.t().contiguous().t(), s, b), ValueError, r"a_payload must be contiguous along K"),
])
def test_argument_errors(change, err, match):
    from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90

    a, s, b = change(*operands())
    with pytest.raises(err, match=match):
        mx_gemm_sm90(a, s, b)


@needs_stack
def test_bias_out_dtype_and_device_errors():
    from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90

    a, s, b = operands()
    with pytest.raises(ValueError, match=r"bias must be a floating \[N=16\] vector"):
        mx_gemm_sm90(a, s, b, torch.zeros(15))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        mx_gemm_sm90(a, s, b, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        mx_gemm_sm90(a, s, b)
    y = mx_gemm_sm90(a[:0], torch.empty(0, dtype=torch.uint8), b)  # M = 0: nothing to launch
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


@needs_stack
def test_compile_targets_list():
    from gem_lp.linear.kernels.cute_targets import SHAPES, compile_targets

    t90 = compile_targets("sm_90a")
    modes = [t.mode for t in t90]
    assert {(t.op, t.direction, t.precision, t.needs_mma) for t in t90} == {("linear", "fwd", "mxfp8", True),
                                                                             ("linear", "bwd", "mxfp8", True)}
    assert all(f"K{K} N{N} bf16" in modes for K, N in SHAPES)
    assert "K1024 N3072 bf16 bias" in modes and "K1024 N3072 fp32" in modes
    assert {"weight grad N256 fp32", "weight grad N768 fp32", "weight grad N256 bf16"} <= set(modes)
    assert len(modes) == len(set(modes)) == len(SHAPES) + 5
    t100 = compile_targets("sm_100a")
    assert [t.mode.split("mxfp8 ", 1)[1] for t in t100] == [
        "bf16 out (build only)", "mxfp8 out along N (build only)", "mxfp8 out along M (build only)"]
    assert all(t.precision == "mxfp8" and t.needs_mma and "block-scaled" in t.mode for t in t100)
    from gem_lp import compile_check

    assert "gem_lp.linear.kernels.cute_targets" in compile_check.TARGET_MODULES


def weight_grad_operands_cpu(K=64, M=40, N=16, rows=48):
    stride = 64
    x = torch.zeros(K * stride, dtype=torch.uint8).view(torch.float8_e4m3fn).as_strided((K, M), (stride, 1))
    s = torch.zeros(blocked_size(K, -(-M // 32)), dtype=torch.uint8)
    return x, s, torch.zeros(rows, N, dtype=torch.bfloat16).t()


@needs_stack
@pytest.mark.parametrize("change,match", [
    (lambda x, s, d: (x.to(torch.bfloat16), s, d), r"x_payload must be a 2-D \[K, M\] torch.float8_e4m3fn"),
    (lambda x, s, d: (x.contiguous(), s, d), r"row stride that is a multiple of 16 and >= 48"),
    (lambda x, s, d: (x, s[:-1], d), r"x_scale must be the flat blocked E8M0 bytes of \[K=64, M/32\]"),
    (lambda x, s, d: (x, s, d[:, :40]), r"dy_col must be the \[N, rows\] transposed view .* rows >= 48"),
    (lambda x, s, d: (x, s, d.t().contiguous()), r"dy_col must be the \[N, rows\] transposed view"),
    (lambda x, s, d: (x, s, d.float()), r"dy_col must be the \[N, rows\] transposed view of a contiguous bfloat16"),
    (lambda x, s, d: (x, s, d[:12]), r"dy_col must be the \[N, rows\] transposed view"),
])
def test_weight_grad_argument_errors(change, match):
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90

    x, s, d = change(*weight_grad_operands_cpu())
    with pytest.raises(ValueError, match=match):
        mx_weight_grad_sm90(x, s, d)


@needs_stack
def test_weight_grad_needs_a_gpu_and_n_a_multiple_of_8():
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90

    x, s, d = weight_grad_operands_cpu()
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        mx_weight_grad_sm90(x, s, d)
    x12, s12, d12 = weight_grad_operands_cpu(N=12)
    with pytest.raises(ValueError, match=r"needs N a positive multiple of 8, got N=12"):
        mx_weight_grad_sm90(x12, s12, d12)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        mx_weight_grad_sm90(x, s, d, torch.float16)


@needs_stack
def test_weight_grad_of_no_tokens_is_zero():
    from gem_lp.linear.kernels.cute_gemm import mx_weight_grad_sm90

    x, s, d = weight_grad_operands_cpu(M=0, rows=0)
    for dtype in (torch.float32, torch.bfloat16):
        dw = mx_weight_grad_sm90(x, s, d, dtype)
        assert dw.shape == (16, 64) and dw.dtype == dtype and not dw.any()


@needs_stack
def test_the_layers_take_the_weight_grad_kernel_where_the_table_and_the_operand_allow():
    from gem_lp.linear.kernels.cute_gemm import weight_grad_taken

    def dy_col(N, rows, dtype=torch.bfloat16):
        return torch.zeros(rows, N, dtype=dtype).t()

    assert weight_grad_taken("sm_90a", 273044, dy_col(256, 278528))
    assert weight_grad_taken("sm_90a", 273044, dy_col(768, 278528))
    assert not weight_grad_taken("sm_90a", 273044, dy_col(1024, 278528))  # measured slower: the dequantize route
    assert not weight_grad_taken("sm_100a", 273044, dy_col(256, 278528))  # no table: scaled_mm reads payloads
    assert not weight_grad_taken("sm_90a", 273044, dy_col(256, 278528, torch.float32))  # FP32 layers
    assert not weight_grad_taken("sm_90a", 1001, dy_col(256, 1002))  # padded rows short of M rounded up to 16
    assert weight_grad_taken("sm_90a", 1001, dy_col(256, 1008))
    assert not weight_grad_taken("sm_90a", 1000, dy_col(100, 1008))  # N not a multiple of 8


def test_reference_nan_and_zero_scale_semantics():
    M, K, N = 3, 64, 8
    a = torch.full((M, K), 1.0).to(torch.float8_e4m3fn)
    s = torch.full((M, K // 32), 127, dtype=torch.uint8)
    s[1, 1] = 255  # NaN block: the whole row of Y is NaN
    s[2, 0] = 0  # 2^-127: exact in FP32
    b = torch.ones(N, K, dtype=torch.bfloat16)
    y = mx_gemm_reference(a, to_blocked(s), b, torch.ones(N))
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    assert torch.equal(y[0], torch.full((N,), 65.0))
    assert y[2, 0].item() == 32 + 32 * 2.0 ** -127 + 1
    assert dequantize_a(a, s)[2, 0].item() == 2.0 ** -127
    assert math.isclose(mx_gemm_reference(a, s, b)[0, 0].item(), 64.0)
    assert to_blocked(s).numel() == blocked_size(M, K // 32)


# sm_90a's GEMM builds: `GemmDefaultSm90_object_at__<A's payload as (16, M, K/16): ..._<K/16>_1_<K>_16>_...`
_SM90 = r"GemmDefaultSm90_object_at__FakeTensorFloat8E4M3FN_16_div1_\d+_1_(?P<K>\d+)_16_"


@needs_builds
def test_kernel_builds_for_sm90():
    """Every sm_90a build of the model's shapes: RS WGMMA (A from registers: a brace list of A registers, not a 64-bit
    smem descriptor), per k16 block four E4M3 -> FP16 decodes of the payload's byte pairs from shared memory and four
    BF16 scale multiplies, A's (16, M, K/16) TMA box, and no subnormal flushed (`.ftz`); at K = 512, N = 1536: 8 k16
    blocks of the 128-wide k-tile x 3 tile phases."""
    builds = ptx_texts(_SM90, "sm_90a", "linear")
    assert {int(re.search(_SM90, n)["K"]) for n in builds} >= {256, 512, 1024, 4096}, sorted(builds)
    for name, text in builds.items():
        what = name[:140]
        assert ".target sm_90a" in text and ".ftz" not in text, what
        wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16[^;]*;", text)
        assert wgmma and all(re.search(r"\}\s*,\s*\{", w) for w in wgmma), what
        n = len(wgmma)
        assert text.count("cvt.rn.f16x2.e4m3x2") == text.count("mul.rn.bf16x2") == 4 * n, what  # 4 per block
        assert text.count("ld.shared.b16") == 4 * n, what  # the payload's byte pairs
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", text)) >= 1, what
    (k512,) = [t for n, t in builds.items() if "FakeTensorBFloat1615365125121" in n]  # B [N=1536, K=512]
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", k512)) == 24


# the weight-gradient builds: the payload X^T [K_in, tokens] as (16, K_in, tokens/16), K_in and the tokens dynamic
_SM90_WGRAD = r"GemmDefaultSm90_object_at__FakeTensorFloat8E4M3FN_16_div1_div1_1_i64_div16_16_"


@needs_builds
def test_weight_grad_builds_for_sm90():
    """The weight-gradient GEMM's sm_90a builds: the same RS WGMMA with the payload decoded in registers (four E4M3
    decodes and BF16 scale multiplies per k16 block) as the forward GEMM's, and the serial split-K's partials
    (FP32 workspace loads and stores, a per-tile flag polled with acquire loads); no subnormal flushed, no local
    memory."""
    builds = ptx_texts(_SM90_WGRAD, "sm_90a", "linear")
    assert len(builds) >= 3, sorted(builds)  # N 256 / 768 FP32, N 256 BF16
    for name, text in builds.items():
        what = name[:160]
        assert ".target sm_90a" in text and ".ftz" not in text and ".local" not in text, what
        wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16[^;]*;", text)
        assert wgmma and all(re.search(r"\}\s*,\s*\{", w) for w in wgmma), what
        assert text.count("cvt.rn.f16x2.e4m3x2") == text.count("mul.rn.bf16x2") == 4 * len(wgmma), what
        assert re.search(r"ld\.acquire\.gpu\.global", text), what


@needs_builds
def test_block_scaled_gemm_and_mx_output_epilogue_build_for_sm100():
    """quack's block-scaled MXFP8 GEMM for sm_100a (never run: no Blackwell GPU here): block-scaled MMAs over CTA
    pairs in every build; the builds writing Y as MXFP8 (the GEMM + quantize epilogue, along N or along M) take Y's
    scales by the E8M0 conversion rounding up (rceil) and its payload by E4M3 round-to-nearest-even conversions."""
    builds = ptx_texts(r"GemmDefaultSm100_object_at__", "sm_100a", "linear")
    mx_out = {n: t for n, t in builds.items() if re.search(r"FakeTensorFloat8E4M3FN\w*_FakeTensorFloat8E4M3FN\w*_"
                                                            r"FakeTensorFloat8E4M3FN", n)}
    assert mx_out and len(mx_out) < len(builds), sorted(builds)
    for name, text in builds.items():
        assert ".target sm_100a" in text, name
        assert re.search(r"tcgen05\.mma\.cta_group::2\.kind::mxf8f6f4\.block_scale", text), name
        assert ("cvt.rp.ue8m0x2.f32" in text and "cvt.rn.satfinite.e4m3x2.f32" in text) == (name in mx_out), name
