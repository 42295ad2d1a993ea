"""build_sequences: every event's history is its user's strictly earlier events (most recent max_history, oldest
first), checked against a plain-Python reference on generated logs; splits, ids and maps, side tables, CSV and
Parquet, streaming through small buckets and batches, and errors naming the row."""
import json
import math
import random

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pcsv = pytest.importorskip("pyarrow.csv")

from gem_lp.data import DataError  # noqa: E402
from gem_lp.data.build_sequences import BuildOptions, build_sequences, main, train_command  # noqa: E402


def make_log(n=400, users=30, seed=0):
    """Events of `users` users (user 'u0' has exactly one event), times with many ties, in shuffled order; each
    event has its own item id, so a history's items name the events it holds."""
    rng = random.Random(seed)
    rows = [{"user_id": 1000 + rng.randrange(1, users), "item_id": 50_000 + i, "timestamp": rng.randrange(40),
             "rating": rng.randrange(1, 6), "device": rng.choice(["ios", "android", None])} for i in range(n)]
    rows.append({"user_id": 1000, "item_id": 50_000 + n, "timestamp": 7, "rating": 5, "device": "web"})
    rng.shuffle(rows)
    return rows


def write_parquet(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def reference(rows, max_history, eval_of):
    """{(user, item): (label, history items, history ratings, is_eval)} from first principles."""
    out = {}
    for i, e in enumerate(rows):
        earlier = sorted(((o["timestamp"], j, o) for j, o in enumerate(rows)
                          if o["user_id"] == e["user_id"] and o["timestamp"] < e["timestamp"]), key=lambda x: x[:2])
        earlier = [o for _, _, o in earlier][-max_history:] if max_history else [o for _, _, o in earlier]
        out[(e["user_id"], e["item_id"])] = (int(e["rating"] >= 4), [o["item_id"] for o in earlier],
                                             [o["rating"] for o in earlier], eval_of(i, e))
    return out


def built(out):
    """{(user, item): (label, history items, history ratings, is_eval)} of a build's output, in original ids."""
    users = pq.read_table(out / "maps" / "user.parquet").column("value").to_pylist()
    items = pq.read_table(out / "maps" / "item.parquet").column("value").to_pylist()
    rating_map = pq.read_table(out / "maps" / "rating.parquet")
    ratings = dict(zip(rating_map.column("id").to_pylist(), rating_map.column("value").to_pylist()))
    got = {}
    for split in ("train", "eval"):
        for r in pq.read_table(out / f"{split}.parquet").to_pylist():
            key = (int(users[r["user"]]), int(items[r["cand_item"]]))
            assert key not in got
            got[key] = (r["label"], [int(items[i]) for i in r["hist_item"]],
                        [int(ratings[x]) for x in r["hist_rating"]], split == "eval")
    return got


def options(log, out, **kw):
    return BuildOptions(**{**dict(log=str(log), out=str(out), rating="rating", threshold=4, event_columns=("rating",),
                                  max_history=5, eval_from="30"), **kw})


@pytest.fixture(scope="module")
def log_rows():
    return make_log()


@pytest.mark.parametrize("split, extra", [("global", {}), ("user", dict(eval_from=None, eval_fraction=0.25))])
def test_histories_and_splits_match_the_reference(tmp_path, log_rows, split, extra):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    build_sequences(options(log, tmp_path / "out", split=split, **extra), log=lambda _: None)
    got = built(tmp_path / "out")
    if split == "global":
        def eval_of(i, e):
            return e["timestamp"] >= 30
    else:
        per_user = {}
        for j, o in enumerate(log_rows):
            per_user.setdefault(o["user_id"], []).append((o["timestamp"], j))
        rank = {}
        for u, events in per_user.items():
            n = len(events)
            last = math.ceil(0.25 * n) if n >= 2 else 0
            for k, (_, j) in enumerate(sorted(events)):
                rank[j] = k >= n - last

        def eval_of(i, e):
            return rank[i]
    assert got == reference(log_rows, 5, eval_of)
    assert got[(1000, 50_400)] == (1, [], [], False)  # the user of one event: no history, trained on


def test_no_event_sees_itself_a_later_event_or_one_at_the_same_time(tmp_path, log_rows):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    build_sequences(options(log, tmp_path / "out", max_history=None), log=lambda _: None)
    time_of = {e["item_id"]: e["timestamp"] for e in log_rows}
    got = built(tmp_path / "out")
    assert sum(len(h) for _, h, _, _ in got.values()) > 1000
    for (_, item), (_, history, _, _) in got.items():
        assert all(time_of[h] < time_of[item] for h in history)
        assert [time_of[h] for h in history] == sorted(time_of[h] for h in history)


def test_equal_times_are_ordered_by_position_in_the_log(tmp_path):
    rows = [{"user_id": 1, "item_id": i, "timestamp": t, "rating": 5} for i, t in
            [(10, 1), (11, 1), (12, 1), (13, 2), (14, 2), (15, 3)]]
    log = write_parquet(rows, tmp_path / "ties.parquet")
    build_sequences(options(log, tmp_path / "out", event_columns=(), max_history=4, eval_from="3"), log=lambda _: None)
    items = pq.read_table(tmp_path / "out" / "maps" / "item.parquet").column("value").to_pylist()
    table = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    table += pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist()
    hist = {items[r["cand_item"]]: [items[i] for i in r["hist_item"]] for r in table}
    assert hist == {10: [], 11: [], 12: [], 13: [10, 11, 12], 14: [10, 11, 12], 15: [11, 12, 13, 14]}


def test_csv_and_small_buckets_give_the_same_samples(tmp_path, log_rows):
    parquet = write_parquet(log_rows, tmp_path / "log.parquet")
    build_sequences(options(parquet, tmp_path / "a"), log=lambda _: None)
    csv = tmp_path / "log.csv"
    pcsv.write_csv(pa.Table.from_pylist(log_rows), csv)
    build_sequences(options(csv, tmp_path / "b", bucket_rows=37, batch_rows=50), log=lambda _: None)
    tsv = tmp_path / "log.tsv"
    pcsv.write_csv(pa.Table.from_pylist(log_rows), tsv, pcsv.WriteOptions(delimiter="\t"))
    build_sequences(options(tsv, tmp_path / "c"), log=lambda _: None)
    assert built(tmp_path / "a") == built(tmp_path / "b") == built(tmp_path / "c")
    # CSV ids are read as text (no id rounded through a float), Parquet's keep their type
    assert pq.read_table(tmp_path / "b" / "maps" / "user.parquet").schema.field("value").type == pa.string()
    assert pq.read_table(tmp_path / "a" / "maps" / "user.parquet").schema.field("value").type == pa.int64()


def test_ids_are_dense_and_the_output_trains_as_configured(tmp_path, log_rows):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    summary = build_sequences(options(log, tmp_path / "out", event_columns=("rating", "device")), log=lambda _: None)
    out = tmp_path / "out"
    train = pq.read_table(out / "train.parquet")
    assert train.column("user").type == pa.int32() and train.column("hist_item").type == pa.list_(pa.int32())
    assert max(train.column("cand_item").to_pylist()) < summary["num_items"] == len(log_rows)
    assert summary["num_users"] == 30 and summary["rows"]["events"] == len(log_rows)
    assert summary["rows"]["train"] + summary["rows"]["eval"] == len(log_rows)
    assert (summary["label"], summary["rating"], summary["threshold"]) == ("rating >= 4", "rating", 4)
    devices = pq.read_table(out / "maps" / "device.parquet").to_pylist()
    assert devices == [{"id": 1, "value": "android"}, {"id": 2, "value": "ios"}, {"id": 3, "value": "web"}]
    assert {"column": "hist_device", "num_embeddings": 4} in summary["data"]["event_features"]  # 0: missing
    assert json.loads((out / "dataset.json").read_text()) == summary
    assert (out / "config" / "data" / "logs.yaml").read_text().startswith("# data=parquet config")
    assert f"data.path={out.resolve() / 'train.parquet'}" in train_command(summary)

    from gem_lp.data import ParquetDataConfig, ParquetSource
    data = {k: v for k, v in summary["data"].items()}
    source = ParquetSource(ParquetDataConfig(**data, batch_size=64), seed=0)
    assert source.num_eval_rows == summary["rows"]["eval"]
    assert next(iter(source.train_dataset(0))).batch_size == 64


def test_side_tables_with_gaps_and_empty_columns(tmp_path, log_rows):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    users = pa.table({"user_id": [1001, 1002, 1003, 9999], "age": [31.0, None, 40.0, 22.0],
                      "segment": ["a", "b", None, "c"], "empty": pa.array([None] * 4, pa.string())})
    pq.write_table(users, tmp_path / "users.parquet")
    items = tmp_path / "items.csv"
    items.write_text("item_id,genre\n" + "".join(f"{50_000 + i},{'g' + str(i % 3)}\n" for i in range(0, 400, 2)))
    opts = dict(user_table=str(tmp_path / "users.parquet"), item_table=str(items), dense=("age",))
    with pytest.raises(DataError, match=r"column 'age' has no finite value for 28 of the log's users \(the first: "
                                        r"1000; absent, null or not finite\)"):
        build_sequences(options(log, tmp_path / "out", **opts), log=lambda _: None)
    summary = build_sequences(options(log, tmp_path / "out2", dense_fill=0.0, **opts), log=lambda _: None)
    assert summary["data"]["dense_features"] == ["age"]
    pooled = {f["column"]: f["num_embeddings"] for f in summary["data"]["pooled_features"]}
    assert pooled == {"user": 30, "segment": 3, "empty": 1, "genre": 4}
    users_map = pq.read_table(tmp_path / "out2" / "maps" / "user.parquet").column("value").to_pylist()
    items_map = pq.read_table(tmp_path / "out2" / "maps" / "item.parquet").column("value").to_pylist()
    rows = pq.read_table(tmp_path / "out2" / "train.parquet").to_pylist()
    for r in rows:
        user, item = users_map[r["user"]], items_map[r["cand_item"]]
        assert r["age"] == {1001: 31.0, 1003: 40.0}.get(user, 0.0)
        assert r["segment"] == {1001: 1, 1002: 2}.get(user, 0) and r["empty"] == 0
        listed = item - 50_000 < 400 and (item - 50_000) % 2 == 0
        assert r["genre"] == (1 + (item - 50_000) % 3 if listed else 0)


def test_item_history_columns_give_each_earlier_items_side_value(tmp_path, log_rows):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    items = tmp_path / "items.parquet"  # every other item listed: the rest have genre 0 (missing)
    pq.write_table(pa.table({"item_id": [50_000 + i for i in range(0, 400, 2)],
                             "genre": [f"g{i % 3}" for i in range(0, 400, 2)],
                             "price": [float(i) for i in range(0, 400, 2)]}), items)
    opts = dict(item_table=str(items), dense=("price",), dense_fill=0.0, item_history_columns=("genre",))
    summary = build_sequences(options(log, tmp_path / "out", bucket_rows=37, **opts), log=lambda _: None)
    assert summary["data"]["event_features"] == [{"column": "hist_rating", "num_embeddings": 6},
                                                 {"column": "hist_genre", "num_embeddings": 4}]
    out = tmp_path / "out"
    item_ids = pq.read_table(out / "maps" / "item.parquet").column("value").to_pylist()
    genre_map = pq.read_table(out / "maps" / "genre.parquet")
    genre_of_id = dict(zip(genre_map.column("id").to_pylist(), genre_map.column("value").to_pylist()))
    expected = {50_000 + i: f"g{i % 3}" for i in range(0, 400, 2)}
    lists = 0
    for split in ("train", "eval"):
        for r in pq.read_table(out / f"{split}.parquet").to_pylist():
            assert len(r["hist_genre"]) == len(r["hist_item"])
            assert [genre_of_id.get(g) for g in r["hist_genre"]] == [expected.get(item_ids[i]) for i in r["hist_item"]]
            lists += len(r["hist_genre"]) > 0
    assert lists > 100
    assert built(out) == reference(log_rows, 5, lambda i, e: e["timestamp"] >= 30)  # the rest as without it

    from gem_lp.data import ParquetDataConfig, ParquetSource
    source = ParquetSource(ParquetDataConfig(**summary["data"], batch_size=16), seed=0)
    assert next(iter(source.train_dataset(0))).batch_size == 16

    with pytest.raises(ValueError, match="--item-history-columns names item-table columns: give --item-table"):
        options(log, tmp_path / "a", item_history_columns=("genre",))
    with pytest.raises(ValueError, match="cannot name 'item': its history list would be hist_item"):
        options(log, tmp_path / "a", item_table=str(items), item_history_columns=("item",))
    with pytest.raises(ValueError, match=r"would write the same history list twice: \['rating'\]"):
        options(log, tmp_path / "a", item_table=str(items), item_history_columns=("rating",))
    for column in ("price", "colour"):
        with pytest.raises(DataError, match=rf"--item-history-columns names \['{column}'\], which are not categorical "
                                            rf"columns of the item table \(those are \['genre'\]"):
            build_sequences(options(log, tmp_path / column, **{**opts, "item_history_columns": (column,)}),
                            log=lambda _: None)


@pytest.mark.parametrize("change, message", [
    (lambda r: r[3].update(user_id=None), "row 3: column 'user_id' is null"),
    (lambda r: r[5].update(timestamp=None), "row 5: column 'timestamp' is null"),
])
def test_bad_logs_are_errors_naming_the_row(tmp_path, change, message):
    rows = make_log(n=20)
    change(rows)
    log = write_parquet(rows, tmp_path / "log.parquet")
    with pytest.raises(DataError, match=message):
        build_sequences(options(log, tmp_path / "out"), log=lambda _: None)


def test_labels_and_options_are_checked(tmp_path):
    rows = make_log(n=20)
    log = write_parquet(rows, tmp_path / "log.parquet")
    with pytest.raises(DataError, match=r"row \d+: column 'rating' holds [2-5]; a label is 0 or 1 \(for ratings use "
                                        r"--rating rating --threshold X\)"):
        build_sequences(options(log, tmp_path / "a", rating=None, threshold=None, label="rating"), log=lambda _: None)
    with pytest.raises(DataError, match=r"no column 'when'"):
        build_sequences(options(log, tmp_path / "b", time="when"), log=lambda _: None)
    with pytest.raises(ValueError, match="give exactly one of --label"):
        options(log, tmp_path / "c", label="rating")
    with pytest.raises(ValueError, match="--eval-from is a global time cut"):
        options(log, tmp_path / "c", split="user")
    with pytest.raises(ValueError, match="its history list would be hist_item"):
        options(log, tmp_path / "c", item="movie", event_columns=("item",))
    build_sequences(options(log, tmp_path / "d"), log=lambda _: None)
    with pytest.raises(FileExistsError, match="is not empty"):
        build_sequences(options(log, tmp_path / "d"), log=lambda _: None)
    with pytest.raises(DataError, match="the split leaves no eval samples"):
        build_sequences(options(log, tmp_path / "e", eval_from="1000"), log=lambda _: None)


def test_the_command_line(tmp_path, capsys):
    rows = make_log(n=60)
    log = write_parquet(rows, tmp_path / "log.parquet")
    code = main([str(log), str(tmp_path / "out"), "--rating", "rating", "--threshold", "4", "--event-columns", "rating",
                 "--eval-fraction", "0.2", "--max-history", "none"])
    out, err = capsys.readouterr()
    assert code == 0 and "python train.py data=parquet" in out and "--config-dir" in out and "read 61 events" in err
    summary = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert summary["max_history"] is None and 0 < summary["rows"]["eval"] < 61
    assert main([str(log), str(tmp_path / "out"), "--rating", "rating", "--threshold", "4"]) == 1
    assert "is not empty" in capsys.readouterr().err


def history_means_of(out):
    """{(user, item): {dense column: value}} of a build's history-means columns, in original ids."""
    users = pq.read_table(out / "maps" / "user.parquet").column("value").to_pylist()
    items = pq.read_table(out / "maps" / "item.parquet").column("value").to_pylist()
    names = json.loads((out / "dataset.json").read_text())["history_means"]["features"]
    got = {}
    for split in ("train", "eval"):
        for r in pq.read_table(out / f"{split}.parquet").to_pylist():
            got[(int(users[r["user"]]), int(items[r["cand_item"]]))] = {n: r[n] for n in names}
    return got


@pytest.mark.parametrize("extra", [{}, dict(bucket_rows=37, batch_rows=50)])
def test_history_means_average_all_strictly_earlier_events(tmp_path, log_rows, extra):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    summary = build_sequences(options(log, tmp_path / "out", history_means=("rating", "label"), max_history=5,
                                      **extra), log=lambda _: None)
    got = history_means_of(tmp_path / "out")
    assert len(got) == len(log_rows)
    longer = 0
    for e in log_rows:
        earlier = [o for o in log_rows if o["user_id"] == e["user_id"] and o["timestamp"] < e["timestamp"]]
        longer += len(earlier) > 5  # the means take every earlier event, not only the capped history's 5
        n = len(earlier)
        want = {"hist_mean_rating": sum(o["rating"] for o in earlier) / n if n else 0.0,
                "hist_mean_label": sum(o["rating"] >= 4 for o in earlier) / n if n else 0.0,
                "hist_log1p_count": math.log1p(n)}
        assert got[(e["user_id"], e["item_id"])] == pytest.approx(want, rel=1e-6), e
    assert longer > 100
    assert got[(1000, 50_400)] == {"hist_mean_rating": 0.0, "hist_mean_label": 0.0, "hist_log1p_count": 0.0}
    assert summary["data"]["dense_features"] == ["hist_mean_rating", "hist_mean_label", "hist_log1p_count"]


def test_history_means_exclude_events_at_the_same_time(tmp_path):
    rows = [{"user_id": 1, "item_id": i, "timestamp": t, "rating": r} for i, t, r in
            [(10, 1, 5), (11, 1, 1), (12, 2, 4), (13, 2, 1), (14, 3, 3), (20, 9, 2)]]
    rows.append({"user_id": 2, "item_id": 21, "timestamp": 9, "rating": 4})
    log = write_parquet(rows, tmp_path / "ties.parquet")
    build_sequences(options(log, tmp_path / "out", event_columns=(), history_means=("rating",), max_history=1,
                            eval_from="9"), log=lambda _: None)
    got = {item: (round(v["hist_mean_rating"], 6), round(math.expm1(v["hist_log1p_count"])))
           for (_, item), v in history_means_of(tmp_path / "out").items()}
    assert got == {10: (0.0, 0), 11: (0.0, 0), 12: (3.0, 2), 13: (3.0, 2), 14: (2.75, 4), 20: (2.8, 5), 21: (0.0, 0)}


def test_history_means_reach_the_config_and_the_trainer(tmp_path, capsys):
    rows = make_log(n=60)
    for i, r in enumerate(rows):
        r["score"] = i / 10
    log = write_parquet(rows, tmp_path / "log.parquet")
    users = tmp_path / "users.parquet"
    ids = sorted({r["user_id"] for r in rows})
    pq.write_table(pa.table({"user_id": ids, "age": [30.0] * len(ids)}), users)
    code = main([str(log), str(tmp_path / "out"), "--rating", "rating", "--threshold", "4", "--eval-fraction", "0.2",
                 "--user-table", str(users), "--dense", "age", "--history-means", "score,label"])
    out, _ = capsys.readouterr()
    dense = ["age", "hist_mean_score", "hist_mean_label", "hist_log1p_count"]
    assert code == 0 and f"'data.dense_features=[{','.join(dense)}]'" in out
    config = (tmp_path / "out" / "config" / "data" / "logs.yaml").read_text()
    assert f"dense_features: {json.dumps(dense)}" in config
    summary = json.loads((tmp_path / "out" / "dataset.json").read_text())

    from gem_lp.data import ParquetDataConfig, ParquetSource
    source = ParquetSource(ParquetDataConfig(**summary["data"], batch_size=16), seed=0)
    assert source.features.num_dense == 4
    assert tuple(next(iter(source.train_dataset(0))).dense_features.shape) == (16, 4)


def test_history_means_are_checked(tmp_path, log_rows):
    log = write_parquet(log_rows, tmp_path / "log.parquet")
    with pytest.raises(DataError, match=r"column 'device' \(--history-means\) must be numeric"):
        build_sequences(options(log, tmp_path / "a", history_means=("device",)), log=lambda _: None)
    rows = make_log(n=20)
    for r in rows:
        r["score"] = 1.0
    rows[4]["score"] = None
    with pytest.raises(DataError, match=r"row 4: column 'score' \(--history-means\) holds None"):
        build_sequences(options(write_parquet(rows, tmp_path / "s.parquet"), tmp_path / "b", history_means=("score",)),
                        log=lambda _: None)
    with pytest.raises(ValueError, match="--history-means must be distinct columns"):
        options(log, tmp_path / "c", history_means=("rating", "rating"))
