"""The op x arch table: plans per arch, what a missing toolchain or a failed self-check does to them, backend
resolution and its errors, one warning per reference fallback on a GPU."""
import warnings

import pytest
import torch

from gem_lp.runtime import dispatch, selfcheck

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh():
    dispatch.clear()
    dispatch._VERDICTS.clear()
    yield
    dispatch.clear()
    dispatch._VERDICTS.clear()


def _plan(arch, **kw):
    return {(c.op, c.precision): c for c in dispatch.plan(arch, **kw)}


def test_every_op_has_a_line_per_arch_and_the_cpu_runs_the_reference():
    for arch in dispatch.ARCHES:
        plan = _plan(arch)
        assert set(plan) == set(dispatch.TABLE)
        for (op, precision), c in plan.items():
            assert c.impl in dispatch.IMPLS[(op, precision)]
            assert c.line().startswith(op)
    assert all(c.impl == "reference" for c in _plan("cpu").values())


def test_gpu_plans_take_the_kernels():
    sm90, sm100, other = _plan("sm_90"), _plan("sm_100"), _plan("cuda")
    assert sm90[("attention", "mxfp8")].impl == "cute_sm90" and sm100[("attention", "mxfp8")].impl == "cute_sm100"
    assert sm90[("attention", "bf16")].impl == sm100[("attention", "bf16")].impl == "fa4"
    assert sm90[("linear", "mxfp8")].impl == "cublas" and sm100[("linear", "mxfp8")].impl == "scaled_mm"
    assert other[("attention", "mxfp8")].impl == "reference" and "no kernel for cuda" in other[
        ("attention", "mxfp8")].why
    assert other[("linear", "mxfp8")].impl == "cublas" and other[("quantize_dual", "mxfp8")].impl == "triton"


def test_a_missing_toolchain_moves_its_rows_to_the_next_implementation():
    plan = _plan("sm_90", hidden=frozenset({"cute"}))
    assert plan[("quantize_dual", "mxfp8")].impl == "triton"
    assert "cute: cute not available" in plan[("quantize_dual", "mxfp8")].why
    assert plan[("attention", "mxfp8")].impl == "reference"
    assert plan[("rms_norm", "bf16")].impl == "reference"  # torch's F.rms_norm
    plan = _plan("sm_100", hidden=frozenset({"cute", "triton"}))
    assert all(c.impl == "reference" for c in plan.values())
    assert "scaled_mm: triton not available" in plan[("linear", "mxfp8")].why


def test_a_failed_self_check_moves_the_op_on():
    key = dispatch.impl_key("quantize_dual", "mxfp8", "cute", "sm_90")
    dispatch._VERDICTS[key] = selfcheck.Verdict(False, "3 of 24 cases differ")
    c = dispatch.plan_choice("quantize_dual", "mxfp8", "sm_90")
    assert c.impl == "triton" and "cute: self-check failed: 3 of 24 cases differ" in c.why
    dispatch._VERDICTS[key] = selfcheck.Verdict(True, "unchecked", checked=False)
    assert dispatch.plan_choice("quantize_dual", "mxfp8", "sm_90").impl == "cute"


def test_backend_resolution_on_the_cpu(monkeypatch):
    assert dispatch.choose("attention", "mxfp8", CPU) == "reference"
    assert dispatch.choose("attention", "mxfp8", CPU, "reference") == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.choose("attention", "mxfp8", CPU, "cuda")
    with pytest.raises(ValueError, match="backend='cute' cannot run attention: it needs CUDA tensors, got cpu"):
        dispatch.choose("attention", "mxfp8", CPU, "cute")
    with pytest.raises(ValueError, match="no table entry for op"):
        dispatch.choose("conv", "mxfp8", CPU)
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: True)
    assert dispatch.choose("quantize_dual", "mxfp8", CPU, "triton") == "triton"
    assert dispatch.choose("linear", "mxfp8", CPU, "triton") == "cublas"
    with pytest.raises(ValueError, match="backend='triton' is not available for attention"):
        dispatch.choose("attention", "mxfp8", CPU, "triton")
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: False)
    dispatch.clear()
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        dispatch.choose("quantize_dual", "mxfp8", CPU, "triton")


def test_one_warning_per_reference_fallback_on_a_gpu(monkeypatch):
    """A GPU without kernels for an op (here an sm_120-class GPU, faked) warns once, naming op, arch and why."""
    monkeypatch.setattr(dispatch, "arch_of", lambda device: "cuda" if device.type == "cuda" else "cpu")
    gpu = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert dispatch.choose("attention", "mxfp8", gpu) == "reference"
            dispatch._CHOSEN.clear()
        assert dispatch.choose("rms_norm", "bf16", gpu) == "reference"  # torch's kernel: no fallback, no warning
        assert dispatch.choose("attention", "fp32", gpu) == "reference"  # the oracle precision: no warning
    msgs = [str(w.message) for w in caught]
    assert msgs == ["gem_lp: attention (mxfp8) on cuda runs the plain-PyTorch reference on cuda: no kernel for cuda"]


def test_emulated_plans_on_cpu_tensors():
    """CPU tensors under `emulate(arch)` take that arch's plan, each kernel as its CPU model (the CuTe ones where
    they have one, the next implementation where not)."""
    with dispatch.emulate("sm_100"):
        assert dispatch.emulated_arch() == "sm_100"
        assert dispatch.choose("linear", "mxfp8", CPU) == "scaled_mm"
        assert dispatch.choose("attention", "mxfp8", CPU) == "cute_sm100"
        assert dispatch.choose("quantize_dual", "mxfp8", CPU) == "triton"  # the CuTe cast has no CPU model
        assert dispatch.choose("attention", "bf16", CPU) == "reference"
    assert dispatch.emulated_arch() is None
    assert dispatch.choose("linear", "mxfp8", CPU) == "reference"
    with pytest.raises(ValueError, match="arch must be"):
        with dispatch.emulate("sm_120"):
            pass


def test_kernel_plan_records_choices():
    plan = dispatch.kernel_plan([("linear", "mxfp8"), ("attention", "mxfp8")], CPU)
    assert [(c["op"], c["impl"], c["capture_safe"]) for c in plan] == [("linear", "reference", True),
                                                                        ("attention", "reference", False)]
    assert all(c["self_check"] is None and c["arch"] == "cpu" for c in plan)
