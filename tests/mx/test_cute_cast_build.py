"""The CuTe RMSNorm + MX cast kernel on a machine without a GPU: it builds for sm_90a under FakeTensorMode (a child
process, as `gem_lp.compile_check`), its PTX does the MX arithmetic without flushing subnormals, and the dispatch
and launch tables are checked."""
import os
import re
import subprocess
import sys

import pytest
import torch

from gem_lp.runtime.device import cute_stack_missing

from gem_lp.runtime.dispatch import resolve_backend
from gem_lp.mx import quantize_dual
from gem_lp.norm import rms_norm_quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BUILD = r"""
import os, sys
dump = sys.argv[1]
os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast
with FakeTensorMode():
    for K, dtype, norm, blocked, scaling in ((1024, torch.bfloat16, True, True, "rceil"),
                                             (96, torch.float32, True, False, "floor"),
                                             (256, torch.float16, False, True, "rceil")):
        x = torch.empty(1000, K, dtype=dtype, device="cuda")
        w = torch.empty(K, dtype=torch.bfloat16, device="cuda") if norm else None
        out = norm_mx_cast(x, w, 1e-6, scaling=scaling, blocked_scales=blocked, arch="sm_90a")
        print("built", K, tuple(out.row_data.shape), tuple(out.col_data.shape), out.col_data.stride(), flush=True)
"""


@pytest.mark.skipif(cute_stack_missing() is not None, reason=str(cute_stack_missing()))
def test_kernel_builds_for_sm90_without_ftz(tmp_path):
    dump = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _BUILD, dump], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("built") == 3
    assert "built 1024 (1000, 1024) (1024, 1000) (1008, 1)" in done.stdout  # y^T rows 16-byte aligned
    ptx = [open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx")]
    assert len(ptx) == 3, sorted(os.listdir(dump))
    for text in ptx:
        assert ".target sm_90a" in text
        assert ".ftz" not in text  # subnormal x, y, d and payload products keep their values
        assert "cvt.rn.satfinite.e4m3x2.f32" in text and "max.NaN.xorsign.abs.f32" in text
        assert "cp.async.cg.shared.global" in text or "cp.async.ca.shared.global" in text
        assert re.search(r"st\.global\.v2\.b32", text)  # 8-byte payload stores
    cluster = [t for t in ptx if "st.async" in t]
    assert len(cluster) == 1 and "mbarrier" in cluster[0]  # K=1024: two CTAs share the sums of squares
    assert any("div.rn.f32" in t and "sqrt.rn.f32" in t for t in ptx)  # rstd correctly rounded


_BUILD_OPERANDS = r"""
import os, sys
dump = sys.argv[1]
os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast
with FakeTensorMode():
    x = torch.empty(1001, 512, dtype=torch.bfloat16, device="cuda")
    w = torch.empty(512, dtype=torch.float32, device="cuda")
    out = norm_mx_cast(x, w, 1e-6, arch="sm_90a", rowwise=False, row_operand=True, operand_rows=1024)
    print("forward", out.row_data, out.row_scale, tuple(out.col_data.shape), tuple(out.row_operand.shape),
          out.row_operand.dtype, out.col_operand, flush=True)
    out = norm_mx_cast(x, None, arch="sm_90a", rowwise=False, colwise=False, row_operand=True, col_operand=True,
                       operand_rows=1003)
    print("dual", out.row_data, out.col_data, tuple(out.row_operand.shape), tuple(out.col_operand.shape),
          out.col_operand.stride(), out.col_operand.dtype, flush=True)
"""


@pytest.mark.skipif(cute_stack_missing() is not None, reason=str(cute_stack_missing()))
def test_operand_outputs_build_for_sm90(tmp_path):
    """The casts' dequantized BF16 operands (an RMSNorm + linear forward's, a dY cast's): built for sm_90a, laid out
    as y, the MX casts not asked for absent; 16-byte stores of E4M3 -> FP16 -> BF16, colwise pairs by `prmt`."""
    dump = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _BUILD_OPERANDS, dump], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "forward None None (512, 1001) (1024, 512) torch.bfloat16 None" in done.stdout
    assert "dual None None (1003, 512) (1003, 512) (512, 1) torch.bfloat16" in done.stdout  # both laid out as y
    ptx = [open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx")]
    assert len(ptx) == 2, sorted(os.listdir(dump))
    for text in ptx:
        assert ".ftz" not in text and "cvt.rn.f16x2.e4m3x2" in text and "cvt.rn.bf16x2.f32" in text
        assert re.search(r"st\.global\.v4\.b32", text)
    assert any("prmt.b32" in text for text in ptx)


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
    with pytest.raises(ValueError, match="backend='cute' cannot run: the CuTe kernels need a CUDA device"):
        rms_norm_quantize(x, w, backend="cute")
    with pytest.raises(ValueError, match="backend='cute' cannot run: the CuTe kernels need a CUDA device"):
        quantize_dual(x, backend="cute")
    assert resolve_backend("auto", x, kernels=("triton", "cute")) == "reference"


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
