"""Build the Parquet samples of `data=parquet` from a raw interaction log: `python -m gem_lp.data.build_sequences`.

The log holds one row per event (Parquet, CSV or TSV): a user, an item, a time, and a label (0/1) or a rating that a
threshold turns into one; optionally more per-event columns, and user and item side tables joined by id. Every event
becomes one sample: its item is the candidate, its label the label, and its history the same user's earlier events.

* History: the user's events with a strictly earlier timestamp, oldest first, the most recent `max_history` of
  them. Events with equal timestamps never see each other; among earlier events, equal timestamps are ordered by
  their position in the log (files in name order), so the output is a pure function of the input.
* Split by time: a global cut (events at or after the cut are eval samples: `--eval-from T`, or `--eval-fraction F`
  for the cut that leaves about the last F of the events) or each user's last fraction (`--split user`: the last
  ceil(F * n) of a user's n events, none for a user with one event). Histories hold every earlier event, whichever
  split it is in: an eval sample sees its user's training events, no sample sees a later one.
* History means (`--history-means rating,label`): per sample, the mean of a numeric per-event column (`label`: the
  0/1 label) over ALL the user's strictly-earlier events (the history's rule, not its cap), as the dense feature
  `hist_mean_<column>`, 0.0 for a user's first events, with `hist_log1p_count` = log1p(the number of those events).
* Ids: users and items become dense `[0, n)` in the sorted order of their original values; categorical columns
  (per-event and side-table) become `[1, n]`, 0 standing for a missing value (a null, or an id absent from its side
  table). Each map is written to `<out>/maps/<name>.parquet` (`id`, `value`).

It streams: a first pass reads the log in record batches and collects the id maps (the only global state) and the
row count, a second maps the ids and partitions the events by user into bucket files, and each bucket (all events
of its users) is then sorted and turned into samples, written to `<out>/train.parquet` and `<out>/eval.parquet` row
group by row group. Memory is bounded by a bucket (`--bucket-rows` events) and the id maps, not by the log.

The output's columns: `label` (0/1), `timestamp` (the log's type), `user` (dense id), `hist_item` (list of item ids),
`hist_<column>` per event column (lists aligned with `hist_item`), `cand_item`, then the user's and the candidate
item's side columns (ids, or float32 for `--dense` columns), then the history means (float32). It prints the
`python train.py data=parquet ...` that trains on them and writes the same as a config (`<out>/config/data/logs.yaml`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .spec import DataError

FORMATS = ("parquet", "csv", "tsv")
SPLITS = ("global", "user")
MISSING_ID = 0  # the id of a missing categorical value
HIST_COUNT = "hist_log1p_count"  # with --history-means: log1p(the number of the user's strictly earlier events)


@dataclasses.dataclass
class BuildOptions:
    """What `build_sequences` reads and how (the command line's arguments; see `--help`)."""

    log: str
    out: str
    format: str | None = None  # from the suffix of `log` (a directory: parquet)
    user: str = "user_id"
    item: str = "item_id"
    time: str = "timestamp"
    label: str | None = None
    rating: str | None = None
    threshold: float | None = None
    event_columns: tuple[str, ...] = ()
    user_table: str | None = None
    user_key: str | None = None  # default: `user`
    item_table: str | None = None
    item_key: str | None = None  # default: `item`
    item_history_columns: tuple[str, ...] = ()  # categorical item-table columns also written per history event
    dense: tuple[str, ...] = ()  # side-table columns taken as numbers
    dense_fill: float | None = None  # the value of a dense side feature for an id its table lacks (None: an error)
    history_means: tuple[str, ...] = ()  # numeric event columns (or "label") averaged over all earlier events
    max_history: int | None = 50
    split: str = "global"
    eval_fraction: float | None = 0.1
    eval_from: str | None = None  # a global cut, in the time column's own terms
    bucket_rows: int = 2_000_000  # events per bucket, about
    batch_rows: int = 1 << 20  # rows per record batch read
    overwrite: bool = False

    def __post_init__(self):
        self.event_columns, self.dense = tuple(self.event_columns), tuple(self.dense)
        self.history_means = tuple(self.history_means)
        self.item_history_columns = tuple(self.item_history_columns)
        problems = []
        if self.format is not None and self.format not in FORMATS:
            problems.append(f"--format must be one of {FORMATS}, got {self.format!r}")
        if (self.label is None) == (self.rating is None):
            problems.append("give exactly one of --label COLUMN (0/1) and --rating COLUMN --threshold X")
        if self.rating is not None and self.threshold is None:
            problems.append("--rating needs --threshold X (label = rating >= X)")
        if self.threshold is not None and self.rating is None:
            problems.append("--threshold needs --rating COLUMN")
        if self.max_history is not None and self.max_history < 1:
            problems.append(f"--max-history must be >= 1 or none, got {self.max_history}")
        if self.split not in SPLITS:
            problems.append(f"--split must be one of {SPLITS}, got {self.split!r}")
        if self.eval_from is not None and self.split != "global":
            problems.append("--eval-from is a global time cut: use it with --split global")
        if self.eval_from is None and not (self.eval_fraction is not None and 0 < self.eval_fraction < 1):
            problems.append(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.user_key is not None and self.user_table is None:
            problems.append("--user-key needs --user-table")
        if self.item_key is not None and self.item_table is None:
            problems.append("--item-key needs --item-table")
        if self.item_history_columns and self.item_table is None:
            problems.append("--item-history-columns names item-table columns: give --item-table")
        if "item" in self.item_history_columns:
            problems.append("--item-history-columns cannot name 'item': its history list would be hist_item")
        if self.dense and self.user_table is None and self.item_table is None:
            problems.append("--dense names side-table columns: give --user-table or --item-table")
        if self.bucket_rows < 1 or self.batch_rows < 1:
            problems.append("--bucket-rows and --batch-rows must be >= 1")
        keys = [self.user, self.item, self.time, self.label or self.rating]
        if len(set(keys)) != len(keys):
            problems.append(f"the user, item, time and label/rating columns must be four columns, got {keys}")
        clash = sorted(set(self.event_columns) & {self.user, self.item, self.time, "item"})
        if clash or len(set(self.event_columns)) != len(self.event_columns):
            problems.append(f"--event-columns must be distinct columns other than the user, item and time (and not "
                            f"'item': its history list would be hist_item), got {list(self.event_columns)}")
        means = self.history_means
        if len(set(means)) != len(means) or set(means) & {self.user, self.item, self.time}:
            problems.append(f"--history-means must be distinct columns other than the user, item and time, got "
                            f"{list(means)}")
        lists = [*self.event_columns, *self.item_history_columns]
        if len(set(lists)) != len(lists):
            problems.append(f"--event-columns and --item-history-columns would write the same history list twice: "
                            f"{sorted({c for c in lists if lists.count(c) > 1})}")
        if {f"hist_{c}" for c in lists} & {*(f"hist_mean_{c}" for c in means), HIST_COUNT}:
            problems.append("an --event-columns or --item-history-columns history list would have the name of a "
                            "--history-means column")
        if problems:
            raise ValueError("; ".join(problems))


# ---- reading ---------------------------------------------------------------------------------------------------


def _files(path: Path, fmt: str) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"no file or directory at {path}")
    if path.is_file():
        return [path]
    suffixes = {"parquet": (".parquet", ".pq"), "csv": (".csv",), "tsv": (".tsv", ".tab")}[fmt]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    if not files:
        raise FileNotFoundError(f"{path}: no {'/'.join(suffixes)} files in it")
    return files


def _format_of(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        return fmt
    suffix = path.suffix.lower()
    if path.is_dir() or suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv"):
        return suffix[1:]
    raise ValueError(f"{path}: cannot tell the format from its name; give --format {'|'.join(FORMATS)}")


class Table:
    """A log or side table on disk (Parquet, CSV or TSV; a file or a directory), read in record batches in file
    order. CSV id columns (`text_columns`) are read as text, so that no id is rounded through a float."""

    def __init__(self, path: str, fmt: str | None, text_columns: tuple[str, ...] = ()):
        self.path = Path(path)
        self.format = _format_of(self.path, fmt)
        self.files = _files(self.path, self.format)
        self.text_columns = text_columns
        self.names = self._names()

    def _names(self) -> list[str]:
        import pyarrow.csv as csv
        import pyarrow.parquet as pq

        if self.format == "parquet":
            return pq.read_schema(self.files[0]).names
        return csv.open_csv(self.files[0], parse_options=self._parse_options()).schema.names

    def _parse_options(self):
        import pyarrow.csv as csv

        return csv.ParseOptions(delimiter="\t" if self.format == "tsv" else ",")

    def require(self, columns: list[str], what: str) -> None:
        missing = [c for c in columns if c not in self.names]
        if missing:
            raise DataError(f"{self.path}: no column {', '.join(map(repr, missing))} ({what}); it has {self.names}")

    def batches(self, columns: list[str], batch_rows: int) -> Iterator[tuple[Path, int, Any]]:
        """(file, first row in the file, record batch of `columns`) for every batch, in order."""
        import pyarrow as pa
        import pyarrow.csv as csv
        import pyarrow.parquet as pq

        for file in self.files:
            start = 0
            if self.format == "parquet":
                reader = pq.ParquetFile(file).iter_batches(batch_size=batch_rows, columns=columns)
            else:
                types = {c: pa.string() for c in self.text_columns if c in columns}
                reader = csv.open_csv(file, read_options=csv.ReadOptions(block_size=64 << 20),
                                      parse_options=self._parse_options(),
                                      convert_options=csv.ConvertOptions(include_columns=columns, column_types=types))
            try:
                for batch in reader:
                    yield file, start, batch
                    start += batch.num_rows
            except pa.ArrowInvalid as err:
                raise DataError(f"{file}: cannot read it past row {start}: {err}") from None

    def read_all(self, columns: list[str]):
        import pyarrow as pa

        batches = [b for _, _, b in self.batches(columns, 1 << 20)]
        return pa.Table.from_batches(batches) if batches else None


# ---- id maps -----------------------------------------------------------------------------------------------------


def _cast(array, to, name: str):
    import pyarrow as pa

    try:
        return array.cast(to)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise DataError(f"column {name!r}: values of type {array.type} do not convert to {to}, the type of its "
                        f"earlier values: {err}") from None


class IdMap:
    """Sorted distinct values of a column; `ids(values)` gives each value's position (+ `base`)."""

    def __init__(self, name: str, base: int):
        self.name, self.base = name, base
        self._parts: list[Any] = []
        self._pending = 0
        self.values = None  # the sorted distinct values, an Arrow array, once `finish` ran

    def add(self, array) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        array = pc.drop_null(array)
        if self._parts and array.type != self._parts[0].type:  # files of one log may differ in integer width
            array = _cast(array, self._parts[0].type, self.name)
        self._parts.append(pc.unique(array))
        self._pending += len(self._parts[-1])
        if len(self._parts) > 64 or self._pending > 4_000_000:
            self._parts = [pc.unique(pa.concat_arrays(self._parts))]
            self._pending = len(self._parts[0])

    def finish(self) -> "IdMap":
        import pyarrow as pa
        import pyarrow.compute as pc

        values = pc.unique(pa.concat_arrays(self._parts)) if self._parts else pa.array([], pa.int64())
        self.values = values.take(pc.sort_indices(values))
        self._numeric = pa.types.is_integer(self.values.type) or pa.types.is_floating(self.values.type)
        self._sorted = self.values.to_numpy(zero_copy_only=False) if self._numeric else None
        self._parts = []
        return self

    def __len__(self) -> int:
        return len(self.values) + self.base

    def ids(self, array) -> np.ndarray:
        """int64 ids of `array`'s values (which must all be in the map); nulls get `MISSING_ID`."""
        import pyarrow.compute as pc

        if array.type != self.values.type:
            array = _cast(array, self.values.type, self.name)
        if self._numeric:
            values = array.fill_null(self.values[0] if len(self.values) else 0).to_numpy(zero_copy_only=False)
            out = np.searchsorted(self._sorted, values).astype(np.int64)
        else:
            out = pc.index_in(array, value_set=self.values).fill_null(0).to_numpy(zero_copy_only=False)
            out = out.astype(np.int64)
        out += self.base
        if array.null_count:
            out[array.is_null().to_numpy(zero_copy_only=False)] = MISSING_ID
        return out

    def lookup(self, array) -> tuple[np.ndarray, np.ndarray]:
        """(ids, found) of values that may be absent from the map (a side table's keys)."""
        import pyarrow.compute as pc

        if array.type != self.values.type:
            array = array.cast(self.values.type)
        found = pc.is_in(array, value_set=self.values).to_numpy(zero_copy_only=False)
        positions = pc.index_in(array, value_set=self.values).fill_null(0).to_numpy(zero_copy_only=False)
        return positions.astype(np.int64) + self.base, found

    def write(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        ids = pa.array(np.arange(self.base, len(self), dtype=np.int64))
        pq.write_table(pa.table({"id": ids, "value": self.values}), path)


# ---- the build -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SideFeature:
    """One column of a side table as a feature of the sample: per dense user/item id, an id or a float."""

    name: str
    table: str  # "user" or "item"
    values: np.ndarray  # int64 ids (0: missing) or float32, indexed by the dense user/item id
    num_embeddings: int | None  # None: dense


class Builder:
    def __init__(self, opts: BuildOptions, log=print):
        self.opts = opts
        self.log = log
        self.out = Path(opts.out)
        text = (opts.user, opts.item)
        self.table = Table(opts.log, opts.format, text_columns=text)
        self.label_column = opts.label or opts.rating
        # a column may be both (the rating as the label and as an event feature): read once
        self.means = [c for c in opts.history_means if c != "label"]  # "label": the 0/1 label, not a column
        self.columns = list(dict.fromkeys([opts.user, opts.item, opts.time, self.label_column, *opts.event_columns,
                                           *self.means]))
        self.table.require(self.columns, "the user, item, time, label/rating, event and history-means columns")
        self.users = IdMap("user", 0)
        self.items = IdMap("item", 0)
        self.events = {c: IdMap(c, 1) for c in opts.event_columns}
        self.time_type = None
        self.num_rows = 0
        self.time_sample = TimeSample()

    # pass 1: check the key columns, collect the id maps, count the rows
    def scan(self) -> None:
        opts = self.opts
        for file, start, batch in self.table.batches(self.columns, opts.batch_rows):
            where = _Rows(file, start)
            for name in (opts.user, opts.item, opts.time, self.label_column):
                column = batch.column(name)
                if column.null_count:
                    row = int(column.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0])
                    raise DataError(f"{where(row)}: column {name!r} is null; every event needs a user, item, time and "
                                    f"{'label' if opts.label else 'rating'}")
            times = batch.column(opts.time)
            if self.time_type is None:
                self.time_type = times.type
            elif times.type != self.time_type:
                raise DataError(f"{file}: column {opts.time!r} has type {times.type}, earlier rows {self.time_type}; "
                                f"the time column needs one type")
            self.time_sample.add(_time_values(times, opts.time, where), self.num_rows)
            self._labels(batch, where)
            self.users.add(batch.column(opts.user))
            self.items.add(batch.column(opts.item))
            for c, m in self.events.items():
                m.add(batch.column(c))
            self.num_rows += batch.num_rows
        if self.num_rows == 0:
            raise DataError(f"{self.table.path}: no events")
        for m in (self.users, self.items, *self.events.values()):
            m.finish()

    def _labels(self, batch, where) -> np.ndarray:
        """0/1 labels of a batch: the label column (checked), or rating >= threshold."""
        import pyarrow as pa

        opts = self.opts
        column = batch.column(self.label_column)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type)):
            raise DataError(f"{where.file}: column {self.label_column!r} must be numeric (or boolean), got type "
                            f"{column.type}")
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        if opts.label is not None:
            bad = (values != 0) & (values != 1)
            if bad.any():
                row = int(bad.nonzero()[0][0])
                raise DataError(f"{where(row)}: column {opts.label!r} holds {column[row].as_py()}; a label is 0 or 1 "
                                f"(for ratings use --rating {opts.label} --threshold X)")
            return values.astype(np.int8)
        if np.isnan(values).any():
            row = int(np.isnan(values).nonzero()[0][0])
            raise DataError(f"{where(row)}: column {opts.rating!r} holds NaN; a rating must be a number")
        return (values >= opts.threshold).astype(np.int8)

    def _numbers(self, batch, name: str, where) -> np.ndarray:
        """A --history-means column of a batch as float64 (numeric or boolean, no null, finite)."""
        import pyarrow as pa

        column = batch.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type)):
            raise DataError(f"{where.file}: column {name!r} (--history-means) must be numeric, got type {column.type}")
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = column.is_null().to_numpy(zero_copy_only=False) | ~np.isfinite(values)
        if bad.any():
            row = int(bad.nonzero()[0][0])
            raise DataError(f"{where(row)}: column {name!r} (--history-means) holds {column[row].as_py()}; its "
                            f"values must be finite numbers")
        return values

    # the split
    def eval_cut(self) -> Any:
        """The global cut (events with a time >= it are eval samples), in the time column's int64/float64 terms."""
        import pyarrow as pa

        opts = self.opts
        if opts.eval_from is not None:
            try:
                cut = pa.array([opts.eval_from]).cast(self.time_type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise DataError(f"--eval-from {opts.eval_from!r} is not a value of column {opts.time!r} "
                                f"({self.time_type})") from None
            return _time_values(cut, opts.time, None)[0]
        return self.time_sample.quantile(1 - opts.eval_fraction)

    # pass 2: ids, labels, times -> bucket files
    def partition(self, work: Path) -> list[Path]:
        import pyarrow as pa

        opts = self.opts
        num_buckets = max(1, math.ceil(self.num_rows / opts.bucket_rows))
        paths = [work / f"bucket-{b:05d}.arrow" for b in range(num_buckets)]
        fields = [("user", pa.int64()), ("item", pa.int64()), ("time", _internal_time_type(self.time_type)),
                  ("row", pa.int64()), ("label", pa.int8()), *((f"e{i}", pa.int64()) for i in range(len(self.events))),
                  *((f"m{i}", pa.float64()) for i in range(len(self.means)))]
        schema = pa.schema(fields)
        writers = [pa.ipc.new_file(str(p), schema) for p in paths]
        row = 0
        try:
            for file, start, batch in self.table.batches(self.columns, opts.batch_rows):
                where = _Rows(file, start)
                user = self.users.ids(batch.column(opts.user))
                columns = [user, self.items.ids(batch.column(opts.item)),
                           _time_values(batch.column(opts.time), opts.time, where),
                           np.arange(row, row + batch.num_rows, dtype=np.int64), self._labels(batch, where),
                           *(m.ids(batch.column(c)) for c, m in self.events.items()),
                           *(self._numbers(batch, c, where) for c in self.means)]
                bucket = user % num_buckets
                order = np.argsort(bucket, kind="stable")
                bounds = np.searchsorted(bucket[order], np.arange(num_buckets + 1))
                sorted_columns = [c[order] for c in columns]
                for b in range(num_buckets):
                    lo, hi = bounds[b], bounds[b + 1]
                    if hi > lo:
                        writers[b].write_batch(pa.record_batch([pa.array(c[lo:hi]) for c in sorted_columns],
                                                               schema=schema))
                row += batch.num_rows
        finally:
            for w in writers:
                w.close()
        return paths

    # side tables
    def side_features(self) -> list[SideFeature]:
        opts = self.opts
        out = []
        for kind, path, key, ids in (("user", opts.user_table, opts.user_key or opts.user, self.users),
                                     ("item", opts.item_table, opts.item_key or opts.item, self.items)):
            if path is not None:
                out += self._side_table(kind, path, key, ids)
        names = [f.name for f in out]
        taken = {"label", "timestamp", "user", "hist_item", "cand_item", *(f"hist_{c}" for c in opts.event_columns),
                 *(f"hist_{c}" for c in opts.item_history_columns), *self.mean_features()}
        clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & taken))
        if clash:
            raise DataError(f"side-table columns {clash} clash with each other or with the output's own columns "
                            f"{sorted(taken)}; rename them in the side tables")
        unknown = sorted(set(opts.dense) - set(names))
        if unknown:
            raise DataError(f"--dense names {unknown}, which no side table holds (side columns: {names})")
        categorical = [f.name for f in out if f.table == "item" and f.num_embeddings is not None]
        unknown = sorted(set(opts.item_history_columns) - set(categorical))
        if unknown:
            raise DataError(f"--item-history-columns names {unknown}, which are not categorical columns of the item "
                            f"table (those are {categorical}; --dense columns are numbers)")
        return out

    def item_history_features(self, side: list[SideFeature]) -> list[SideFeature]:
        """The item side features of --item-history-columns, in its order (each written as hist_<name>)."""
        items = {f.name: f for f in side if f.table == "item"}
        return [items[c] for c in self.opts.item_history_columns]

    def _side_table(self, kind: str, path: str, key: str, ids: IdMap) -> list[SideFeature]:
        import pyarrow as pa
        import pyarrow.compute as pc

        table = Table(path, None, text_columns=(key,))
        table.require([key], f"the {kind} key")
        data = table.read_all(table.names)
        keys = data.column(key).combine_chunks()
        if keys.null_count:
            raise DataError(f"{path}: column {key!r} (the {kind} key) holds a null")
        counts = pc.value_counts(keys)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))
        if len(repeated):
            raise DataError(f"{path}: {kind} {repeated[0]['values'].as_py()!r} appears "
                            f"{repeated[0]['counts'].as_py()} times in column {key!r}; a side table has one row per id")
        try:
            positions, found = ids.lookup(keys)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise DataError(f"{path}: column {key!r} ({keys.type}) does not compare with the log's {kind} ids "
                            f"({ids.values.type}): {err}") from None
        positions = positions[found]
        covered = np.zeros(len(ids), dtype=bool)
        covered[positions] = True
        absent = int((~covered).sum())
        self.log(f"{kind} table {path}: {int(found.sum())} of its {len(keys)} rows name {kind}s of the log; {absent} "
                 f"of the log's {len(ids)} {kind}s are not in it")
        out = []
        for name in table.names:
            if name == key:
                continue
            column = data.column(name).combine_chunks().filter(pa.array(found))
            if name in self.opts.dense:
                if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
                    raise DataError(f"{path}: column {name!r} is in --dense but holds {column.type}")
                values = np.full(len(ids), np.nan, dtype=np.float64)
                values[positions] = column.to_numpy(zero_copy_only=False).astype(np.float64)
                missing = np.isnan(values) | ~np.isfinite(values)
                if missing.any():
                    if self.opts.dense_fill is None:
                        first = ids.values[int(missing.nonzero()[0][0]) - ids.base].as_py()
                        raise DataError(f"{path}: column {name!r} has no finite value for {int(missing.sum())} of the "
                                        f"log's {kind}s (the first: {first!r}; absent, null or not finite); complete "
                                        f"the table, give --dense-fill VALUE, or leave {name!r} out of --dense")
                    values[missing] = self.opts.dense_fill
                out.append(SideFeature(name, kind, values.astype(np.float32), None))
            else:
                categories = IdMap(name, 1)
                categories.add(column)
                categories.finish()
                values = np.zeros(len(ids), dtype=np.int64)
                values[positions] = categories.ids(column)
                categories.write(self.out / "maps" / f"{name}.parquet")
                out.append(SideFeature(name, kind, values, len(categories)))
        return out

    def mean_features(self) -> list[str]:
        """The dense columns of --history-means: hist_mean_<column> each, then hist_log1p_count (none without it)."""
        means = self.opts.history_means
        return [*(f"hist_mean_{c}" for c in means), HIST_COUNT] if means else []

    # pass 3: bucket -> samples
    def write_samples(self, buckets: list[Path], cut, side: list[SideFeature]) -> dict[str, int]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        id_type = pa.int32() if max(len(self.users), len(self.items), 1) < 2**31 else pa.int64()
        schema = self._schema(id_type, side)
        counts = {"train": 0, "eval": 0, "history_events": 0, "capped": 0}
        writers = {split: pq.ParquetWriter(self.out / f"{split}.parquet", schema) for split in ("train", "eval")}
        try:
            for path in buckets:
                with pa.memory_map(str(path)) as source:
                    bucket = pa.ipc.open_file(source).read_all()
                if bucket.num_rows:
                    for table, is_eval in self._samples(bucket, cut, side, schema, counts):
                        for split, mask in (("eval", is_eval), ("train", ~is_eval)):
                            part = table.filter(pa.array(mask))
                            if part.num_rows:
                                writers[split].write_table(part)
                                counts[split] += part.num_rows
                del bucket
        finally:
            for w in writers.values():
                w.close()
        return counts

    def _schema(self, id_type, side: list[SideFeature]):
        import pyarrow as pa

        fields = [("label", pa.int8()), ("timestamp", self.time_type), ("user", id_type),
                  ("hist_item", pa.list_(id_type)), *((f"hist_{c}", pa.list_(pa.int32())) for c in self.events),
                  *((f"hist_{c}", pa.list_(pa.int32())) for c in self.opts.item_history_columns),
                  ("cand_item", id_type),
                  *((f.name, pa.float32() if f.num_embeddings is None else pa.int32()) for f in side),
                  *((name, pa.float32()) for name in self.mean_features())]
        return pa.schema(fields)

    def _samples(self, bucket, cut, side: list[SideFeature], schema, counts) -> Iterator[tuple[Any, np.ndarray]]:
        """The samples of one bucket's events, in chunks: (table, is_eval)."""
        import pyarrow as pa

        opts = self.opts
        user, item, times, row, label = (bucket.column(n).to_numpy() for n in ("user", "item", "time", "row", "label"))
        events = [bucket.column(f"e{i}").to_numpy() for i in range(len(self.events))]
        order = np.lexsort((row, times, user))  # by user, then time, then position in the log
        user, item, times, label = user[order], item[order], times[order], label[order]
        events = [e[order] for e in events]
        means = {c: label.astype(np.float64) if c == "label" else
                 bucket.column(f"m{self.means.index(c)}").to_numpy()[order] for c in opts.history_means}
        index = np.arange(user.shape[0], dtype=np.int64)
        user_start, hist_start, hist_stop = history_bounds(user, times, opts.max_history)
        if opts.max_history is not None:
            counts["capped"] += int((hist_stop - user_start > opts.max_history).sum())
        first_of_user = index == user_start
        if opts.split == "user":
            group = np.cumsum(first_of_user) - 1
            events_of_user = np.bincount(group)[group]
            num_eval = np.where(events_of_user >= 2, np.ceil(opts.eval_fraction * events_of_user), 0).astype(np.int64)
            is_eval = (index - user_start) >= events_of_user - num_eval
        else:
            is_eval = times >= cut
        timestamps = _time_array(times, self.time_type)
        # history means: over all the strictly earlier events [user_start, hist_stop), uncapped, from prefix sums
        num_earlier = hist_stop - user_start
        dense_means = []
        for values in means.values():
            prefix = np.concatenate([[0.0], np.cumsum(values)])
            sums = prefix[hist_stop] - prefix[user_start]
            dense_means.append(np.where(num_earlier > 0, sums / np.maximum(num_earlier, 1), 0.0))
        if means:
            dense_means.append(np.log1p(num_earlier.astype(np.float64)))
        lengths = hist_stop - hist_start
        id_type = schema.field("user").type
        item_lists = self.item_history_features(side)
        for lo, hi in _chunks(lengths, rows=1 << 18, tokens=1 << 24):
            positions, offsets = _ranges(hist_start[lo:hi], hist_stop[lo:hi])
            counts["history_events"] += int(offsets[-1])
            columns = {
                "label": pa.array(label[lo:hi]),
                "timestamp": timestamps[lo:hi],
                "user": pa.array(user[lo:hi]).cast(id_type),
                "hist_item": _lists(offsets, item[positions], id_type),
                **{f"hist_{c}": _lists(offsets, e[positions], pa.int32()) for c, e in zip(self.events, events)},
                **{f"hist_{f.name}": _lists(offsets, f.values[item[positions]], pa.int32()) for f in item_lists},
                "cand_item": pa.array(item[lo:hi]).cast(id_type),
            }
            for f in side:
                key = user if f.table == "user" else item
                columns[f.name] = pa.array(f.values[key[lo:hi]]).cast(schema.field(f.name).type)
            for name, values in zip(self.mean_features(), dense_means):
                columns[name] = pa.array(values[lo:hi].astype(np.float32))
            yield pa.Table.from_pydict(columns, schema=schema), is_eval[lo:hi]


def history_bounds(user: np.ndarray, times: np.ndarray, max_history: int | None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For events sorted by user, then time, then position in the log: (the index of the user's first event, the
    history's start, its stop). The history `[start, stop)` is the user's events with a strictly earlier time (it
    stops before the event's group of equal times), the most recent `max_history` of them (None: all)."""
    n = user.shape[0]
    index = np.arange(n, dtype=np.int64)
    first_of_user = np.ones(n, dtype=bool)
    first_of_user[1:] = user[1:] != user[:-1]
    first_of_time = first_of_user.copy()
    first_of_time[1:] |= times[1:] != times[:-1]
    user_start = np.maximum.accumulate(np.where(first_of_user, index, 0))
    hist_stop = np.maximum.accumulate(np.where(first_of_time, index, 0))
    hist_start = user_start if max_history is None else np.maximum(user_start, hist_stop - max_history)
    return user_start, hist_start, hist_stop


class TimeSample:
    """The times of a deterministic subsample of the events (every `stride`-th row, at most `capacity` kept), for
    the global cut's quantile; exact while the log has at most `capacity` events."""

    def __init__(self, capacity: int = 1 << 22):
        self.capacity, self.stride = capacity, 1
        self.kept: list[np.ndarray] = []
        self.size = 0

    def add(self, times: np.ndarray, first_row: int) -> None:
        rows = np.arange(first_row, first_row + times.shape[0])
        self.kept.append(times[rows % self.stride == 0])
        self.size += self.kept[-1].shape[0]
        while self.size > self.capacity:  # keep every other kept time: rows that are multiples of 2 * stride
            merged = np.concatenate(self.kept)
            rows = np.arange(merged.shape[0])
            self.kept, self.stride = [merged[rows % 2 == 0]], self.stride * 2
            self.size = self.kept[0].shape[0]

    def quantile(self, q: float):
        times = np.sort(np.concatenate(self.kept))
        return times[min(int(math.floor(q * times.shape[0])), times.shape[0] - 1)]


class _Rows:
    """`<file>: row <r>` of a batch starting at row `start` of its file."""

    def __init__(self, file: Path, start: int):
        self.file, self.start = file, start

    def __call__(self, row: int) -> str:
        return f"{self.file}: row {self.start + row}"


def _internal_time_type(time_type):
    import pyarrow as pa

    return pa.float64() if pa.types.is_floating(time_type) else pa.int64()


def _time_values(array, name: str, where: _Rows | None) -> np.ndarray:
    """A time column as int64 (integers; timestamps and dates in their unit) or float64 (finite)."""
    import pyarrow as pa

    if pa.types.is_timestamp(array.type) or pa.types.is_date(array.type) or pa.types.is_duration(array.type):
        array = array.cast(pa.int64() if array.type.bit_width == 64 else pa.int32())
    if pa.types.is_integer(array.type):
        values = array.to_numpy(zero_copy_only=False)
        if values.dtype == np.uint64 and values.size and values.max() > np.uint64(2**63 - 1):
            row = int(values.argmax())
            raise DataError(f"{where(row) if where else name}: column {name!r} holds {int(values[row])}, above "
                            f"2**63-1: times must fit int64")
        return values.astype(np.int64)
    if pa.types.is_floating(array.type):
        values = array.to_numpy(zero_copy_only=False).astype(np.float64)
        if not np.isfinite(values).all():
            row = int((~np.isfinite(values)).nonzero()[0][0])
            raise DataError(f"{where(row) if where else name}: column {name!r} holds {values[row]}; times must be "
                            f"finite")
        return values
    raise DataError(f"column {name!r} must hold times (integers, floating point, timestamps or dates), got type "
                    f"{array.type}" + (" (a CSV column of text: write times as numbers or ISO 8601)"
                                       if pa.types.is_string(array.type) else ""))


def _time_array(values: np.ndarray, time_type):
    """int64/float64 times back in the log's own type."""
    import pyarrow as pa

    if pa.types.is_integer(time_type) or pa.types.is_floating(time_type):
        return pa.array(values).cast(time_type)
    if pa.types.is_date(time_type) and time_type.bit_width == 32:
        return pa.array(values.astype(np.int32)).cast(time_type)
    return pa.array(values).cast(time_type)


def _ranges(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions `starts[r]..stops[r]-1` of every r, concatenated; list offsets [R + 1])."""
    lengths = stops - starts
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return positions, offsets


def _chunks(lengths: np.ndarray, rows: int, tokens: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of at most `rows` samples and, past the first sample, at most `tokens` history events."""
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    lo, n = 0, lengths.shape[0]
    while lo < n:
        hi = min(lo + rows, n)
        if cumulative[hi] - cumulative[lo] > tokens:
            hi = max(lo + 1, int(np.searchsorted(cumulative, cumulative[lo] + tokens, side="right")) - 1)
        yield lo, hi
        lo = hi


def _lists(offsets: np.ndarray, values: np.ndarray, value_type):
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values).cast(value_type))


# ---- the command ---------------------------------------------------------------------------------------------------


def build_sequences(opts: BuildOptions, log=print) -> dict[str, Any]:
    """Build `<opts.out>/{train,eval}.parquet`, the id maps and the config; returns what `dataset.json` holds."""
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()):
        if not opts.overwrite:
            raise FileExistsError(f"{out} is not empty; choose another output directory or pass --overwrite")
        for name in ("train.parquet", "eval.parquet", "dataset.json", "maps", "config", ".work"):
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    (out / "maps").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    builder = Builder(opts, log)
    builder.scan()
    log(f"read {builder.num_rows:,} events: {len(builder.users):,} users, {len(builder.items):,} items "
        f"({time.perf_counter() - started:.1f} s)")
    builder.users.write(out / "maps" / "user.parquet")
    builder.items.write(out / "maps" / "item.parquet")
    for c, m in builder.events.items():
        m.write(out / "maps" / f"{c}.parquet")
    cut = builder.eval_cut() if opts.split == "global" else None
    side = builder.side_features()
    work = out / ".work"
    work.mkdir()
    try:
        buckets = builder.partition(work)
        log(f"partitioned them by user into {len(buckets)} bucket(s) ({time.perf_counter() - started:.1f} s)")
        counts = builder.write_samples(buckets, cut, side)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if counts["train"] == 0 or counts["eval"] == 0:
        empty = "train" if counts["train"] == 0 else "eval"
        raise DataError(f"the split leaves no {empty} samples ({counts['train']} train, {counts['eval']} eval); "
                        f"change --eval-from / --eval-fraction")
    summary = _summary(opts, builder, side, counts, cut)
    (out / "dataset.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_config(out, summary)
    cap_note = ("histories uncapped" if opts.max_history is None else
                f"{counts['capped']:,} histories capped at their {opts.max_history} most recent events")
    log(f"wrote {counts['train']:,} training and {counts['eval']:,} eval samples to {out} "
        f"({cap_note}; {time.perf_counter() - started:.1f} s)")
    return summary


def _summary(opts: BuildOptions, builder: Builder, side: list[SideFeature], counts: dict[str, int], cut) -> dict:
    out = Path(opts.out).resolve()
    event_features = [{"column": f"hist_{c}", "num_embeddings": len(m)} for c, m in builder.events.items()]
    event_features += [{"column": f"hist_{f.name}", "num_embeddings": f.num_embeddings}
                       for f in builder.item_history_features(side)]
    pooled = [{"column": "user", "num_embeddings": len(builder.users)}]
    pooled += [{"column": f.name, "num_embeddings": f.num_embeddings} for f in side if f.num_embeddings is not None]
    split = {"mode": opts.split, "eval_fraction": opts.eval_fraction if opts.eval_from is None else None}
    if opts.split == "global":
        split["cut"] = cut.item() if hasattr(cut, "item") else cut
        split["rule"] = "events with a time at or after the cut are eval samples"
    else:
        split["rule"] = "each user's last ceil(eval_fraction * n) of n events are eval samples (none when n = 1)"
    return {
        "log": str(Path(opts.log).resolve()),
        "train": str(out / "train.parquet"),
        "eval": str(out / "eval.parquet"),
        "rows": {"events": builder.num_rows, "train": counts["train"], "eval": counts["eval"]},
        "num_users": len(builder.users),
        "num_items": len(builder.items),
        "label": opts.label or f"{opts.rating} >= {opts.threshold}",
        "rating": opts.rating,  # with the threshold: the label's rule in parts (None with --label)
        "threshold": opts.threshold,
        "max_history": opts.max_history,
        "histories_capped": counts["capped"],
        "history_events": counts["history_events"],
        "history": "the user's events with a strictly earlier time, oldest first (equal times ordered by position in "
                   "the log; events with equal times never see each other), the most recent max_history of them",
        "split": split,
        "history_means": {"columns": list(opts.history_means), "features": builder.mean_features(),
                          "rule": "hist_mean_<column>: the mean of the column (label: the 0/1 label) over all the "
                                  "user's events with a strictly earlier time (not only the capped history), 0.0 "
                                  "with none; hist_log1p_count: log1p of their number"} if opts.history_means else None,
        "data": {
            "path": str(out / "train.parquet"),
            "eval_path": str(out / "eval.parquet"),
            "label": "label",
            "timestamp": "timestamp",
            "history_item": "hist_item",
            "candidate_item": "cand_item",
            "num_items": len(builder.items),
            "event_features": event_features,
            "pooled_features": pooled,
            "dense_features": [f.name for f in side if f.num_embeddings is None] + builder.mean_features(),
        },
    }


def _write_config(out: Path, summary: dict) -> None:
    data = summary["data"]
    lines = ["# data=parquet config of the samples built beside it (python -m gem_lp.data.build_sequences)",
             "defaults:", "  - parquet", "  - _self_"]
    for key, value in data.items():
        lines.append(f"{key}: {json.dumps(value)}")
    path = out / "config" / "data" / "logs.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def train_overrides(summary: dict) -> list[str]:
    """The `train.py` overrides that train on a build's output (`data=parquet data.path=... ...`)."""
    d = summary["data"]

    def features(items):
        return "[" + ", ".join(f"{{column: {f['column']}, num_embeddings: {f['num_embeddings']}}}" for f in items) + "]"

    out = ["data=parquet", f"data.path={d['path']}", f"data.eval_path={d['eval_path']}",
           f"data.timestamp={d['timestamp']}", f"data.num_items={d['num_items']}",
           f"data.pooled_features={features(d['pooled_features'])}"]
    if d["event_features"]:
        out.append(f"data.event_features={features(d['event_features'])}")
    if d["dense_features"]:
        out.append(f"data.dense_features=[{','.join(d['dense_features'])}]")
    return out


def train_command(summary: dict) -> str:
    """The `python train.py data=parquet ...` line that trains on a build's output."""
    quoted = [f"'{o}'" if "[" in o else o for o in train_overrides(summary)]
    return " \\\n    ".join(["python train.py " + quoted[0], *quoted[1:]])


def parse_args(argv: list[str] | None = None) -> BuildOptions:
    p = argparse.ArgumentParser(
        prog="python -m gem_lp.data.build_sequences",
        description="Turn an interaction log (one row per event) into the Parquet samples of data=parquet: each "
                    "event with its user's earlier events as the history, split by time into train and eval.")
    p.add_argument("log", help="the log: a Parquet, CSV or TSV file, or a directory of them")
    p.add_argument("out", help="the output directory (train.parquet, eval.parquet, maps/, config/, dataset.json)")
    p.add_argument("--format", choices=FORMATS, help="the log's format (default: from its name)")
    p.add_argument("--user", default="user_id", help="user id column (default: %(default)s)")
    p.add_argument("--item", default="item_id", help="item id column (default: %(default)s)")
    p.add_argument("--time", default="timestamp", help="time column: integer, floating point, timestamp or date "
                                                       "(default: %(default)s)")
    p.add_argument("--label", help="0/1 label column")
    p.add_argument("--rating", help="rating column, made a label with --threshold")
    p.add_argument("--threshold", type=float, help="label = rating >= threshold")
    p.add_argument("--event-columns", default="", help="comma-separated per-event categorical columns, written as "
                                                       "history lists hist_<column>")
    p.add_argument("--user-table", help="user side table (Parquet/CSV/TSV), one row per user")
    p.add_argument("--user-key", help="its user id column (default: --user)")
    p.add_argument("--item-table", help="item side table, one row per item")
    p.add_argument("--item-key", help="its item id column (default: --item)")
    p.add_argument("--item-history-columns", default="",
                   help="comma-separated categorical item-table columns also written per history event, as history "
                        "lists hist_<column> (e.g. each earlier item's genre beside it)")
    p.add_argument("--dense", default="", help="comma-separated side-table columns taken as numbers (dense "
                                               "features); the others are categorical ids")
    p.add_argument("--dense-fill", type=float, help="value of a dense side feature for a user/item its table lacks "
                                                    "(default: such a gap is an error)")
    p.add_argument("--history-means", default="", help="comma-separated numeric per-event columns (or 'label', the "
                                                       "0/1 label) averaged over each sample's strictly earlier "
                                                       "events, all of them (not only the capped history): dense "
                                                       "features hist_mean_<column>, with hist_log1p_count")
    p.add_argument("--max-history", default="50", help="keep the most recent N earlier events, or 'none' "
                                                       "(default: %(default)s)")
    p.add_argument("--split", choices=SPLITS, default="global",
                   help="global: one time cut for everyone; user: each user's last fraction (default: %(default)s)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="the fraction of events for eval (default: "
                                                                    "%(default)s)")
    p.add_argument("--eval-from", help="global split: the cut time itself (in the time column's terms); events at or "
                                       "after it are eval samples")
    p.add_argument("--bucket-rows", type=int, default=2_000_000, help="events per bucket, about (memory: "
                                                                      "default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier build in the output directory")
    a = p.parse_args(argv)
    max_history = None if a.max_history.lower() in ("none", "null", "0") else _int(a.max_history, "--max-history")
    split_list = lambda text: tuple(c for c in text.split(",") if c)  # noqa: E731
    try:
        return BuildOptions(log=a.log, out=a.out, format=a.format, user=a.user, item=a.item, time=a.time,
                            label=a.label, rating=a.rating, threshold=a.threshold,
                            event_columns=split_list(a.event_columns), user_table=a.user_table, user_key=a.user_key,
                            item_table=a.item_table, item_key=a.item_key,
                            item_history_columns=split_list(a.item_history_columns), dense=split_list(a.dense),
                            dense_fill=a.dense_fill, history_means=split_list(a.history_means),
                            max_history=max_history, split=a.split,
                            eval_fraction=None if a.eval_from is not None else a.eval_fraction,
                            eval_from=a.eval_from, bucket_rows=a.bucket_rows, overwrite=a.overwrite)
    except ValueError as err:
        p.error(str(err))


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"{flag}: expected an integer or 'none', got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        summary = build_sequences(opts, log=lambda line: print(line, file=sys.stderr))
    except (DataError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"build_sequences: {err}", file=sys.stderr)
        return 1
    out = Path(opts.out)
    print(f"\nTrain on it:\n\n{train_command(summary)}\n\nor, with the config written beside it:\n\n"
          f"python train.py --config-dir {out / 'config'} data=logs\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
