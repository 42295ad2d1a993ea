"""The sm_90 MX GEMM on a machine without a GPU: argument checks, the compile targets, the oracle's NaN / zero-scale
semantics, and one build for sm_90a under FakeTensorMode (a child process, as `gem_lp.compile_check`) whose PTX holds
the RS WGMMA, the E4M3 decode and the BF16 scale multiply without flushing subnormals."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from gem_lp.runtime.device import cute_stack_missing
from gem_lp.linear.kernels.cute_gemm_reference import dequantize_a, mx_gemm_reference
from gem_lp.mx.layout import blocked_size, to_blocked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_stack = pytest.mark.skipif(cute_stack_missing() is not None, reason=str(cute_stack_missing()))


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
    assert {(t.op, t.direction, t.precision, t.needs_mma) for t in t90} == {("gemm", "fwd", "mxfp8", True)}
    assert all(f"K{K} N{N} bf16" in modes for K, N in SHAPES)
    assert "K1024 N3072 bf16 bias" in modes and "K1024 N3072 fp32" in modes
    assert len(modes) == len(set(modes)) == len(SHAPES) + 2
    t100 = compile_targets("sm_100a")
    assert [t.mode.split("mxfp8 ", 1)[1] for t in t100] == [
        "bf16 out (build only)", "mxfp8 out along N (build only)", "mxfp8 out along M (build only)"]
    assert all(t.precision == "mxfp8" and t.needs_mma and "block-scaled" in t.mode for t in t100)
    from gem_lp import compile_check

    assert "gem_lp.linear.kernels.cute_targets" in compile_check.TARGET_MODULES


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


_BUILD = r"""
import os, sys
dump = sys.argv[1]
os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump, FLASH_ATTENTION_ARCH="sm_90a")
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from gem_lp.linear.kernels.cute_gemm import mx_gemm_sm90
from gem_lp.mx.layout import blocked_size
with FakeTensorMode():
    M, K, N = 1000, 512, 1536
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(blocked_size(M, K // 32), dtype=torch.uint8, device="cuda")
    b = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")
    y = mx_gemm_sm90(a, s, b, torch.empty(N, device="cuda"), arch="sm_90a")
    print("built", tuple(y.shape), y.dtype, flush=True)
"""


@needs_stack
def test_kernel_builds_for_sm90(tmp_path):
    dump = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _BUILD, dump], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "built (1000, 1536) torch.bfloat16" in done.stdout
    ptx = [open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx")]
    assert len(ptx) == 1, sorted(os.listdir(dump))
    text = ptx[0]
    assert ".target sm_90a" in text and ".ftz" not in text
    # RS WGMMA: A from registers (a brace list of A registers, not a 64-bit smem descriptor)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16[^;]*;", text)
    assert len(wgmma) == 24 and all(re.search(r"\}\s*,\s*\{", w) for w in wgmma)  # 8 k16 blocks x 3 tile phases
    assert text.count("cvt.rn.f16x2.e4m3x2") == 96 and text.count("mul.rn.bf16x2") == 96  # 4 per block
    assert text.count("ld.shared.b16") == 96  # the payload's byte pairs
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", text)) >= 1  # A's (16, M, K/16) box


_BUILD_SM100_MX_OUT = r"""
import os, sys
from torch._subclasses.fake_tensor import FakeTensorMode
from gem_lp import compile_check
compile_check._configure("sm_100a", sys.argv[1])
from gem_lp.linear.kernels.cute_gemm import build_sm100_mxfp8
with FakeTensorMode():
    build_sm100_mxfp8(mx_out=sys.argv[2])
print("built", flush=True)
"""


@needs_stack
@pytest.mark.parametrize("direction", ("row", "col"))
def test_mx_output_epilogue_builds_for_sm100(tmp_path, direction):
    """The GEMM + quantize epilogue on sm_100a (never run: no Blackwell GPU here): block-scaled MMAs, Y's scales by
    the E8M0 conversion rounding up (rceil) and its payload by E4M3 round-to-nearest-even conversions."""
    dump = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _BUILD_SM100_MX_OUT, dump, direction], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ptx = [open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx")]
    assert len(ptx) == 1, sorted(os.listdir(dump))
    text = ptx[0]
    assert ".target sm_100a" in text
    assert re.search(r"tcgen05\.mma\.cta_group::2\.kind::mxf8f6f4\.block_scale", text)
    assert "cvt.rp.ue8m0x2.f32" in text and "cvt.rn.satfinite.e4m3x2.f32" in text
