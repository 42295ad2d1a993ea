"""The Blackwell (sm_100) build of the MX GEMM issues the native block-scaled MMA (compile-checked, not run)."""
import re

from gem_lp.norm_gemm.blackwell import BLOCK_SCALED_MMA, blackwell_mx_gemm_ptx, block_scaled_mma_lines


def test_sm100_ptx_holds_block_scaled_tcgen05_mma():
    ptx = blackwell_mx_gemm_ptx(row_mx=True, col_mx=True)
    assert re.search(r"^\.target sm_100", ptx, re.MULTILINE), "not an sm_100 build"
    lines = block_scaled_mma_lines(ptx)
    assert lines, "no block-scaled tcgen05.mma in the sm_100 PTX"
    # E4M3 x E4M3 with one E8M0 scale per 32 elements: the mxf8f6f4 kind, scale vector 1X
    assert all("kind::mxf8f6f4" in line and "scale_vec::1X" in line for line in lines), lines[:2]
    # the quantizing epilogue is in the same kernel: the hardware E4M3 conversion of the output
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    # no software upcast of the operands to BF16 (what the sm_90 decomposition does)
    assert not re.search(r"wgmma\S*\.bf16", ptx)


def test_pattern_rejects_plain_mma():
    assert not BLOCK_SCALED_MMA.search("tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r3, %p1;")
    assert BLOCK_SCALED_MMA.search("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1]")
