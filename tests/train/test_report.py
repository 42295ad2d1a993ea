"""Sweep report: pairs each MXFP8 run with the BF16 run whose config differs only in the precision, and lists the
runs it cannot pair and those without metrics.json."""
import json
from pathlib import Path

import pytest
import yaml

from gem_lp.report import curve_window, load_runs, ne_gaps, render_markdown, write_report
from gem_lp.report import main as report_main

from train_helpers import TINY, TRAIN_PY, run_cli

SWEEP_TINY = [*TINY, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_batches=1"]


def test_sweep_then_report_pairs_by_everything_but_the_precision(tmp_path, capsys):
    """The 2x2 sweep of precision and depth: each MXFP8 run against the BF16 run of its own depth."""
    sweep = tmp_path / "multirun"
    run_cli(TRAIN_PY, "-m", "model=gem_bf16,gem_mxfp8", "model.num_blocks=1,2", f"hydra.sweep.dir={sweep}",
            *SWEEP_TINY, cwd=tmp_path)
    metrics = {p.parent.name: json.loads(p.read_text()) for p in sweep.rglob("metrics.json")}
    assert sorted(metrics) == ["0_gem_bf16", "1_gem_bf16", "2_gem_mxfp8", "3_gem_mxfp8"]
    blocks = {name: yaml.safe_load((sweep / name / ".hydra" / "config.yaml").read_text())["model"]["num_blocks"]
              for name in metrics}
    assert blocks == {"0_gem_bf16": 1, "1_gem_bf16": 2, "2_gem_mxfp8": 1, "3_gem_mxfp8": 2}
    assert all((sweep / name / "train.log").read_text().count("eval loss") == 2 for name in metrics)

    assert report_main([str(sweep)]) == 0  # python -m gem_lp.report <sweep>
    out = capsys.readouterr()
    report = (sweep / "report.md").read_text()
    assert (sweep / "curves.png").stat().st_size > 10_000
    for mx, bf in (("2_gem_mxfp8", "0_gem_bf16"), ("3_gem_mxfp8", "1_gem_bf16")):
        gap = 100 * (metrics[mx]["eval_ne"] - metrics[bf]["eval_ne"]) / metrics[bf]["eval_ne"]
        assert f"| {mx} | {bf} | {gap:+.3f} |" in report
    assert "not paired" not in out.err and "Runs not paired" not in report
    assert "wrote" in out.out


def fake_run(root: Path, name: str, precision: str, ne: float, overrides: list[str], metrics: bool = True,
             config: dict | None = None):
    """A run directory as `train.py -m` leaves it: .hydra/{config,overrides}.yaml and (unless killed) metrics.json."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    config = config or {"model": {"precision": precision, "num_blocks": 1}, "trainer": {"lr": 0.005}, "seed": 0,
                        "resume": False}
    for o in overrides:
        key, value = o.split("=")
        if key == "model":
            continue
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if metrics:
        values = dict(precision=precision, steps=10, train_loss=0.5, eval_loss=0.4, eval_auc=0.7, eval_ne=ne,
                      samples_per_s=100.0, peak_mem_bytes=2**20, device="cpu", teacher_auc=0.8, teacher_ne=0.8)
        (d / "metrics.json").write_text(json.dumps(values))


def test_pairs_are_found_by_every_setting_but_the_precision(tmp_path):
    """The sweep order puts the 1-block BF16 run first; the 2-block MXFP8 run must still meet the 2-block BF16 run."""
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16", "model.num_blocks=1"])
    fake_run(tmp_path, "1", "bf16", 0.80, ["model=gem_bf16", "model.num_blocks=2"])
    fake_run(tmp_path, "2", "mxfp8", 0.909, ["model=gem_mxfp8", "model.num_blocks=1"])
    fake_run(tmp_path, "3", "mxfp8", 0.78, ["model=gem_mxfp8", "model.num_blocks=2"])
    fake_run(tmp_path, "4", "mxfp8", 0.70, ["model=gem_mxfp8", "model.num_blocks=1", "seed=3"])  # no partner
    runs, without_metrics = load_runs(tmp_path)
    gaps, unpaired = ne_gaps(runs)
    gaps = {g["mxfp8"]: g for g in gaps}
    assert set(gaps) == {"2", "3"} and without_metrics == []
    assert gaps["2"]["bf16"] == "0" and gaps["2"]["ne_gap_pct"] == pytest.approx(1.0)
    assert gaps["3"]["bf16"] == "1" and gaps["3"]["ne_gap_pct"] == pytest.approx(-2.5)
    assert unpaired == [{"run": "4", "reason": "no BF16 run with the same config but the precision"}]
    text = render_markdown(runs, list(gaps.values()), None, unpaired)
    assert "+1.000" in text and "-2.500" in text
    assert "## Runs not paired" in text and "| 4 | no BF16 run with the same config but the precision |" in text


def test_precision_given_as_a_key_pairs_as_well(tmp_path):
    fake_run(tmp_path, "a", "bf16", 0.90, ["model.precision=bf16", "trainer.lr=0.01"])
    fake_run(tmp_path, "b", "mxfp8", 0.99, ["model.precision=mxfp8", "trainer.lr=0.01"])
    fake_run(tmp_path, "c", "mxfp8", 0.99, ["model.precision=mxfp8", "trainer.lr=0.02"])
    gaps, unpaired = ne_gaps(load_runs(tmp_path)[0])
    assert [(g["mxfp8"], g["bf16"]) for g in gaps] == [("b", "a")]
    assert [u["run"] for u in unpaired] == ["c"]


def test_ambiguous_and_unpairable_runs_are_listed(tmp_path):
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16"])
    fake_run(tmp_path, "1", "bf16", 0.91, ["model=gem_bf16"])  # the same config twice
    fake_run(tmp_path, "2", "mxfp8", 0.92, ["model=gem_mxfp8"])
    fake_run(tmp_path, "3", "fp32", 0.92, ["model.precision=fp32"])
    (tmp_path / "2" / ".hydra" / "config.yaml").unlink()
    fake_run(tmp_path, "4", "mxfp8", 0.92, ["model=gem_mxfp8", "seed=1"])
    fake_run(tmp_path, "5", "bf16", 0.92, ["model=gem_bf16", "seed=1"])
    fake_run(tmp_path, "6", "bf16", 0.92, ["model=gem_bf16", "seed=1"])
    gaps, unpaired = ne_gaps(load_runs(tmp_path)[0])
    assert gaps == []
    reasons = {u["run"]: u["reason"] for u in unpaired}
    assert reasons["2"] == "no .hydra/config.yaml to pair it by"
    assert reasons["3"] == "precision fp32: only MXFP8 and BF16 are compared"
    assert reasons["4"] == "several BF16 runs with the same config: 5, 6"
    assert reasons["0"] == reasons["1"] == "no MXFP8 run with the same config but the precision"


def test_runs_without_metrics_are_listed_not_dropped(tmp_path, caplog):
    fake_run(tmp_path, "0_gem_bf16", "bf16", 0.90, ["model=gem_bf16"])
    fake_run(tmp_path, "1_gem_mxfp8", "mxfp8", 0.91, ["model=gem_mxfp8"], metrics=False)  # killed
    runs, without_metrics = load_runs(tmp_path)
    assert [r["name"] for r in runs] == ["0_gem_bf16"] and without_metrics == ["1_gem_mxfp8"]
    report = write_report(tmp_path).read_text()
    assert "## Runs without metrics.json" in report and "- 1_gem_mxfp8" in report
    assert "runs without metrics.json (killed, failed or still running): 1_gem_mxfp8" in caplog.text
    assert "0_gem_bf16: not paired" in caplog.text


def test_gaps_pair_runs_with_equal_model_keys(tmp_path):
    """`-m model=gem_bf16,gem_mxfp8 model.qk_rotation=null,hadamard`: each mxfp8 run against the bf16 run with
    its qk_rotation; model.precision counts as the precision choice too."""
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16", "model.qk_rotation=null"])
    fake_run(tmp_path, "1", "bf16", 0.80, ["model=gem_bf16", "model.qk_rotation=hadamard"])
    fake_run(tmp_path, "2", "mxfp8", 0.909, ["model=gem_mxfp8", "model.qk_rotation=null"])
    fake_run(tmp_path, "3", "mxfp8", 0.82, ["model=gem_mxfp8", "model.qk_rotation=hadamard"])
    fake_run(tmp_path, "4", "bf16", 0.70, ["model.precision=bf16", "model.num_blocks=2"])
    fake_run(tmp_path, "5", "mxfp8", 0.714, ["model.precision=mxfp8", "model.num_blocks=2"])
    gaps, unpaired = ne_gaps(load_runs(tmp_path)[0])
    gaps = {g["mxfp8"]: g for g in gaps}
    assert {name: g["bf16"] for name, g in gaps.items()} == {"2": "0", "3": "1", "5": "4"} and not unpaired
    assert gaps["3"]["ne_gap_pct"] == pytest.approx(2.5)


def test_gaps_pair_the_rotated_mxfp8_recipe_with_bf16(tmp_path):
    """`-m model=gem_bf16,gem_mxfp8`: gem_mxfp8 rotates q and k (model.qk_rotation=hadamard), gem_bf16 does not;
    with no BF16 run of the same rotation, the MXFP8 run pairs with the one that differs in it too."""
    def config(precision, rotation, num_blocks=1):
        return {"model": {"precision": precision, "qk_rotation": rotation, "num_blocks": num_blocks},
                "trainer": {"lr": 0.005}, "seed": 0, "resume": False}

    fake_run(tmp_path, "0_gem_bf16", "bf16", 0.80, ["model=gem_bf16"], config=config("bf16", None))
    fake_run(tmp_path, "1_gem_mxfp8", "mxfp8", 0.804, ["model=gem_mxfp8"], config=config("mxfp8", "hadamard"))
    fake_run(tmp_path, "2_gem_mxfp8", "mxfp8", 0.81, ["model=gem_mxfp8"], config=config("mxfp8", "hadamard", 2))
    gaps, unpaired = ne_gaps(load_runs(tmp_path)[0])
    assert [(g["mxfp8"], g["bf16"]) for g in gaps] == [("1_gem_mxfp8", "0_gem_bf16")]
    assert gaps[0]["ne_gap_pct"] == pytest.approx(0.5)
    assert unpaired == [{"run": "2_gem_mxfp8", "reason": "no BF16 run with the same config but the precision"}]


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no runs below"):
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
    runs, _ = load_runs(tmp_path)
    text = render_markdown(runs, ne_gaps(runs)[0], None)
    assert "1 (4 builds; a typical step: 250 samples/s)" in text
    fake_run(tmp_path / "clean", "0", "bf16", 0.90, ["model=gem_bf16"])
    assert "built during timed steps" not in render_markdown(load_runs(tmp_path / "clean")[0], [], None)


def test_real_data_runs_show_no_teacher(tmp_path):
    fake_run(tmp_path, "0", "bf16", 0.90, ["model=gem_bf16"])
    path = tmp_path / "0" / "metrics.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "teacher_auc": None, "teacher_ne": None}))
    text = render_markdown(load_runs(tmp_path)[0], [], None)
    assert "| 0.7000 | - | 0.9000 | - |" in text


def test_curves_smooth_over_the_train_loss_window_of_metrics_json():
    from gem_lp.train.trainer import TRAIN_LOSS_WINDOW

    assert curve_window([{"train_loss_window": TRAIN_LOSS_WINDOW}]) == TRAIN_LOSS_WINDOW == 50
    assert curve_window([{}]) == 50  # runs from before metrics.json recorded it
