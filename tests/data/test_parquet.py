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


def test_drop_last_gives_full_batches_only(logs):
    data = read_parquet(config(logs), logs)  # 23 rows
    dataset = ParquetRecDataset(data, batch_size=5, seed=1, shuffle=True, drop_last=True)
    assert dataset.batches_per_epoch == 4
    ages = {float(torch.tensor(a, dtype=torch.float32)) for a in rows()["age"]}  # one distinct age a row
    left_out = []
    for epoch in range(3):
        batches = [dataset.batch(epoch * 4 + j) for j in range(4)]
        assert [b.batch_size for b in batches] == [5, 5, 5, 5]
        seen = sum((b.dense_features[:, 0].tolist() for b in batches), [])
        assert len(set(seen)) == 20 and set(seen) <= ages
        left_out.append(ages - set(seen))
    assert len({frozenset(s) for s in left_out}) > 1  # shuffled: other rows left out in other epochs
    with pytest.raises(DataError, match="make no full batch of data.batch_size=24"):
        ParquetRecDataset(data, batch_size=24, seed=1, drop_last=True)


def test_iteration_resumes_at_any_batch_and_shards_over_workers(logs):
    data = read_parquet(config(logs), logs)
    dataset = ParquetRecDataset(data, batch_size=4, seed=3)
    expect = [dataset.batch(i).dense_features for i in range(3, 15)]
    resumed = ParquetRecDataset(data, batch_size=4, seed=3, start=3)
    loader = DataLoader(resumed, batch_size=None, num_workers=2)
    got = [b.dense_features for _, b in zip(range(12), loader)]
    assert all(torch.equal(x, y) for x, y in zip(got, expect))


def test_dense_features_are_standardized_by_the_training_rows(logs):
    raw = torch.tensor([[a, v] for a, v in zip(rows()["age"], rows()["visits"])], dtype=torch.float64)
    n_train = N - math.ceil(N * 0.2)
    mean, std = raw[:n_train].mean(0), raw[:n_train].std(0, unbiased=False)
    source = ParquetSource(config(logs), seed=0)
    torch.testing.assert_close(source.train_rows.dense, ((raw[:n_train] - mean) / std).float())
    torch.testing.assert_close(source.eval_rows.dense, ((raw[n_train:] - mean) / std).float())  # the train numbers
    scaling = source.fingerprint()["dense_standardized"]
    assert scaling["age"] == {"mean": pytest.approx(float(mean[0])), "std": pytest.approx(float(std[0]))}
    plain = ParquetSource(config(logs, dense_standardize=False), seed=0)
    assert torch.equal(plain.eval_rows.dense, raw[n_train:].float()) and plain.fingerprint()["dense_standardized"] is None


def test_the_last_rows_are_held_out_for_eval(logs, tmp_path):
    source = ParquetSource(config(logs), seed=0)
    n_eval = math.ceil(N * 0.2)
    assert len(source.train_rows) == N - n_eval and len(source.eval_rows) == n_eval
    evals = list(source.eval_batches())
    assert [b.batch_size for b in evals] == [5] and source.num_eval_rows == 5
    assert evals[0].labels.tolist() == rows()["label"][N - n_eval:]
    assert len(list(source.eval_batches(limit=1))) == 1
    other = write(tmp_path / "eval.parquet", rows(n=12, seed=5))
    source = ParquetSource(config(logs, eval_path=str(other)), seed=0)
    assert len(source.train_rows) == N and [b.batch_size for b in source.eval_batches()] == [5, 5, 2]
    assert [b.batch_size for b in source.eval_batches(limit=2)] == [5, 5] and source.num_eval_rows == 12


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
    (dict(pooled_features=[]), "data.pooled_features must list at least one"),
    (dict(eval_fraction=1.0), "data.eval_fraction must be in (0, 1)"),
    (dict(dense_features=["age", "age"]), "data.dense_features lists ['age'] more than once"),
    (dict(dense_features=["age", "label"]), "column 'label' is also ['dense_features']: the label cannot be a feature"),
    (dict(pooled_features=[ColumnFeature("label", 2)]), "the label cannot be a feature"),
    (dict(candidate_item="hist_item"), "must be two columns"),
    (dict(max_history=0), "data.max_history must be null (every event) or >= 1, got 0"),
    (dict(sort_by_time=True), "data.sort_by_time=true needs data.timestamp"),
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


def test_every_missing_setting_is_named_at_once(logs):
    with pytest.raises(ValueError, match=r"data=parquet needs data.path, data.num_items, data.pooled_features"):
        ParquetDataConfig()


def test_a_column_may_serve_two_roles(logs):
    """The candidate also as a pooled feature, a numeric id also as a dense feature: each role reads the same
    values."""
    cols = rows()
    cfg = config(logs, pooled_features=[ColumnFeature("cand_item", 50), ColumnFeature("segment", 7)],
                 dense_features=["age", "segment"])
    batch = read_parquet(cfg, logs).batch(torch.arange(N))
    assert batch.sparse_features.to_dict()["cand_item"].values().tolist() == cols["cand_item"]
    assert batch.sequence_features.to_dict()["cand_item"].values().tolist() == cols["cand_item"]
    assert batch.dense_features[:, 1].tolist() == [float(x) for x in cols["segment"]]


def test_no_dense_features(logs):
    batch = read_parquet(config(logs, dense_features=[]), logs).batch(torch.arange(4))
    assert batch.dense_features.shape == (4, 0) and config(logs, dense_features=[]).feature_spec().num_dense == 0


def test_max_history_keeps_the_most_recent_events(logs):
    cols = rows()
    data = read_parquet(config(logs, max_history=2), logs)
    seq = data.batch(torch.arange(N)).sequence_features.to_dict()
    assert seq["hist_item"].values().tolist() == sum((h[-2:] for h in cols["hist_item"]), [])
    assert seq["hist_action"].values().tolist() == sum((h[-2:] for h in cols["hist_action"]), [])
    assert seq["hist_item"].lengths().tolist() == [min(len(h), 2) for h in cols["hist_item"]]


def timed(path, times):
    cols = rows()
    cols["ts"] = times
    return write(path, cols)


def test_time_order_is_checked_or_sorted_never_assumed(tmp_path):
    times = list(range(N))
    times[9], times[10] = 10, 9  # row 10 is earlier than row 9
    path = timed(tmp_path / "shuffled.parquet", times)
    with pytest.raises(DataError, match=r"'ts': the rows are not in time order: row 10 \(t=9\) is earlier than the "
                                        r"row before it \(t=10\).*data.sort_by_time=true"):
        ParquetSource(config(path, timestamp="ts"), seed=0)
    source = ParquetSource(config(path, timestamp="ts", sort_by_time=True), seed=0)
    assert source.eval_rows.times.tolist() == list(range(N - 5, N))
    assert source.train_rows.times.tolist() == list(range(N - 5))
    assert source.train_rows.labels[9] == rows()["label"][10]  # the row moved with its time
    assert "sorted" in source.fingerprint()["eval_split"]
    # ties keep file order; timestamps of timestamp type compare in their unit
    stamps = pa.array([1_700_000_000_000 + 1000 * (i // 2) for i in range(N)], pa.timestamp("ms"))
    ok = ParquetSource(config(timed(tmp_path / "ties.parquet", stamps), timestamp="ts"), seed=0)
    assert len(ok.eval_rows) == 5


def test_eval_file_must_not_be_the_training_file(logs, tmp_path):
    with pytest.raises(DataError, match="is data.path"):
        ParquetSource(config(logs, eval_path=str(logs)), seed=0)
    directory = tmp_path / "logs"
    directory.mkdir()
    write(directory / "a.parquet", rows())
    with pytest.raises(DataError, match="is inside data.path"):
        ParquetSource(config(directory, eval_path=str(directory / "a.parquet")), seed=0)


def test_uint64_ids_are_reported_as_the_values_they_are(tmp_path):
    cols = rows()
    cols["cand_item"] = pa.array([0] * 3 + [2**63 + 5] + [0] * (N - 4), pa.uint64())
    path = write(tmp_path / "u64.parquet", cols)
    with pytest.raises(DataError, match=f"'cand_item': row 3 holds id {2**63 + 5}, outside"):
        read_parquet(config(path), path)
    cols = rows()
    cols["hist_item"] = pa.array([[1, 2**64 - 1]] + [[0]] * (N - 1), pa.list_(pa.uint64()))
    path = write(tmp_path / "u64_lists.parquet", cols)
    with pytest.raises(DataError, match=f"'hist_item': row 0 holds id {2**64 - 1}, outside"):
        read_parquet(config(path, event_features=[]), path)


def test_dense_values_outside_float32_are_errors(tmp_path):
    path = write(tmp_path / "big.parquet", broken("age", [0.0, 1e300] + [0.0] * (N - 2)))
    with pytest.raises(DataError, match="'age': row 1 holds 1e\\+300; outside float32's range"):
        read_parquet(config(path), path)


def test_errors_in_a_directory_name_the_file(tmp_path):
    directory = tmp_path / "logs"
    directory.mkdir()
    cols = broken("cand_item", [0] * 12 + [77] + [0] * (N - 13))
    write(directory / "part-0.parquet", {k: v[:10] for k, v in cols.items()})
    write(directory / "part-1.parquet", {k: v[10:] for k, v in cols.items()})
    with pytest.raises(DataError, match=r"row 12 \(part-1.parquet: row 2\) holds id 77"):
        read_parquet(config(directory), directory)


def test_fingerprint(logs, tmp_path):
    a = ParquetSource(config(logs), seed=0).fingerprint()
    assert a["source"] == "parquet" and a["rows"] == {"train": N - 5, "eval": 5} and a["files"] == [str(logs)]
    assert a["schema"]["hist_item"] == "list<element: int64>" and len(a["schema_hash"]) == 16
    reordered = config(logs, dense_features=["visits", "age"])
    assert ParquetSource(reordered, seed=0).fingerprint()["schema_hash"] == a["schema_hash"]
    cols = rows()
    cols["visits"] = [float(v) for v in cols["visits"]]
    other = write(tmp_path / "float_visits.parquet", cols)
    assert ParquetSource(config(other), seed=0).fingerprint()["schema_hash"] != a["schema_hash"]
