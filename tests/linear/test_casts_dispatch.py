"""`operands.casts` and `functions._norm_backward` on the CPU: the Triton kernels' call unless the CuTe kernel can run
and is chosen (the per-arch table `cute_cast_config.LINEAR_CASTS_FROM_K` and the dispatch table for the casts, the
dispatch table for the norm backward); what `casts` hands the CuTe launch and how it assembles the outputs (the
launch replaced by a recorder)."""
import types

import pytest
import torch

from gem_lp.linear import functions as tg
from gem_lp.linear import operands as lo
from gem_lp.mx.kernels import cute_cast_config
from gem_lp.mx.kernels import cute_cast_launch as cute_launch
from gem_lp.runtime import dispatch


def test_cpu_tensors_go_to_triton(monkeypatch):
    calls = []
    monkeypatch.setattr(lo, "rms_norm_mx", lambda x, w, eps, **kw: calls.append(kw) or "triton")
    x = torch.randn(8, 64)
    assert lo.casts(x, None, scaling="rceil", row_operand=True) == "triton"  # the table's choice, and a CPU tensor
    monkeypatch.setattr(cute_cast_config, "LINEAR_CASTS_FROM_K", {"sm_90a": (0, 0), "sm_100a": (0, 0)})
    assert lo.casts(x, None, scaling="rceil", row_operand=True) == "triton"  # a CPU tensor: the CuTe kernel cannot
    assert lo.casts(x, torch.ones(64), scaling="rceil", operand_dtype=torch.float32) == "triton"
    assert len(calls) == 3 and calls[0]["row_operand"] and calls[0]["rowwise"] and calls[0]["colwise"]


def test_cute_launch_gets_the_call_and_its_outputs_are_assembled(monkeypatch):
    seen = {}

    def record(x, weight, eps, **kw):
        seen.update(kw, eps=eps, weight=weight)
        M, K = x.shape
        blocked = torch.zeros(512, dtype=torch.uint8)
        return cute_launch.NormCastOutputs(
            None, None, torch.zeros(K, M, dtype=torch.uint8), blocked, torch.ones(M), torch.zeros(kw["operand_rows"], K),
            None, None)

    monkeypatch.setattr(lo, "_cute_cast", lambda x, weight: True)
    monkeypatch.setattr(cute_launch, "norm_mx_cast", record)
    x, g = torch.randn(8, 64), torch.ones(64)
    out = lo.casts(x, g, 1e-5, scaling="floor", rowwise=False, colwise=True, row_operand=True, operand_rows=16)
    assert seen == dict(scaling="floor", blocked_scales=True, rowwise=False, colwise=True, row_operand=True,
                        col_operand=False, operand_rows=16, column_sums=False, activation=None, eps=1e-5, weight=g)
    assert out.rowwise is None and out.col_operand is None and out.column_sums is None
    assert out.colwise.scale_layout == "blocked" and out.colwise.orig_dtype == torch.float32  # normalized: FP32 y
    assert out.colwise.scaling == "floor" and out.row_operand.shape == (16, 64) and out.rstd.shape == (8,)
    # the casts the CuTe kernel does not make: FP32 operands, an activation's gradient, a caller's row operand buffer
    monkeypatch.setattr(lo, "rms_norm_mx", lambda x, w, eps, **kw: "triton")
    seen.clear()
    assert lo.casts(x, g, scaling="rceil", row_operand=True, operand_dtype=torch.float32) == "triton"
    assert lo.casts(x, None, scaling="rceil", activation="silu", activation_input=x) == "triton"
    assert lo.casts(x, None, scaling="rceil", row_operand=True, row_operand_out=torch.empty(8, 64)) == "triton"
    assert not seen


def _on_gpu(K: int):
    """A stand-in for a CUDA tensor `[4, K]` as `_cute_cast` looks at it (the arch comes from `build_arch`)."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(4, K))


@pytest.fixture
def gpu_plan(monkeypatch):
    """`_cute_cast` on stand-in GPU tensors: `arch(name)` sets the device's arch, `cast_impl(name)` what the dispatch
    table gives `rms_norm_quantize` there (the ops it asks about are recorded in `asked`)."""
    state = types.SimpleNamespace(arch="sm_90a", impl="cute", asked=[])
    monkeypatch.setattr(lo, "build_arch", lambda device: state.arch)

    def choose(op, precision, device, backend="auto"):
        state.asked.append((op, precision))
        return state.impl

    monkeypatch.setattr(dispatch, "choose", choose)
    return state


def test_the_table_chooses_the_casts_from_their_width(gpu_plan, monkeypatch):
    from_k, plain_from_k = cute_cast_config.LINEAR_CASTS_FROM_K["sm_90a"]
    assert from_k is not None and plain_from_k is None  # measured: the norm's casts from K = 1024, no other
    g = torch.ones(from_k)
    assert lo._cute_cast(_on_gpu(from_k), g)
    assert gpu_plan.asked == [("rms_norm_quantize", "mxfp8")]
    assert lo._cute_cast(_on_gpu(4096), g)
    assert not lo._cute_cast(_on_gpu(from_k - 32), g[32:])
    assert not lo._cute_cast(_on_gpu(from_k), None)  # no norm: the Triton casts
    gpu_plan.impl = "triton"  # the plan does not take the CuTe cast (stack missing, self-check failed)
    assert not lo._cute_cast(_on_gpu(from_k), g)
    gpu_plan.impl = "cute"
    gpu_plan.arch = "sm_120a"  # no entry
    assert not lo._cute_cast(_on_gpu(from_k), g)
    gpu_plan.arch = "sm_100a"
    assert lo._cute_cast(_on_gpu(from_k), g) == (cute_cast_config.LINEAR_CASTS_FROM_K["sm_100a"][0] is not None)
    # tests force the CuTe kernel for every cast it can take through the table
    monkeypatch.setattr(cute_cast_config, "LINEAR_CASTS_FROM_K", {"sm_100a": (0, 0)})
    assert lo._cute_cast(_on_gpu(64), None) and lo._cute_cast(_on_gpu(64), torch.ones(64))
    assert not lo._cute_cast(_on_gpu(cute_cast_config.max_k() + 32), None)  # beyond the kernel's K
    monkeypatch.setattr(cute_cast_config, "LINEAR_CASTS_FROM_K", {"sm_100a": (None, None)})
    assert not lo._cute_cast(_on_gpu(4096), torch.ones(4096))


def test_the_norm_backward_goes_where_the_dispatch_table_says(monkeypatch):
    import gem_lp.norm.kernels as norm_kernels
    import gem_lp.norm.kernels.cute_backward as cute_backward
    import gem_lp.norm.kernels.triton_backward as triton_backward

    calls = []
    monkeypatch.setattr(triton_backward, "rms_norm_backward", lambda *a: calls.append("triton") or "triton")
    monkeypatch.setattr(cute_backward, "rms_norm_backward_cute", lambda *a: calls.append("cute") or "cute")
    args = (torch.randn(4, 256), torch.ones(256), torch.ones(4), torch.randn(4, 256))
    assert tg._norm_backward(*args) == "triton"  # CPU tensors: the Triton kernel in the interpreter
    with dispatch.emulate("sm_90"):  # the Hopper plan on the CPU: the kernels' CPU model, the reference
        dx, dw = tg._norm_backward(*args)
        assert dx.shape == (4, 256) and dw.shape == (256,)
    assert norm_kernels.rms_norm_backward(*args, "cute") == "triton"  # the CuTe kernel needs CUDA tensors
    assert calls == ["triton", "triton"]
    dx, dw = norm_kernels.rms_norm_backward(*args, "reference")
    assert dx.shape == (4, 256) and dw.shape == (256,) and calls == ["triton"] * 2
    # the implementation is the dispatch table's (on a GPU: its first choice that runs, cute on sm_90 / sm_100)
    impls = []
    monkeypatch.setattr(norm_kernels, "rms_norm_backward", lambda *a: impls.append(a[-1]) or "chosen")
    monkeypatch.setattr(dispatch, "choose", lambda op, precision, device, backend="auto": (
        "cute" if (op, precision) == ("rms_norm_backward", "fp32") else "?"))
    assert tg._norm_backward(*args) == "chosen" and impls == ["cute"]
    for arch in ("sm_90", "sm_100"):
        assert dispatch.TABLE[("rms_norm_backward", "fp32")][arch][0] == "cute"
