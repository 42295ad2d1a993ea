"""The mxfp8 attention error budget: its figures pinned, the targets and findings docs/numerics.md states, and the
recipe options it measures (`MXRecipe`)."""
import json
import math
from pathlib import Path

import pytest
import torch

from gem_lp.attention import attention_reference, jagged_attention, make_plan
from gem_lp.attention.error_budget import (
    INPUT_KINDS,
    TENSORS,
    VARIANTS,
    attention_with_grads,
    format_table,
    main,
    make_inputs,
    run_budget,
)
from gem_lp.attention.reference import MXRecipe

PINNED = Path(__file__).with_name("error_budget_d128.json")
TOLERANCE_DB = 0.5  # FP32 summation order may move a rounding; 0.5 dB is far below every effect the doc cites


@pytest.fixture(scope="module")
def rows():
    return run_budget()


def figures(rows, variant, kind, causal):
    (row,) = [r for r in rows if r["variant"] == variant and r["input"] == kind and r["causal"] == causal]
    return [row[t] for t in TENSORS]


def test_figures_are_pinned(rows):
    """Regenerate with `python -m gem_lp.attention.error_budget --json tests/attention/error_budget_d128.json`
    (after deleting the file) when the recipe changes on purpose, and update docs/numerics.md with it."""
    pinned = json.loads(PINNED.read_text())
    assert [(r["input"], r["causal"], r["variant"]) for r in rows] == \
           [(r["input"], r["causal"], r["variant"]) for r in pinned]
    off = []
    for got, want in zip(rows, pinned):
        for t in TENSORS:
            if not math.isclose(got[t], want[t], abs_tol=TOLERANCE_DB):
                off.append(f"{got['input']} causal={got['causal']} {got['variant']} {t}: {got[t]} (pinned {want[t]})")
    assert not off, "\n".join(off)


def test_suite_covers_every_input_causality_and_variant(rows):
    assert len(rows) == len(INPUT_KINDS) * 2 * len(VARIANTS)
    assert all(math.isfinite(r[t]) for r in rows for t in TENSORS)


@pytest.mark.parametrize("causal", [False, True])
def test_targets(rows, causal):
    """20x outlier channels with the rotation: O, dV >= 20 dB and dQ, dK at most 10 dB below BF16's (without
    rotation); randn: >= 20 dB for all four, rotation on or off."""
    bf16 = figures(rows, "bf16", "channels x20", causal)
    o, dq, dk, dv = figures(rows, "hadamard", "channels x20", causal)
    assert o >= 20 and dv >= 20
    assert dq >= bf16[1] - 10 and dk >= bf16[2] - 10
    for variant in ("mxfp8", "hadamard"):
        assert min(figures(rows, variant, "randn", causal)) >= 20


def test_findings_the_defaults_rest_on(rows):
    """What docs/numerics.md concludes from the table, checked on every input and both causalities."""
    for kind in INPUT_KINDS:
        for causal in (False, True):
            base = figures(rows, "mxfp8", kind.name, causal)
            # E4M3 rounding is relative: where a block's scale comes from does not matter above its subnormals,
            # so block orientation and consistency with the forward change nothing
            for variant in ("consistent Q/K", "seq Q/K + rowcol dS", "dynamic P"):
                got = figures(rows, variant, kind.name, causal)
                assert all(abs(a - b) <= 1.0 for a, b in zip(got, base)), (variant, kind.name, causal)
            # Δ from the quantized dO is never worse than LP-FA4's Δ from dO as given
            lp_fa4 = figures(rows, "Δ from dO as given (LP-FA4)", kind.name, causal)
            assert all(a >= b - 0.3 for a, b in zip(base, lp_fa4)), (kind.name, causal)
    for causal in (False, True):
        # with shared outlier channels, the rotation lifts O and dV by >= 10 dB and the Δ fix lifts its dQ by >= 4
        plain = figures(rows, "mxfp8", "channels x20", causal)
        rotated = figures(rows, "hadamard", "channels x20", causal)
        rotated_lp_fa4 = figures(rows, "hadamard, Δ from dO as given", "channels x20", causal)
        assert rotated[0] >= plain[0] + 10 and rotated[3] >= plain[3] + 10
        assert rotated[1] >= rotated_lp_fa4[1] + 4
        # K smoothing takes a K channel offset back to the randn figures
        smoothed = figures(rows, "K smoothing", "K offset 20", causal)
        randn = figures(rows, "mxfp8", "randn", causal)
        assert all(a >= b - 1.0 for a, b in zip(smoothed, randn))


def test_table_and_cli(rows, tmp_path, capsys, monkeypatch):
    table = format_table(rows, causal=True)
    assert table.splitlines()[0].startswith("| causal: O / dQ / dK / dV (dB) | randn |")
    assert len(table.splitlines()) == 2 + len(VARIANTS)
    import gem_lp.attention.error_budget as budget

    small = dict(kinds=INPUT_KINDS[:1], variants=VARIANTS[:3])
    monkeypatch.setattr(budget, "run_budget", lambda **kw: run_budget(**kw, **small))
    out = tmp_path / "rows.json"
    assert main(["--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 2 * 3
    assert "| bf16 |" in capsys.readouterr().out
    with pytest.raises(FileExistsError):  # never overwrites a result
        main(["--json", str(out)])


def test_inputs_are_deterministic_and_checked():
    a = make_inputs(INPUT_KINDS[2], dim=64, seed=3)
    b = make_inputs(INPUT_KINDS[2], dim=64, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    q = a[0]
    assert q[..., 9].abs().mean() > 10 * q[..., 10].abs().mean()
    from gem_lp.attention.error_budget import InputKind

    with pytest.raises(ValueError, match="unknown input kind 'spikes'"):
        make_inputs(InputKind("x", "spikes"))


# ----------------------------------------------------------------------------- the recipe options


ALL_OFF = dict(qk_forward=False, v=False, p=False, qk_backward=False, do=False, ds=False)


@pytest.mark.parametrize("options", [{}, dict(k_smoothing=True), dict(delta="p_dp"), dict(delta="o_do"),
                                     dict(qk_recompute="forward", qk_grad_blocks="seq", ds_blocks="rowcol")])
@pytest.mark.parametrize("causal", [False, True])
def test_every_point_off_is_the_fp32_recipe(options, causal):
    """With every quantization point off, each variant computes exact attention: the same O, LSE and gradients
    (through LSE too) as the fp32 recipe, up to FP32 rounding. For K smoothing this checks its LSE correction
    and its chain rule (dK through K - mean, dQ and dK through LSE's q.mean)."""
    g = torch.Generator().manual_seed(5)
    offs = torch.tensor([0, 45, 46, 116, 148])
    q, k, v = (torch.randn(148, 2, 64, generator=g).requires_grad_() for _ in range(3))
    k.data[..., 3] += 6.0  # a per-channel offset for the smoothing to remove
    d_out, d_lse = torch.randn(148, 2, 64, generator=g), torch.randn(148, 2, generator=g)
    plan = make_plan(offs, offs, broadcast_q=False, q_len=148, heads=2)
    results = []
    for precision, recipe in (("fp32", None), ("mxfp8", MXRecipe(**ALL_OFF, **options))):
        o, lse = attention_reference(q, k, v, plan, causal=causal, precision=precision, scale=0.125, recipe=recipe)
        loss = (o * d_out).sum() + (lse * d_lse).sum()
        results.append([o, lse, *torch.autograd.grad(loss, (q, k, v))])
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), *results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_k_smoothing_keeps_lse_and_output_of_the_recipe():
    """K smoothing under the full recipe: LSE still belongs to the original keys (within the recipe's error)."""
    q, k, v, d_out, offs = make_inputs(INPUT_KINDS[-1], dim=64)
    exact = jagged_attention(q, k, v, offs, precision="fp32", return_lse=True)
    plan = make_plan(offs, offs, broadcast_q=False, q_len=q.shape[0], heads=q.shape[1])
    o, lse = attention_reference(q, k, v, plan, causal=False, precision="mxfp8", scale=0.125,
                                 recipe=MXRecipe(k_smoothing=True))
    assert (lse - exact[1]).abs().max() < 0.05 and (o - exact[0]).abs().max() < 0.2


def test_recipe_arguments_checked():
    with pytest.raises(ValueError, match=r"MXRecipe.delta must be one of \('o_do_q', 'o_do', 'p_dp'\), got 'x'"):
        MXRecipe(delta="x")
    with pytest.raises(ValueError, match="MXRecipe.p_quant must be one of"):
        MXRecipe(p_quant="static")
    q = torch.randn(4, 1, 32)
    plan = make_plan(torch.tensor([0, 4]), torch.tensor([0, 4]), broadcast_q=False, q_len=4, heads=1)
    with pytest.raises(ValueError, match="p_quant='const_p' disagrees with recipe.p_quant='dynamic'"):
        attention_reference(q, q, q, plan, causal=False, precision="mxfp8", scale=1.0,
                            recipe=MXRecipe(p_quant="dynamic"))


def test_public_mxfp8_is_the_default_recipe():
    q, k, v, d_out, offs = make_inputs(INPUT_KINDS[2], dim=64)
    public = jagged_attention(q.requires_grad_(), k, v, offs, precision="mxfp8", causal=True)
    got = attention_with_grads(q, k, v, d_out, offs, causal=True, precision="mxfp8", recipe=MXRecipe())
    assert torch.equal(public, got[0])
    assert torch.equal(torch.autograd.grad(public, q, d_out)[0], got[1])
