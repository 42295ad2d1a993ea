"""`python -m gem_lp.compile_check`: MMA counting, and one kernel built for sm_90a on this CPU machine (the whole
list runs in `make test`)."""
import os
import subprocess
import sys

from gem_lp.compile_check import _kernel_name, mma_counts

PTX = """
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 0;
\ttcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, p;
\ttcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd1, %rd2, %r2, [%r3], [%r4], p;
\t// wgmma.mma_async in a comment does not count
"""


def test_mma_counts_and_kernel_names():
    assert mma_counts(PTX) == (1, 2, 1)
    name = "cutlass___call___gem_lpattentioncutefwd_sm90MXAttentionForwardSm90_object_at__Tensor.sm_90a.ptx"
    assert _kernel_name(name) == "MXAttentionForwardSm90"


def test_one_build_for_sm90a(tmp_path):
    """The D64 mxfp8 forward, built in a child process as compile_check does (the CuTe DSL reads its
    architecture from the environment once)."""
    code = ("import sys; from gem_lp import compile_check as cc; "
            "from gem_lp.attention.cute import targets; "
            "cc.TARGET_MODULES = ('one_target',); "
            "import types; m = types.ModuleType('one_target'); "
            "m.compile_targets = lambda arch: [t for t in targets.compile_targets(arch) "
            "if t.precision == 'mxfp8' and t.direction == 'fwd' and t.mode == 'd64 full const_p'][:1]; "
            "sys.modules['one_target'] = m; "
            f"sys.exit(cc.run('sm_90a', {str(tmp_path)!r}))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "MXAttentionForwardSm90: wgmma=" in done.stdout and "1 passed, 0 failed" in done.stdout
    # one directory per build holds its PTX
    assert list((tmp_path / "attention-fwd-mxfp8-d64-full-const_p").glob("*MXAttentionForwardSm90*.ptx"))
