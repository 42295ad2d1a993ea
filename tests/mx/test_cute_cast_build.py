"""The CuTe RMSNorm + MX cast kernel on a machine without a GPU: its builds for sm_90a and sm_100a (those
`gem_lp.compile_check` makes, read from its dump: see tests/compile_dump.py) do the MX arithmetic without flushing
subnormals, the host side lays out the outputs of every kind of call, and the dispatch and launch tables are
checked."""
import re

import pytest
import torch

from compile_dump import ptx_texts, stack_missing
from gem_lp.mx import quantize_dual
from gem_lp.mx.kernels.cute_cast_config import launch_for
from gem_lp.mx.layout import blocked_size
from gem_lp.norm import rms_norm_quantize
from gem_lp.runtime import dispatch

needs_builds = pytest.mark.skipif(stack_missing() is not None, reason=str(stack_missing()))
# The cast kernel's dump files: `NormMXCast_object_at__<x: dtype, K>_<weight or None>_<row payload, row scales, col
# payload, col scales: Uint8 or None>_<rstd>_<row operand, col operand: BFloat16 or None>_...`
_CAST = r"NormMXCast_object_at__FakeTensor(?P<dtype>[A-Za-z]+\d+)div1(?P<K>\d+)i64div\d+_(?P<weight>FakeTensorFloat32|None)"


def _builds(arch: str) -> list[tuple[dict, str]]:
    """(facts from the file name: dtype, K, norm, mx (payloads written), operands; PTX) of every cast build."""
    out = []
    for name, text in ptx_texts(_CAST, arch, "cast").items():
        m = re.search(_CAST, name)
        rest = name[m.end():]
        facts = dict(name=name, dtype=m["dtype"], K=int(m["K"]), norm=m["weight"] != "None",
                     mx="FakeTensorUint8" in rest, operands="FakeTensorBFloat16" in rest)
        out.append((facts, text))
    return out


@needs_builds
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_builds_do_the_mx_arithmetic_without_flushing_subnormals(arch):
    """Every build: for its target, subnormal x, y, d and payload products keep their values (no `.ftz` but SiLU's
    approximate exp2, by design: the BF16 SiLU of the MLP's casts); the payloads by the hardware E4M3 conversion from
    NaN-propagating block maxima, x by `cp.async`; MX payloads leave as 8-byte stores, dequantized operands as 16-byte
    stores of E4M3 -> FP16 -> BF16 conversions (colwise pairs by `prmt`); rstd correctly rounded; the CTAs of a cluster
    (K above one CTA's columns, the launch table's) share the sums of squares through `st.async` and an mbarrier."""
    builds = _builds(arch)
    assert any(f["norm"] for f, _ in builds) and any(f["operands"] for f, _ in builds), [f["name"] for f, _ in builds]
    for f, text in builds:
        what = f["name"][:120]
        assert f".target {arch}" in text, what
        ftz = {re.sub(r"\s.*", "", line.strip()) for line in text.splitlines() if ".ftz" in line.split("//")[0]}
        assert ftz <= {"ex2.approx.ftz.f32"}, (what, ftz)
        assert not ftz or not (f["norm"] or f["mx"]), what  # SiLU: an operand cast without the norm
        assert "cvt.rn.satfinite.e4m3x2.f32" in text and "max.NaN.xorsign.abs.f32" in text, what
        assert "cp.async.cg.shared.global" in text or "cp.async.ca.shared.global" in text, what
        if f["mx"]:
            assert re.search(r"st\.global\.v2\.b32", text), what
        if f["operands"]:
            assert "cvt.rn.f16x2.e4m3x2" in text and "cvt.rn.bf16x2.f32" in text, what
            assert re.search(r"st\.global\.v4\.b32", text), what
        if f["norm"]:
            assert "div.rn.f32" in text and "sqrt.rn.f32" in text, what
        cluster = f["norm"] and launch_for(arch, f["K"]).cluster_n > 1
        assert ("st.async" in text) == cluster and (not cluster or "mbarrier" in text), what
    assert any(f["operands"] and "prmt.b32" in text for f, text in builds)
    assert any(f["norm"] and launch_for(arch, f["K"]).cluster_n > 1 for f, _ in builds)  # a cluster build


@needs_builds
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_row_scales_leave_as_words(arch):
    """Row scales go through shared memory in both layouts: in the plain one, 4-byte words when K / 32 is a multiple
    of 4, else a run of bytes (K 96); the only single-byte stores from the lanes are the plain column scales (8 per
    thread), where a byte per row block is all a CTA has of each column."""
    plain = ptx_texts(r"rmsnorm-K\d+-\w+-plain[^/]*/.*NormMXCast", arch, "cast")
    assert len(plain) >= 5, list(plain)
    for name, text in plain.items():
        words_expected = "-K96-" not in name
        u8 = len(re.findall(r"st\.global\.u8", text))
        assert u8 <= (8 if words_expected else 10), (name[:80], u8)  # 16 when the lanes stored the row scales
        assert re.search(r"st\.global\.b32", text), name[:80]


@pytest.fixture
def host_side(monkeypatch):
    """`norm_mx_cast` under FakeTensorMode with the build recorded instead of compiled: the host side of a call
    (output buffers and their layouts, the build it asks for) on a machine without a GPU or a compile."""
    from gem_lp.mx.kernels import cute_cast_launch

    builds = []
    monkeypatch.setattr(cute_cast_launch, "_build", lambda *args: builds.append(args) or (lambda *a: None))
    monkeypatch.setattr(cute_cast_launch, "_DEFAULT_BUILDS", {})
    return cute_cast_launch.norm_mx_cast, builds


@needs_builds
def test_the_outputs_are_laid_out_for_the_gemms(host_side):
    """y^T's payload rows 32 bytes apart; scales blocked or plain; the operands laid out as y with their padding
    rows; the MX casts not asked for absent; one build per kind of call, with the launch table's launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gem_lp.mx.formats import colwise_row_stride

    norm_mx_cast, builds = host_side
    with FakeTensorMode():
        for K, dtype, norm, blocked, scaling in ((1024, torch.bfloat16, True, True, "rceil"),
                                                 (96, torch.float32, True, False, "floor"),
                                                 (256, torch.float16, False, True, "rceil")):
            x = torch.empty(1000, K, dtype=dtype, device="cuda")
            w = torch.empty(K, dtype=torch.bfloat16, device="cuda") if norm else None
            out = norm_mx_cast(x, w, 1e-6, scaling=scaling, blocked_scales=blocked, arch="sm_90a")
            assert out.row_data.shape == (1000, K) and out.col_data.shape == (K, 1000)
            assert out.col_data.stride() == (1024, 1) == (colwise_row_stride(1000), 1)  # y^T rows 32 bytes apart
            assert out.row_scale.shape == ((blocked_size(1000, K // 32),) if blocked else (1000, K // 32))
            assert (out.rstd is not None) == norm and out.row_operand is None and out.col_operand is None
            assert builds[-1][3] == launch_for("sm_90a", K) and builds[-1][4] == norm
        x = torch.empty(1001, 512, dtype=torch.bfloat16, device="cuda")
        out = norm_mx_cast(x, torch.empty(512, device="cuda"), 1e-6, arch="sm_90a", rowwise=False, row_operand=True,
                           operand_rows=1024)
        assert out.row_data is None and out.row_scale is None and out.col_operand is None
        assert out.col_data.shape == (512, 1001) and out.row_operand.shape == (1024, 512)
        assert out.row_operand.dtype == torch.bfloat16
        out = norm_mx_cast(x, None, arch="sm_90a", rowwise=False, colwise=False, row_operand=True, col_operand=True,
                           operand_rows=1003)
        assert out.row_data is None and out.col_data is None
        assert out.row_operand.shape == out.col_operand.shape == (1003, 512)  # both laid out as y
        assert out.col_operand.stride() == (512, 1) and out.col_operand.dtype == torch.bfloat16
    assert len(builds) == 5


def test_operand_arguments_are_checked():
    from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast

    x = torch.empty(10, 64, device="meta")
    with pytest.raises(ValueError, match="ask for at least one of rowwise, colwise, row_operand, col_operand"):
        norm_mx_cast(x, None, rowwise=False, colwise=False)
    with pytest.raises(ValueError, match="operand_rows must be >= M=10, got 9"):
        norm_mx_cast(x, None, row_operand=True, operand_rows=9)


def test_launch_table_covers_every_k():
    from gem_lp.mx.kernels.cute_cast_config import MAX_CLUSTER, MAX_TILE_K, SM90, generic_launch, launch_for, max_k

    for K in list(range(32, max_k() + 1, 32)):
        for launch in (generic_launch(K), launch_for("sm_90a", K), launch_for("sm_100a", K)):
            assert launch.tile_k % 128 == 0 and launch.tile_k <= MAX_TILE_K and launch.cluster_n <= MAX_CLUSTER, K
            assert launch.cluster_n * launch.tile_k >= K > (launch.cluster_n - 1) * launch.tile_k, (K, launch)
    assert all(launch_for("sm_90a", K) == launch for K, launch in SM90.items())
    with pytest.raises(ValueError, match="at most 8192 elements, got K=8224"):
        launch_for("sm_90a", 8224)


def test_cute_backend_on_cpu_tensors_says_why():
    x, w = torch.randn(40, 64), torch.ones(64)
    with pytest.raises(ValueError, match="backend='cute' cannot run rms_norm_quantize: it needs CUDA tensors"):
        rms_norm_quantize(x, w, backend="cute")
    with pytest.raises(ValueError, match="backend='cute' cannot run quantize_dual: it needs CUDA tensors"):
        quantize_dual(x, backend="cute")
    for op in ("rms_norm_quantize", "quantize_dual"):
        assert dispatch.choose(op, "mxfp8", x.device) == "reference"
        assert dispatch.TABLE[(op, "mxfp8")]["sm_90"][0] == dispatch.TABLE[(op, "mxfp8")]["sm_100"][0] == "cute"


def test_fake_mode_is_seen_only_under_fake_tensors():
    """The kernels' launch functions build and skip the launch exactly under FakeTensorMode (compile checks); other
    dispatch modes do not count."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from gem_lp.runtime.device import fake_mode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not fake_mode()
    with Passthrough():
        assert not fake_mode()
    with FakeTensorMode():
        assert fake_mode()
    assert not fake_mode()
