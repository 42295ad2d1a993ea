"""Parquet source: rows read into RecBatches exactly, checked columns, epochs and resumable positions, training."""
import math

import pytest
import torch
from torch.utils.data import DataLoader

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gem_lp.data import (ColumnFeature, DataError, ParquetDataConfig, ParquetRecDataset, ParquetSource,  # noqa: E402
                         read_parquet)

N = 23


def rows(n=N, seed=0):
    """Plain Python columns of `n` samples: a history with an aligned action list, a candidate, a pooled id, a
    pooled id list, two dense features and a label that depends on the candidate."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (n,), generator=g).tolist()
    hist = [torch.randint(0, 50, (k,), generator=g).tolist() for k in lengths]
    return {
        "label": [float(i % 3 == 0) for i in range(n)],
        "hist_item": hist,
        "hist_action": [[(x + 1) % 4 for x in h] for h in hist],
        "cand_item": torch.randint(0, 50, (n,), generator=g).tolist(),
        "segment": torch.randint(0, 7, (n,), generator=g).tolist(),
        "tags": [torch.randint(0, 9, (k,), generator=g).tolist() for k in torch.randint(0, 4, (n,), generator=g)],
        "age": torch.rand(n, generator=g).tolist(),
        "visits": torch.randint(0, 100, (n,), generator=g).tolist(),
    }


def write(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def config(path, **kw):
    base = dict(path=str(path), num_items=50, batch_size=5, eval_fraction=0.2,
                event_features=[ColumnFeature("hist_action", 4)],
                pooled_features=[ColumnFeature("segment", 7), ColumnFeature("tags", 9)],
                dense_features=["age", "visits"])
    return ParquetDataConfig(**{**base, **kw})


@pytest.fixture
def logs(tmp_path):
    return write(tmp_path / "logs.parquet", rows())


def test_rows_become_the_batch_the_model_reads(logs):
    cols = rows()
    data = read_parquet(config(logs), logs)
    assert len(data) == N
    picked = [7, 0, 19, 3]
    batch = data.batch(torch.tensor(picked))
    seq = batch.sequence_features.to_dict()
    assert batch.sequence_features.keys() == ["hist_item", "hist_action", "cand_item"]
    assert seq["hist_item"].values().tolist() == sum((cols["hist_item"][i] for i in picked), [])
    assert seq["hist_item"].lengths().tolist() == [len(cols["hist_item"][i]) for i in picked]
    assert seq["hist_action"].values().tolist() == sum((cols["hist_action"][i] for i in picked), [])
    assert seq["cand_item"].values().tolist() == [cols["cand_item"][i] for i in picked]
    sparse = batch.sparse_features.to_dict()
    assert sparse["segment"].values().tolist() == [cols["segment"][i] for i in picked]
    assert sparse["tags"].values().tolist() == sum((cols["tags"][i] for i in picked), [])
    assert sparse["tags"].lengths().tolist() == [len(cols["tags"][i]) for i in picked]
    expect_dense = torch.tensor([[cols["age"][i], cols["visits"][i]] for i in picked], dtype=torch.float32)
    assert torch.equal(batch.dense_features, expect_dense)
    assert batch.labels.tolist() == [cols["label"][i] for i in picked] and batch.teacher_logits is None


def test_epochs_visit_every_row_once_keeping_the_remainder(logs):
    data = read_parquet(config(logs), logs)
    for shuffle in (False, True):
        dataset = ParquetRecDataset(data, batch_size=5, seed=1, shuffle=shuffle)
        assert dataset.batches_per_epoch == 5
        for epoch in range(2):
            batches = [dataset.batch(epoch * 5 + j) for j in range(5)]
            assert [b.batch_size for b in batches] == [5, 5, 5, 5, 3]
            seen = sorted(sum((b.sequence_features.to_dict()["cand_item"].values().tolist() for b in batches), []))
            assert seen == sorted(rows()["cand_item"])
    ordered = ParquetRecDataset(data, batch_size=5, seed=1, shuffle=False)
    assert ordered.batch(0).labels.tolist() == rows()["label"][:5]
    a, b = ParquetRecDataset(data, 5, seed=1).batch(0), ParquetRecDataset(data, 5, seed=1).batch(5)
    assert not torch.equal(a.dense_features, b.dense_features[:5])  # a new order each epoch


def test_iteration_resumes_at_any_batch_and_shards_over_workers(logs):
    data = read_parquet(config(logs), logs)
    dataset = ParquetRecDataset(data, batch_size=4, seed=3)
    expect = [dataset.batch(i).dense_features for i in range(3, 15)]
    resumed = ParquetRecDataset(data, batch_size=4, seed=3, start=3)
    loader = DataLoader(resumed, batch_size=None, num_workers=2)
    got = [b.dense_features for _, b in zip(range(12), loader)]
    assert all(torch.equal(x, y) for x, y in zip(got, expect))


def test_the_last_rows_are_held_out_for_eval(logs, tmp_path):
    source = ParquetSource(config(logs), seed=0)
    n_eval = math.ceil(N * 0.2)
    assert len(source.train_rows) == N - n_eval and len(source.eval_rows) == n_eval
    evals = source.eval_batches(limit=10)
    assert [b.batch_size for b in evals] == [5]
    assert evals[0].labels.tolist() == rows()["label"][N - n_eval:]
    assert len(source.eval_batches(limit=1)) == 1
    other = write(tmp_path / "eval.parquet", rows(n=12, seed=5))
    source = ParquetSource(config(logs, eval_path=str(other)), seed=0)
    assert len(source.train_rows) == N and [b.batch_size for b in source.eval_batches(10)] == [5, 5, 2]


def broken(column, values):
    cols = rows()
    cols[column] = values
    return cols


@pytest.mark.parametrize("columns, message", [
    (broken("label", [2.0] + [0.0] * (N - 1)), "'label': labels must be 0 or 1, row 0 holds 2.0"),
    (broken("label", [None] + [0.0] * (N - 1)), "'label': row 0 is null"),
    (broken("cand_item", [0] * 4 + [50] + [0] * (N - 5)), "'cand_item': row 4 holds id 50, outside [0, 50)"),
    (broken("segment", [0] * 2 + [-1] + [0] * (N - 3)), "'segment': row 2 holds id -1, outside [0, 7)"),
    (broken("hist_item", [[1], [2, 3], [4, 99]] + [[0]] * (N - 3)), "'hist_item': row 2 holds id 99, outside [0, 50)"),
    (broken("tags", [[1], [None]] + [[0]] * (N - 2)), "'tags': row 1 holds a null id"),
    (broken("hist_action", [[1, 2, 3]] + [[]] * (N - 1)), "'hist_action': row 0 holds 3 ids, its 'hist_item' list"),
    (broken("age", [float("nan")] * N), "'age': row 0 holds nan; dense features must be finite"),
    (broken("age", ["x"] * N), "'age' must be numeric, got type string"),
    (broken("cand_item", [1.5] * N), "'cand_item' must hold integer ids, got type double"),
])
def test_bad_columns_are_errors_naming_column_and_row(tmp_path, columns, message):
    path = write(tmp_path / "bad.parquet", columns)
    with pytest.raises(DataError) as info:
        read_parquet(config(path), path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_columns_and_files(tmp_path, logs):
    cols = rows()
    del cols["visits"]
    path = write(tmp_path / "short.parquet", cols)
    with pytest.raises(DataError, match=r"lacks the columns \['visits'\]"):
        read_parquet(config(path), path)
    with pytest.raises(FileNotFoundError, match="no Parquet file or directory"):
        read_parquet(config(logs), tmp_path / "nothing.parquet")
    with pytest.raises(DataError, match="too few to hold out"):
        ParquetSource(config(write(tmp_path / "one.parquet", rows(n=1))), seed=0)


@pytest.mark.parametrize("bad, message", [
    (dict(dense_features=[]), "data.dense_features must list at least one"),
    (dict(pooled_features=[]), "data.pooled_features must list at least one"),
    (dict(eval_fraction=1.0), "data.eval_fraction must be in (0, 1)"),
    (dict(dense_features=["age", "segment"]), "used twice: ['segment']"),
    (dict(pooled_features=[ColumnFeature("segment", 0)]), "column 'segment' needs num_embeddings >= 1"),
])
def test_config_errors(logs, bad, message):
    with pytest.raises(ValueError) as info:
        config(logs, **bad)
    assert message in str(info.value)


def test_directory_of_files(tmp_path):
    directory = tmp_path / "logs"
    directory.mkdir()
    cols = rows()
    write(directory / "part-0.parquet", {k: v[:10] for k, v in cols.items()})
    write(directory / "part-1.parquet", {k: v[10:] for k, v in cols.items()})
    data = read_parquet(config(directory), directory)
    assert len(data) == N
    assert data.batch(torch.arange(N)).sequence_features.to_dict()["cand_item"].values().tolist() == cols["cand_item"]
