"""`triton_gemm._casts` and `_norm_backward` on the CPU: the Triton kernels' call unless the CuTe kernel can run and is
chosen (`CUTE_CASTS` / `CUTE_NORM_BACKWARD`, else the per-arch tables); what `_casts` hands the CuTe launch and how it
assembles the outputs (the launch replaced by a recorder)."""
import torch

from gem_lp.mx.kernels import cute_cast_launch as cute_launch
from gem_lp.linear import functions as tg


def test_off_or_not_runnable_goes_to_triton(monkeypatch):
    calls = []
    monkeypatch.setattr(tg, "rms_norm_mx", lambda x, w, eps, **kw: calls.append(kw) or "triton")
    x = torch.randn(8, 64)
    assert tg._casts(x, None, scaling="rceil", row_operand=True) == "triton"  # the table's choice, and a CPU tensor
    monkeypatch.setattr(tg, "CUTE_CASTS", True)
    assert tg._casts(x, None, scaling="rceil", row_operand=True) == "triton"  # a CPU tensor: the CuTe kernel cannot
    assert tg._casts(x, None, scaling="rceil", operand_dtype=torch.float32) == "triton"
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

    monkeypatch.setattr(tg, "CUTE_CASTS", True)
    monkeypatch.setattr(tg, "_cute_norm_runs", lambda x: True)
    monkeypatch.setattr(cute_launch, "norm_mx_cast", record)
    x, g = torch.randn(8, 64), torch.ones(64)
    out = tg._casts(x, g, 1e-5, scaling="floor", rowwise=False, colwise=True, row_operand=True, operand_rows=16)
    assert seen == dict(scaling="floor", blocked_scales=True, rowwise=False, colwise=True, row_operand=True,
                        col_operand=False, operand_rows=16, column_sums=False, activation=None, eps=1e-5, weight=g)
    assert out.rowwise is None and out.col_operand is None and out.column_sums is None
    assert out.colwise.scale_layout == "blocked" and out.colwise.orig_dtype == torch.float32  # normalized: FP32 y
    assert out.colwise.scaling == "floor" and out.row_operand.shape == (16, 64) and out.rstd.shape == (8,)


def test_the_table_chooses_the_norm_casts_from_its_width(monkeypatch):
    monkeypatch.setattr(tg, "_cute_norm_runs", lambda x: True)
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_90a")
    from_k = tg.CUTE_NORM_CASTS_FROM_K["sm_90a"]
    g = torch.ones(from_k)
    assert tg._cute_cast(torch.randn(4, from_k), g)
    assert not tg._cute_cast(torch.randn(4, from_k - 32), g[32:])
    assert not tg._cute_cast(torch.randn(4, from_k), None)  # no norm: the Triton casts
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_100a")  # not measured there
    assert not tg._cute_cast(torch.randn(4, from_k), g)
    monkeypatch.setattr(tg, "CUTE_CASTS", True)
    assert tg._cute_cast(torch.randn(4, 64), None)
    monkeypatch.setattr(tg, "CUTE_CASTS", False)
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_90a")
    assert not tg._cute_cast(torch.randn(4, from_k), g)


def test_the_norm_backward_goes_where_its_table_says(monkeypatch):
    import gem_lp.norm.kernels.cute_backward as cute_backward

    calls = []
    monkeypatch.setattr(tg, "rms_norm_backward", lambda *a: calls.append("triton") or "triton")
    monkeypatch.setattr(cute_backward, "rms_norm_backward_cute", lambda *a: calls.append("cute") or "cute")
    args = (torch.randn(4, 256), torch.ones(256), torch.ones(4), torch.randn(4, 256))
    assert tg._norm_backward(*args) == "triton"  # a CPU tensor
    monkeypatch.setattr(tg, "_cute_norm_runs", lambda x: True)
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_90a")
    monkeypatch.setattr(tg, "CUTE_NORM_BACKWARD_ARCHES", ("sm_90a",))
    assert tg._norm_backward(*args) == "cute"
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_100a")  # not in the table
    assert tg._norm_backward(*args) == "triton"
    monkeypatch.setattr(tg, "CUTE_NORM_BACKWARD", True)
    assert tg._norm_backward(*args) == "cute"
    monkeypatch.setattr(tg, "CUTE_NORM_BACKWARD", False)
    monkeypatch.setattr(tg, "_arch", lambda x: "sm_90a")
    assert tg._norm_backward(*args) == "triton"
    assert calls == ["triton", "cute", "triton", "cute", "triton"]
