"""The kernels' self-checks on CPU tensors (Triton's interpreter, torch's CPU GEMMs): they pass on correct kernels
and fail, naming the output, on a wrong one. On a GPU the same functions run first-use (tests/runtime/test_selfcheck.py)."""
import pytest
import torch

from gem_lp.runtime import dispatch

CPU = torch.device("cpu")


@pytest.mark.parametrize("spec", ["gem_lp.mx.selfchecks:quantize", "gem_lp.jagged.selfchecks:quantize_jagged",
                                  "gem_lp.norm.selfchecks:backward_triton"])
def test_self_check_passes_on_the_cpu(spec):
    out = dispatch.entry(spec)(CPU)
    assert out["passed"], out["summary"]
    assert "repeatable" in out["summary"] and "NOT" not in out["summary"]


def test_norm_backward_self_check_fails_on_a_wrong_kernel(monkeypatch):
    import gem_lp.norm.kernels as kernels

    right = kernels.rms_norm_backward

    def wrong(x, w, rstd, dy, impl):
        dx, dw = right(x, w, rstd, dy, impl)
        return dx * 1.5, dw

    monkeypatch.setattr(kernels, "rms_norm_backward", wrong)
    out = dispatch.entry("gem_lp.norm.selfchecks:backward_triton")(CPU)
    assert not out["passed"]
    assert "(dx, max error" in out["summary"] and out["sqnr_db"] < 40


def test_jagged_self_check_fails_on_a_wrong_kernel(monkeypatch):
    import gem_lp.jagged.ops as ops

    right = ops.quantize_jagged

    def wrong(*args, backend="auto", **kw):
        got = right(*args, backend=backend, **kw)
        if backend == "triton":
            got.scale_seq.view(torch.uint8)[..., :1] += 1
        return got

    monkeypatch.setattr(ops, "quantize_jagged", wrong)
    out = dispatch.entry("gem_lp.jagged.selfchecks:quantize_jagged")(CPU)
    assert not out["passed"] and "scale_seq" in out["summary"]


def test_sm100_attention_self_check_passes_on_the_kernels_cpu_model():
    """The check a Blackwell GPU runs first, here on the emulated plan (the kernels' CPU model)."""
    with dispatch.emulate("sm_100"):
        out = dispatch.entry("gem_lp.attention.selfchecks:mxfp8_sm100")(CPU)
    assert out["passed"], out["summary"]
    assert "NOT" not in out["summary"]
