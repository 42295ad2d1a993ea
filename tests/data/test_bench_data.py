"""benchmarks.bench_data at CPU test sizes: the Parquet file holds the synthetic batches themselves, and the
benchmark runs train.py on both sources and reports their ratio."""
import json

import pytest
import torch

pytest.importorskip("pyarrow")

from benchmarks.bench_data import main, synthetic_config, write_synthetic_parquet  # noqa: E402
from gem_lp.data import ParquetDataConfig, ParquetSource, SyntheticRecDataset  # noqa: E402


def test_the_parquet_rows_are_the_synthetic_batches(tmp_path):
    cfg = synthetic_config("cpu", ["data.batch_size=16"])
    data = write_synthetic_parquet(cfg, 40, tmp_path / "s.parquet")
    source = ParquetSource(ParquetDataConfig(**data, shuffle=False, eval_fraction=0.2), seed=0)
    parquet = [source.train_dataset(0).batch(i) for i in range(2)]
    synthetic = list(SyntheticRecDataset(cfg, 0, "train", num_batches=2))
    for p, s in zip(parquet, synthetic):
        assert torch.equal(p.labels, s.labels) and torch.equal(p.dense_features, s.dense_features)
        for kjt in ("sequence_features", "sparse_features"):
            a, b = getattr(p, kjt).to_dict(), getattr(s, kjt).to_dict()
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key].values(), b[key].values()) and torch.equal(a[key].lengths(), b[key].lengths())


def test_tiny_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    result = main(["--tiny", "--steps", "6", "--rows", "64", "--no-warmup"])
    assert result["runs"]["synthetic"]["steps"] == result["runs"]["parquet"]["steps"] == 6
    assert result["ratio"] > 0 and json.loads((tmp_path / "bench_data.json").read_text())["ratio"] == result["ratio"]
    assert "parquet / synthetic:" in capsys.readouterr().out
