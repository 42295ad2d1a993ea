"""Host side of the sm_100a MXFP8 attention forward on the CPU: arch and p_quant checks, operand checks, the compile
targets and what compile_check says is missing. (The kernel itself is built by `python -m gem_lp.compile_check
--arch sm_100a`; no Blackwell GPU runs it here.)"""
import pytest
import torch

pytest.importorskip("flash_attn.cute")

from gem_lp import compile_check  # noqa: E402
from gem_lp.attention.cute import config  # noqa: E402
from gem_lp.attention.cute.launch import MXScales, _check_arch, check_sm100_operands, mx_forward  # noqa: E402
from gem_lp.attention.cute.targets import compile_targets  # noqa: E402


def test_arch_majors():
    assert config.MX_FWD_ARCH_MAJORS == (9, 10) and config.MX_BWD_ARCH_MAJORS == (9,)
    # the public API needs both directions: sm_100 keeps the reference for mxfp8
    assert config.MX_ARCH_MAJORS == (9,)
    assert config.MX_P_QUANTS[10] == ("const_p", "dynamic")
    assert all(t.q_stage == 1 and t.tile_m == t.tile_n == 128 for t in config.SM100_FWD.values())


def test_check_arch():
    assert _check_arch("sm_90a", "fwd", "dynamic") == 9
    assert _check_arch("sm_90a", "bwd", "const_p") == 9
    assert _check_arch("sm_100a", "fwd", "const_p") == 10
    assert _check_arch("sm_100a", "fwd", "dynamic") == 10
    with pytest.raises(NotImplementedError, match="bwd kernels are built for sm_90a; sm_100a has none"):
        _check_arch("sm_100a", "bwd", "const_p")
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


def test_compile_targets_say_what_exists():
    mx100 = [t for t in compile_targets("sm_100a") if t.precision == "mxfp8"]
    assert {t.direction for t in mx100} == {"fwd"}
    assert {t.mode.split()[-1] for t in mx100} == {"const_p", "dynamic"}
    assert len(mx100) == 2 * 2 * 2 * 2  # head dims x causal x (few, many sequences) x p_quant
    mx90 = [t for t in compile_targets("sm_90a") if t.precision == "mxfp8"]
    assert {t.direction for t in mx90} == {"fwd", "bwd"} and len(mx90) == 2 * 2 * 2 * 2 * 2
    missing = compile_check.MISSING["sm_100a"]
    assert any(m.startswith("attention bwd mxfp8: no sm_100a kernel yet") for m in missing)
    assert not any("dynamic" in m for m in missing)
    assert not any("fwd/bwd" in m for m in missing)


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
