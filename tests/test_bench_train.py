"""benchmarks.bench_train at CPU test sizes: both precisions run with the same settings, the table and the JSON
give their ratios, and earlier runs are never overwritten."""
import json

import pytest

from benchmarks.bench_train import main


def test_tiny_sweep_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    result = main(["--tiny", "--steps", "4"])
    runs = result["runs"]
    assert runs["bf16"]["steps"] == runs["mxfp8"]["steps"] == 4
    assert result["samples_per_s_ratio"] == runs["mxfp8"]["samples_per_s"] / runs["bf16"]["samples_per_s"]
    assert result["eval_ne_diff_percent"] == pytest.approx(100 * (runs["mxfp8"]["eval_ne"] / runs["bf16"]["eval_ne"] - 1))
    assert json.loads((tmp_path / "bench_train.json").read_text())["samples_per_s_ratio"] == result["samples_per_s_ratio"]
    assert "mxfp8 / bf16: samples/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the runs' directories exist now
        main(["--tiny", "--steps", "4"])
    assert "already exist" in capsys.readouterr().err
