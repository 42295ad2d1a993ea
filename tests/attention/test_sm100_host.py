"""Host side of the sm_100a MXFP8 attention forward and backward on the CPU: arch and p_quant checks, operand checks,
the compile targets and what compile_check says is missing. (The kernels themselves are built by `python -m
gem_lp.compile_check --arch sm_100a`; no Blackwell GPU runs them here.)"""
import pytest
import torch

pytest.importorskip("flash_attn.cute")

from gem_lp import compile_check  # noqa: E402
from gem_lp.attention.cute import config  # noqa: E402
from gem_lp.attention.cute.launch import (  # noqa: E402
    MXBwdScales, MXScales, _check_arch, check_sm100_bwd_operands, check_sm100_operands, mx_backward, mx_forward)
from gem_lp.attention.cute.targets import compile_targets  # noqa: E402


def test_arch_majors():
    assert config.MX_FWD_ARCH_MAJORS == (9, 10) and config.MX_BWD_ARCH_MAJORS == (9, 10)
    assert config.MX_P_QUANTS[10] == ("const_p", "dynamic")
    assert all(t.q_stage == 1 and t.tile_m == t.tile_n == 128 for t in config.SM100_FWD.values())
    assert tuple(config.SM100_BWD) == (64, 128)
    assert all(t.tile_m == t.tile_n == 128 for t in config.SM100_BWD.values())


def test_check_arch():
    assert _check_arch("sm_90a", "fwd", "dynamic") == 9
    assert _check_arch("sm_90a", "bwd", "const_p") == 9
    assert _check_arch("sm_100a", "fwd", "const_p") == 10
    assert _check_arch("sm_100a", "fwd", "dynamic") == 10
    assert _check_arch("sm_100a", "bwd", "const_p") == 10
    assert _check_arch("sm_100a", "bwd", "dynamic") == 10
    with pytest.raises(NotImplementedError, match="bwd kernel has p_quant in"):
        _check_arch("sm_100a", "bwd", "rne")
    with pytest.raises(NotImplementedError, match="p_quant in \\('const_p', 'dynamic'\\), got 'rne'"):
        _check_arch("sm_100a", "fwd", "rne")
    with pytest.raises(NotImplementedError, match="sm_120a has none"):
        _check_arch("sm_120a", "fwd")


def _operands(t=300, heads=2, dim=128, batch=3, kv_t=None):
    kv_t = t if kv_t is None else kv_t
    q = torch.zeros(t, heads, dim, dtype=torch.float8_e4m3fn)
    k = torch.zeros(kv_t, heads, dim, dtype=torch.float8_e4m3fn)
    v = torch.zeros_like(k)
    tiles = (t + batch * 127) // 128
    sf = [torch.zeros(heads, tiles * 512, dtype=torch.uint8) for _ in range(3)]
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    return q, k, v, MXScales(*sf, cu.clone(), cu.clone()), cu


def test_sm100_operand_checks():
    q, k, v, scales, cu = _operands()
    check_sm100_operands(q, k, v, scales, cu, cu)
    with pytest.raises(ValueError, match="pass scales=MXScales"):
        check_sm100_operands(q, k, v, None, cu, cu)
    with pytest.raises(ValueError, match="q must be a \\[T, H, D\\] float8_e4m3fn payload"):
        check_sm100_operands(q.to(torch.bfloat16), k, v, scales, cu, cu)
    with pytest.raises(ValueError, match="head dims \\(64, 128\\), got 96"):
        q96, k96, v96, s96, _ = _operands(dim=96)
        check_sm100_operands(q96, k96, v96, s96, cu, cu)
    with pytest.raises(ValueError, match="heads and head dims differ"):
        check_sm100_operands(q, k[:, :1], v[:, :1], scales, cu, cu)
    bad = MXScales(scales.q[:, :100], scales.k, scales.v, scales.q_tiles, scales.k_tiles)
    with pytest.raises(ValueError, match="scales.q must be \\[H=2, n \\* 512\\] uint8"):
        check_sm100_operands(q, k, v, bad, cu, cu)
    short = MXScales(scales.q, scales.k[:, :512], scales.v, scales.q_tiles, scales.k_tiles)
    with pytest.raises(ValueError, match="scales.k has 512 bytes per head, fewer than 300 tokens need"):
        check_sm100_operands(q, k, v, short, cu, cu)
    wrong_tiles = MXScales(scales.q, scales.k, scales.v, scales.q_tiles.long(), scales.k_tiles)
    with pytest.raises(ValueError, match="scales.q_tiles must be int32 of shape \\(4,\\)"):
        check_sm100_operands(q, k, v, wrong_tiles, cu, cu)


def test_mx_forward_sm100_empty_batch_needs_no_kernel():
    q, k, v, scales, cu = _operands(t=0)
    out, lse = mx_forward(q, k, v, cu, cu, causal=False, scale=0.1, p_quant="const_p", arch="sm_100a",
                          scales=scales)
    assert out.shape == (0, 2, 128) and out.dtype == torch.bfloat16 and lse.shape == (2, 0)
    out, lse = mx_forward(q, k, v, cu, cu, causal=False, scale=0.1, p_quant="dynamic", arch="sm_100a",
                          scales=scales)
    assert out.shape == (0, 2, 128) and lse.shape == (2, 0)
    with pytest.raises(NotImplementedError, match="p_quant"):
        mx_forward(q, k, v, cu, cu, causal=False, scale=0.1, p_quant="rne", arch="sm_100a", scales=scales)


def _bwd_operands(t=300, heads=2, dim=64, batch=3, kv_t=None):
    kv_t = t if kv_t is None else kv_t
    q, do = (torch.zeros(t, heads, dim, dtype=torch.float8_e4m3fn) for _ in range(2))
    k, v = (torch.zeros(kv_t, heads, dim, dtype=torch.float8_e4m3fn) for _ in range(2))
    tiles = (max(t, kv_t) + batch * 127) // 128
    sf = [torch.zeros(heads, tiles * 512, dtype=torch.uint8) for _ in range(7)]
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    do_values = torch.zeros(t, heads, dim, dtype=torch.bfloat16)
    return q, k, v, do, do_values, MXBwdScales(*sf, cu.clone(), cu.clone()), cu


def test_sm100_bwd_operand_checks():
    q, k, v, do, dov, scales, cu = _bwd_operands()
    check_sm100_bwd_operands(q, k, v, do, dov, scales, cu, cu)
    with pytest.raises(ValueError, match="pass scales=MXBwdScales"):
        check_sm100_bwd_operands(q, k, v, do, dov, None, cu, cu)
    with pytest.raises(ValueError, match="do must be a \\[T, H, D\\] float8_e4m3fn payload"):
        check_sm100_bwd_operands(q, k, v, do.to(torch.bfloat16), dov, scales, cu, cu)
    q2, k2, v2, do2, dov2, s2, _ = _bwd_operands(dim=128)
    check_sm100_bwd_operands(q2, k2, v2, do2, dov2, s2, cu, cu)
    with pytest.raises(ValueError, match="backward takes head dims \\(64, 128\\), got 96"):
        q2, k2, v2, do2, dov2, s2, _ = _bwd_operands(dim=96)
        check_sm100_bwd_operands(q2, k2, v2, do2, dov2, s2, cu, cu)
    with pytest.raises(ValueError, match="shapes differ"):
        check_sm100_bwd_operands(q, k, v, do[:, :1], dov, scales, cu, cu)
    with pytest.raises(ValueError, match="do_values must be the BF16 values of do"):
        check_sm100_bwd_operands(q, k, v, do, None, scales, cu, cu)
    with pytest.raises(ValueError, match="do_values must be the BF16 values of do"):
        check_sm100_bwd_operands(q, k, v, do, dov.float(), scales, cu, cu)
    fields = {f: getattr(scales, f) for f in MXBwdScales.__dataclass_fields__}
    bad = MXBwdScales(**{**fields, "k_seq": scales.k_seq[:, :100]})
    with pytest.raises(ValueError, match="scales.k_seq must be \\[H=2, n \\* 512\\] uint8"):
        check_sm100_bwd_operands(q, k, v, do, dov, bad, cu, cu)
    short = MXBwdScales(**{**fields, "do_seq": scales.do_seq[:, :512]})
    with pytest.raises(ValueError, match="scales.do_seq has 512 bytes per head, fewer than 300 tokens need"):
        check_sm100_bwd_operands(q, k, v, do, dov, short, cu, cu)
    wrong_tiles = MXBwdScales(**{**fields, "k_tiles": scales.k_tiles.long()})
    with pytest.raises(ValueError, match="scales.k_tiles must be int32 of shape \\(4,\\)"):
        check_sm100_bwd_operands(q, k, v, do, dov, wrong_tiles, cu, cu)


def test_mx_backward_sm100_empty_batch_needs_no_kernel():
    q, k, v, do, dov, scales, cu = _bwd_operands(t=0)
    out = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 0)
    for p_quant in ("const_p", "dynamic"):
        dq, dk, dv = mx_backward(q, k, v, do, out, lse, None, cu, cu, causal=True, scale=0.1, p_quant=p_quant,
                                 arch="sm_100a", scales=scales, do_values=dov)
        assert dq.shape == dk.shape == dv.shape == (0, 2, 64) and dq.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="pass scales=MXBwdScales"):
        mx_backward(q, k, v, do, out, lse, None, cu, cu, causal=True, scale=0.1, p_quant="const_p",
                    arch="sm_100a", do_values=dov)


def test_compile_targets_say_what_exists():
    mx100 = [t for t in compile_targets("sm_100a") if t.precision == "mxfp8"]
    assert {t.direction for t in mx100} == {"fwd", "bwd"}
    assert {t.mode.split()[-1] for t in mx100} == {"const_p", "dynamic"}
    fwd100 = [t for t in mx100 if t.direction == "fwd"]
    bwd100 = [t for t in mx100 if t.direction == "bwd"]
    assert len(fwd100) == 2 * 2 * 2 * 2  # head dims x causal x (few, many sequences) x p_quant
    assert len(bwd100) == 2 * 2 * 2 * 2  # head dims x causal x (few, many sequences) x p_quant
    assert {t.mode.split()[0] for t in bwd100} == {"d64", "d128"}
    mx90 = [t for t in compile_targets("sm_90a") if t.precision == "mxfp8"]
    assert {t.direction for t in mx90} == {"fwd", "bwd"} and len(mx90) == 2 * 2 * 2 * 2 * 2
    # every kernel the API can launch on either arch is built: nothing is listed as missing
    assert not compile_check.MISSING.get("sm_100a") and not compile_check.MISSING.get("sm_90a")


def test_scale_tiles_and_stage_count():
    from gem_lp.attention.cute.fwd_sm100 import SF_TILE_BYTES, sf_stage_count

    assert SF_TILE_BYTES == 512
    # D128, one Q stage: Q 16 KiB + O 32 KiB, 16 KiB per K/V stage: 10 stages with a scale tile each
    assert sf_stage_count(128, 1, 16 * 1024, 48 * 1024) == 10
    assert sf_stage_count(64, 1, 8 * 1024, 24 * 1024) == 23
    # dynamic P: one P scale tile per Q stage
    assert sf_stage_count(64, 2, 8 * 1024, 48 * 1024, p_tiles=2) == (224 * 1024 - 48 * 1024 - 4 * 512) // (8 * 1024 + 512)


def test_softmax_registers_with_one_q_stage():
    from gem_lp.attention.cute.fwd_sm100 import OTHER_REGS, softmax_regs

    # FA4's FP8 D = 64 budget (168 softmax, 96 correction): the idle second softmax warpgroup's share goes to the first
    assert softmax_regs(168, 96, OTHER_REGS) == 256
    # D = 128 causal (192, 72): capped at 256; the four warpgroups stay within setmaxnreg's 512
    assert softmax_regs(192, 72, OTHER_REGS) == 256 and 256 + 72 + 2 * OTHER_REGS <= 512
    assert softmax_regs(200, 200, 120) == 200  # never below FA4's


# per head dim: (block-scaled MMAs: one per 32-wide K block of the five GEMMs, each GEMM in two issue sites; the
# tensor-memory columns the scale tiles are copied to)
_BWD_BUILDS = {
    # S^T, dP^T: 2 K blocks each, dV, dK, dQ: 4 each; the ten tiles from column 384
    64: (32, set(range(384, 424, 4))),
    # all five GEMMs 4 K blocks; K's and Q's `hdim` tiles in dP^T past the E4M3 dS (288, 292), the rest in S^T past
    # the E4M3 P (32-63)
    128: (40, {288, 292} | set(range(32, 64, 4))),
}


@pytest.mark.parametrize("dim", sorted(_BWD_BUILDS))
def test_one_mx_backward_build_for_sm100a(tmp_path, dim):
    """The causal dynamic-P mxfp8 backward, built for sm_100a in a child process as compile_check does (the CuTe DSL
    reads its architecture from the environment once): every MMA in its PTX is block-scaled, one per 32-wide K
    block of the five GEMMs (prologue/loop and loop/tail copies), and the scale tiles go to the tensor-memory
    columns of the design (bwd_sm100's docstring)."""
    import os
    import re
    import subprocess
    import sys

    code = ("import sys; from gem_lp import compile_check as cc; "
            "from gem_lp.attention.cute import targets; "
            "cc.TARGET_MODULES = ('one_target',); "
            "import types; m = types.ModuleType('one_target'); "
            "m.compile_targets = lambda arch: [t for t in targets.compile_targets(arch) "
            f"if t.precision == 'mxfp8' and t.direction == 'bwd' and t.mode == 'd{dim} causal dynamic']; "
            "sys.modules['one_target'] = m; "
            f"sys.exit(cc.run('sm_100a', {str(tmp_path)!r}))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mmas, sf_columns = _BWD_BUILDS[dim]
    assert f"MXAttentionBackwardSm100: tcgen05.mma={mmas} block_scaled={mmas}" in done.stdout
    assert "1 passed, 0 failed" in done.stdout
    ptx = [p for p in tmp_path.rglob("*.ptx") if "MXAttentionBackwardSm100" in p.name and "_raw" not in p.parts]
    assert len(ptx) == 1
    text = ptx[0].read_text()
    # P and dS go to tensor memory as E4M3, 8 columns (32 values) per thread and stage
    assert "tcgen05.st.sync.aligned.32x32b.x8.b32" in text and "tcgen05.st.sync.aligned.32x32b.x16" not in text
    # the scale tiles reach tensor memory through tcgen05.cp, at the columns of the design
    copies = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s*\n\s*tcgen05\.cp\.cta_group::1\.32x128b\.warpx4\s+\[(%r\d+)\]",
                        text)
    assert copies and all(a == b for a, _, b in copies)
    assert len(copies) == text.count("tcgen05.cp.cta_group::1.32x128b.warpx4")
    assert {int(c) for _, c, _ in copies} == sf_columns


_LAYOUT_PROBE = '''
import os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cutlass, cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100
from cutlass.cute.nvgpu import tcgen05
from cutlass.utils import LayoutEnum
from gem_lp.attention.cute.bwd_sm100 import MXAttentionBackwardSm100
e4m3 = cutlass.Float8E4M3FN
out = {}

@cute.jit
def probe(kernel: cutlass.Constexpr):
    (kernel.tiled_mma_S, kernel.tiled_mma_dP, kernel.tiled_mma_dK, kernel.tiled_mma_dV,
     kernel.tiled_mma_dQ) = kernel._get_tiled_mma()
    # dS: the dQ MMA's A buffer (MN-major) and the epilogue-layout view FA4's compute warps store it through
    sdS = cute.slice_(sm100.make_smem_layout_a(kernel.tiled_mma_dQ, kernel.mma_tiler_dsk, e4m3, 1),
                      (None, None, None, 0))
    epi = sm100.make_smem_layout_epi(e4m3, LayoutEnum.ROW_MAJOR, (kernel.tile_n, kernel.tile_m), 1)
    epi_outer = cute.slice_(epi.outer, (None, None, 0))
    bad = 0
    for q in cutlass.range_constexpr(0, 128, 3):
        for key in cutlass.range_constexpr(0, 128, 5):
            bad += int(cute.crd2idx(((q, key % 32), 0, key // 32), sdS.outer)
                       != cute.crd2idx(((key % 8, key // 8), (q, 0)), epi_outer))
    out["dS mismatches"] = bad
    out["dS swizzles"] = (str(sdS.inner), str(epi.inner))
    # every scale tile: 512 bytes of shared memory, 4 tensor-memory columns
    tmem = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
    cols = []
    for name, (smem, tlayout) in kernel._sf_layouts().items():
        t = cute.make_tensor(cute.recast_ptr(tmem, dtype=cutlass.Float8E8M0FNU), tlayout)
        cols.append(tcgen05.find_tmem_tensor_col_offset(t))
    out["sf columns"] = cols

for dim in (64, 128):
    for p_quant in ("const_p", "dynamic"):
        k = MXAttentionBackwardSm100(dim, is_causal=True, p_quant=p_quant)
        probe(k)
        assert out["dS mismatches"] == 0, out
        assert out["dS swizzles"][0] == out["dS swizzles"][1], out
        assert out["sf columns"] == [4] * 10, out
        cols = k.tmem_sf_cols
        if dim == 64:
            # columns of their own after the accumulators (dK ends at 384)
            assert not k.sf_serial and k.tmem_sf_offset == 384 and sorted(cols.values()) == list(range(384, 424, 4))
        else:
            # S^T 0-127 (E4M3 P 0-31), dV 128-255, dP^T / dQ 256-383 (E4M3 dS 256-287), dK 384-511
            assert (k.tmem_S_offset, k.tmem_dV_offset, k.tmem_dP_offset, k.tmem_dK_offset) == (0, 128, 256, 384)
            assert k.tmem_dQ_offset == 256 and k.tmem_P_offset == 0 and k.tmem_dS_offset == 256
            assert k.sf_serial and cols["Kh"] == 288 and cols["Qh"] == 292
            assert sorted(c for n, c in cols.items() if n not in ("Kh", "Qh")) == list(range(32, 64, 4))
        assert len(set(cols.values())) == 10 and max(cols.values()) + 4 <= 512
print("layouts ok")
'''


def test_sm100_bwd_layouts(tmp_path):
    """What the sm_100a backward assumes of its layouts, checked by tracing them for sm_100a (child process): FA4's
    epilogue-layout store of 8-bit dS lands where the MN-major dQ MMA reads it (same swizzle, same offsets), and the
    ten scale tiles take 4 tensor-memory columns each: after column 384 at D = 64, in S^T / dP^T columns past the
    8-bit P / dS at D = 128."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = tmp_path / "probe.py"  # the DSL reads a jit function's source from its file
    probe.write_text(_LAYOUT_PROBE)
    done = subprocess.run([sys.executable, str(probe)], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0 and "layouts ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    with pytest.raises(ValueError, match="head_dim must be one of \\(64, 128\\)"):
        from gem_lp.attention.cute.bwd_sm100 import MXAttentionBackwardSm100

        MXAttentionBackwardSm100(96, is_causal=False)
