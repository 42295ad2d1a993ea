"""Sweep report: a real two-run `train.py -m` sweep, then `python -m gem_lp.report` on it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gem_lp.report import load_runs, ne_gaps, render_markdown

ROOT = Path(__file__).resolve().parents[2]
TINY = ["experiment=smoke", "trainer.progress=false", "trainer.max_steps=6", "trainer.eval_every=3",
        "trainer.eval_batches=1", "data.batch_size=16", "data.history_max=20"]


def run(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_sweep_then_report(tmp_path):
    sweep = tmp_path / "multirun"
    run("train.py", "-m", "model=gem_bf16,gem_mxfp8", f"hydra.sweep.dir={sweep}", *TINY)
    runs = sorted(p.parent.name for p in sweep.rglob("metrics.json"))
    assert runs == ["0_gem_bf16", "1_gem_mxfp8"]

    out = run("-m", "gem_lp.report", str(sweep))
    report = (sweep / "report.md").read_text()
    assert (sweep / "curves.png").stat().st_size > 10_000
    bf16 = json.loads((sweep / "0_gem_bf16" / "metrics.json").read_text())
    mx = json.loads((sweep / "1_gem_mxfp8" / "metrics.json").read_text())
    gap = 100 * (mx["eval_ne"] - bf16["eval_ne"]) / bf16["eval_ne"]
    assert f"| 1_gem_mxfp8 | 0_gem_bf16 | {gap:+.3f} |" in report
    assert f"{bf16['eval_auc']:.4f}" in report and f"{mx['eval_ne']:.4f}" in report
    assert "wrote" in out.stdout


def fake_run(root: Path, name: str, precision: str, ne: float, overrides: list[str]):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    metrics = dict(precision=precision, steps=10, train_loss=0.5, eval_loss=0.4, eval_auc=0.7, eval_ne=ne,
                   samples_per_s=100.0, peak_mem_bytes=2**20, device="cpu", teacher_auc=0.8, teacher_ne=0.8)
    (d / "metrics.json").write_text(json.dumps(metrics))


def test_gaps_pair_runs_that_differ_only_in_the_model(tmp_path):
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16", "seed=1"])
    fake_run(tmp_path, "1", "mxfp8", 0.909, ["model=gem_mxfp8", "seed=1"])
    fake_run(tmp_path, "2", "bf16", 0.80, ["model=gem_bf16", "seed=2"])
    fake_run(tmp_path, "3", "mxfp8", 0.78, ["model=gem_mxfp8", "seed=2"])
    fake_run(tmp_path, "4", "mxfp8", 0.70, ["model=gem_mxfp8", "seed=3"])  # no bf16 partner
    runs = load_runs(tmp_path)
    gaps = {g["mxfp8"]: g for g in ne_gaps(runs)}
    assert set(gaps) == {"1", "3"}
    assert gaps["1"]["bf16"] == "0" and gaps["1"]["ne_gap_pct"] == pytest.approx(1.0)
    assert gaps["3"]["bf16"] == "2" and gaps["3"]["ne_gap_pct"] == pytest.approx(-2.5)
    text = render_markdown(runs, list(gaps.values()), None)
    assert "+1.000" in text and "-2.500" in text


def test_gaps_pair_runs_with_equal_model_keys(tmp_path):
    """`-m model=gem_bf16,gem_mxfp8 model.qk_rotation=null,hadamard`: each mxfp8 run against the bf16 run with
    its qk_rotation; model.precision counts as the precision choice too."""
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16", "model.qk_rotation=null"])
    fake_run(tmp_path, "1", "bf16", 0.80, ["model=gem_bf16", "model.qk_rotation=hadamard"])
    fake_run(tmp_path, "2", "mxfp8", 0.909, ["model=gem_mxfp8", "model.qk_rotation=null"])
    fake_run(tmp_path, "3", "mxfp8", 0.82, ["model=gem_mxfp8", "model.qk_rotation=hadamard"])
    fake_run(tmp_path, "4", "bf16", 0.70, ["model.precision=bf16", "model.num_blocks=2"])
    fake_run(tmp_path, "5", "mxfp8", 0.714, ["model.precision=mxfp8", "model.num_blocks=2"])
    gaps = {g["mxfp8"]: g for g in ne_gaps(load_runs(tmp_path))}
    assert {name: g["bf16"] for name, g in gaps.items()} == {"2": "0", "3": "1", "5": "4"}
    assert gaps["3"]["ne_gap_pct"] == pytest.approx(2.5)


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.json"):
        load_runs(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.json").write_text(json.dumps({"precision": "bf16"}))
    with pytest.raises(ValueError, match="lacks"):
        load_runs(tmp_path)


def test_report_flags_runs_with_builds_during_timed_steps(tmp_path):
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16"])
    fake_run(tmp_path, "1", "mxfp8", 0.91, ["model=gem_mxfp8"])
    path = tmp_path / "1" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics.update(kernel_builds_after_warmup=4, samples_per_s_median_step=250.0)
    path.write_text(json.dumps(metrics))
    runs = load_runs(tmp_path)
    text = render_markdown(runs, ne_gaps(runs), None)
    assert "1 (4 builds; a typical step: 250 samples/s)" in text
    fake_run(tmp_path / "clean", "0", "bf16", 0.90, ["model=gem_bf16"])
    assert "built during timed steps" not in render_markdown(load_runs(tmp_path / "clean"), [], None)
