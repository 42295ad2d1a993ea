"""The Blackwell MXFP8 attention forward compiles for sm_100 on a CPU machine to native block-scaled MMAs.

Compile-checked only: no Blackwell GPU is available. On the H200 the same kernel runs with `tl.dot_scaled`
decomposed into BF16 MMAs, and a GPU test checks its output against the default kernel.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from gem_lp.attention.blackwell import BLOCK_SCALED_MMA, attention_forward_scaled, compile_for_blackwell


def blackwell_ptx(head_dim: int, p_quant: str, causal: bool) -> str:
    """PTX of the kernel for sm_100, compiled in a child process: under pytest on CPU the kernels are
    interpreted (TRITON_INTERPRET=1), and interpreted functions cannot be compiled."""
    code = ("import sys; from gem_lp.attention.blackwell import compile_for_blackwell; "
            f"sys.stdout.write(compile_for_blackwell({head_dim}, p_quant={p_quant!r}, causal={causal}).asm['ptx'])")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("head_dim,p_quant,causal", [(128, "dynamic", True), (64, "const_p", False)])
def test_forward_ptx_has_block_scaled_mma(head_dim, p_quant, causal):
    ptx = blackwell_ptx(head_dim, p_quant, causal)
    assert ".target sm_100" in ptx
    mmas = re.findall(r"tcgen05\.mma\.[\w.:]+", ptx)
    assert mmas and all(BLOCK_SCALED_MMA in m for m in mmas), sorted(set(mmas))
    # both GEMMs (S = Q K^T and O += P V) are block-scaled MMAs: no BF16/FP16 tcgen05.mma, no wgmma
    assert "kind::f16" not in ptx and "wgmma" not in ptx
    assert "tcgen05.ld" in ptx  # the accumulators live in tensor memory


def test_compile_arguments_checked():
    with pytest.raises(ValueError, match="head_dim"):
        compile_for_blackwell(96)
    with pytest.raises(ValueError, match="p_quant"):
        compile_for_blackwell(128, p_quant="static")
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(RuntimeError, match="interpreted"):
            compile_for_blackwell(128)


def test_runtime_needs_cuda():
    x = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    offs = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="CUDA"):
        attention_forward_scaled(x, x, x, offs, offs)


@pytest.mark.gpu
@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
def test_gpu_decomposed_scaled_forward_matches_default_kernel(p_quant):
    """On Hopper `tl.dot_scaled` is decomposed to BF16 MMAs of the dequantized operands: the same values
    the default kernel multiplies, so O agrees to within the output rounding (P rounds alike)."""
    from gem_lp.attention.triton_attention import attention_forward

    lengths = [0, 1, 31, 33, 127, 129, 500, 1023]
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths), 0)
    offs = offs.cuda()
    t = int(offs[-1])
    q, k, v = (torch.randn(t, 2, 128, device="cuda").bfloat16() for _ in range(3))
    o, lse = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", p_quant=p_quant,
                               config=(128, 64, 8, 2))
    o_s, lse_s = attention_forward_scaled(q, k, v, offs, offs, causal=True, p_quant=p_quant, block_n=64)
    torch.testing.assert_close(lse_s, lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(o_s.float(), o.float(), rtol=2.0**-7, atol=1e-4)
