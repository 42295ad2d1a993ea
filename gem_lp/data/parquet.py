"""Real logs from Parquet: one row per sample, read into `RecBatch`es (`data=parquet data.path=...`).

Columns (names set in the config, `gem_lp/configs/data/parquet.yaml`):

* `label`: 0 or 1 (any numeric or boolean type);
* `history_item`: list of int item ids, the user's history, oldest first (may be empty);
* each of `event_features`: list of int ids of the same length as `history_item` in every row;
* `candidate_item`: int, the item to score;
* each of `pooled_features`: int, or list of int (any number of ids);
* each of `dense_features` (may be none): a numeric column, one float feature;
* `timestamp` (optional): the sample's time (integer, floating point, timestamp or date), to check or sort the
  rows' time order.

A column may serve several roles (the candidate item also as a pooled feature, a numeric id also as a dense
feature), except the label, which serves as nothing else. Nothing is dropped, clipped or cast silently: nulls, ids
outside `[0, num_embeddings)`, non-finite dense values, labels other than 0/1, event lists whose length differs
from the history's, and rows out of time order where the order decides the eval split are errors naming the file,
the column and the row. The files are read once into memory (pyarrow); batch `i` of the training stream is a pure
function of `(seed, i)`, so a run resumes exactly.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import MISSING
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from .batch import RecBatch
from .spec import DataError, EmbeddingFeature, FeatureSpec, schema_hash

log = logging.getLogger(__name__)

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass
class ColumnFeature:
    """An id column and the size of its embedding table (ids in `[0, num_embeddings)`)."""

    column: str = MISSING
    num_embeddings: int = MISSING


@dataclasses.dataclass
class ParquetDataConfig:
    """Where the logs are and which column is what (see the module docstring for the column types).

    `eval_path` holds the eval rows; without it, the last `eval_fraction` of `path`'s rows are held out for eval and
    never trained on. Those must be the most recent rows: name the `timestamp` column and the rows' time order is
    checked (or, with `sort_by_time`, made: a stable sort of every file read by time). `max_history` keeps the most
    recent `max_history` events of each history (null: all of them).
    """

    path: str = MISSING  # a .parquet file, or a directory of them
    eval_path: str | None = None
    eval_fraction: float = 0.1
    batch_size: int = 128
    shuffle: bool = True  # a new order of the training rows every epoch (drawn from the seed and the epoch)
    # An epoch's last, partial batch is left out: every training step then has the batch shape the kernels were
    # built and the sequence graphs captured for (a batch of fewer sequences takes other kernel variants, built
    # mid-run), and a few rows do not weigh as much as a full batch in an update. With `shuffle` each epoch leaves
    # out other rows. False trains on it.
    drop_last: bool = True
    label: str = "label"
    history_item: str = "hist_item"
    candidate_item: str = "cand_item"
    num_items: int = MISSING  # rows of the item table, shared by history_item and candidate_item
    event_features: list[ColumnFeature] = dataclasses.field(default_factory=list)
    pooled_features: list[ColumnFeature] = MISSING
    dense_features: list[str] = dataclasses.field(default_factory=list)
    timestamp: str | None = None
    sort_by_time: bool = False
    max_history: int | None = None
    # Each dense feature standardized by the training rows' mean and standard deviation (the eval rows by the same
    # numbers), as the model's dense input is one linear layer: raw features of different scales (an age of 16-75
    # beside a mean rating of 1-5) train it badly. False feeds the values as they are.
    dense_standardize: bool = True

    def __post_init__(self):
        missing = [f"data.{name}" for name in ("path", "num_items", "pooled_features")
                   if getattr(self, name) == MISSING]
        if missing:
            raise ValueError(f"data=parquet needs {', '.join(missing)} (not set; see gem_lp/configs/data/parquet.yaml "
                             f"and docs/data.md)")
        self.event_features = [_column_feature(f, "event_features") for f in self.event_features]
        self.pooled_features = [_column_feature(f, "pooled_features") for f in self.pooled_features]
        self.dense_features = list(self.dense_features)
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.num_items < 1:
            raise ValueError(f"data.num_items must be >= 1, got {self.num_items}")
        if self.eval_path is None and not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1) when data.eval_path is null, "
                             f"got {self.eval_fraction}")
        if self.max_history is not None and self.max_history < 1:
            raise ValueError(f"data.max_history must be null (every event) or >= 1, got {self.max_history}")
        if self.sort_by_time and not self.timestamp:
            raise ValueError("data.sort_by_time=true needs data.timestamp, the column to sort by")
        if not self.pooled_features:
            raise ValueError("data.pooled_features must list at least one {column, num_embeddings}")
        self._check_roles()

    def _check_roles(self) -> None:
        """One column may serve several roles, but not twice in one role, and the label serves as nothing else."""
        if self.history_item == self.candidate_item:
            raise ValueError(f"data.history_item and data.candidate_item must be two columns (a list of ids and one "
                             f"id), both are {self.history_item!r}")
        for role, names in (("event_features", [f.column for f in self.event_features]),
                            ("pooled_features", [f.column for f in self.pooled_features]),
                            ("dense_features", self.dense_features)):
            repeated = sorted({c for c in names if names.count(c) > 1})
            if repeated:
                raise ValueError(f"data.{role} lists {repeated} more than once")
        roles = self.roles
        if len(roles[self.label]) > 1:
            raise ValueError(f"data.label: column {self.label!r} is also {sorted(roles[self.label] - {'label'})}: the "
                             f"label cannot be a feature")
        if self.history_item in {f.column for f in self.event_features}:
            raise ValueError(f"data.event_features: {self.history_item!r} is the history itself (data.history_item)")

    @property
    def roles(self) -> dict[str, set[str]]:
        """Every column read, with the roles it serves."""
        out: dict[str, set[str]] = {}
        for role, column in (("label", self.label), ("history_item", self.history_item),
                             ("candidate_item", self.candidate_item), ("timestamp", self.timestamp),
                             *(("event_features", f.column) for f in self.event_features),
                             *(("pooled_features", f.column) for f in self.pooled_features),
                             *(("dense_features", c) for c in self.dense_features)):
            if column:
                out.setdefault(column, set()).add(role)
        return out

    @property
    def columns(self) -> list[str]:
        """Every column read, once each, in the order of the module docstring."""
        return list(self.roles)

    def check_paths(self) -> None:
        """Raise FileNotFoundError naming the key when `path` or `eval_path` does not exist, and `DataError` when
        the eval rows would be among the training rows."""
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                raise FileNotFoundError(f"data.{key}: no Parquet file or directory at {value}")
        if self.eval_path is not None:
            train, evals = Path(self.path).resolve(), Path(self.eval_path).resolve()
            if train == evals or train in evals.parents:
                where = "data.path" if train == evals else "inside data.path"
                raise DataError(f"data.eval_path {self.eval_path} is {where} {self.path}: the eval rows would be "
                                f"trained on; keep them apart")

    def feature_spec(self) -> FeatureSpec:
        """The batches' keys are the column names."""
        return FeatureSpec(
            num_items=self.num_items,
            num_dense=len(self.dense_features),
            pooled_features=tuple(EmbeddingFeature(f.column, f.num_embeddings) for f in self.pooled_features),
            event_features=tuple(EmbeddingFeature(f.column, f.num_embeddings) for f in self.event_features),
            history_key=self.history_item,
            candidate_key=self.candidate_item,
        )


def _column_feature(f, where: str) -> ColumnFeature:
    f = f if isinstance(f, ColumnFeature) else ColumnFeature(**dict(f))
    if not isinstance(f.column, str) or not f.column or f.column == MISSING:
        raise ValueError(f"data.{where}: every entry needs a column name, got {f.column!r}")
    if not isinstance(f.num_embeddings, int) or f.num_embeddings < 1:
        raise ValueError(f"data.{where}: column {f.column!r} needs num_embeddings >= 1, got {f.num_embeddings!r}")
    return f


@dataclasses.dataclass
class Jagged:
    """Per-row lists: row r holds `values[offsets[r]:offsets[r + 1]]` (int64, offsets `[N + 1]`)."""

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def rows(self, lo: int, hi: int) -> "Jagged":
        start, stop = int(self.offsets[lo]), int(self.offsets[hi])
        return Jagged(self.values[start:stop], self.offsets[lo:hi + 1] - start)

    def index(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `values`, lengths) of `rows`, concatenated in the order given."""
        return _ranges(self.offsets[rows], self.offsets[rows + 1])

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, lengths) of `rows`, concatenated in the order given."""
        index, lengths = self.index(rows)
        return self.values[index], lengths

    def take(self, rows: torch.Tensor) -> "Jagged":
        """The lists of `rows`, in that order."""
        values, lengths = self.gather(rows)
        return Jagged(values, _offsets(lengths))


def _ranges(starts: torch.Tensor, stops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the positions `starts[r]..stops[r]-1` of every r, concatenated; the lengths)."""
    lengths = stops - starts
    total = int(lengths.sum())
    out_starts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - out_starts, lengths, output_size=total) + torch.arange(total), lengths


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


@dataclasses.dataclass
class ParquetRows:
    """Every column of some Parquet rows in memory, as torch tensors, in file order (or time order, sorted)."""

    spec: FeatureSpec
    labels: torch.Tensor  # float32 [N]
    history: Jagged  # item ids
    events: list[torch.Tensor]  # per event feature, int64 values aligned with `history.values`
    candidates: torch.Tensor  # int64 [N]
    pooled: list[Jagged]
    dense: torch.Tensor  # float32 [N, F]
    times: torch.Tensor | None = None  # int64 or float64 [N]: the timestamp column's values, when configured

    def __len__(self) -> int:
        return self.labels.shape[0]

    def rows(self, lo: int, hi: int) -> "ParquetRows":
        history = self.history.rows(lo, hi)
        start, stop = int(self.history.offsets[lo]), int(self.history.offsets[hi])
        return ParquetRows(self.spec, self.labels[lo:hi], history, [e[start:stop] for e in self.events],
                           self.candidates[lo:hi], [p.rows(lo, hi) for p in self.pooled], self.dense[lo:hi],
                           None if self.times is None else self.times[lo:hi])

    def take(self, rows: torch.Tensor) -> "ParquetRows":
        """The rows `rows` (int64 indices), in that order."""
        index, lengths = self.history.index(rows)
        return ParquetRows(self.spec, self.labels[rows], Jagged(self.history.values[index], _offsets(lengths)),
                           [e[index] for e in self.events], self.candidates[rows], [p.take(rows) for p in self.pooled],
                           self.dense[rows], None if self.times is None else self.times[rows])

    def batch(self, rows: torch.Tensor) -> RecBatch:
        """The `RecBatch` of `rows` (int64 row indices), in that order."""
        spec = self.spec
        index, n = self.history.index(rows)
        items = self.history.values[index]
        events = [e[index] for e in self.events]  # aligned with the history: the same positions
        b = rows.shape[0]
        sequence = KeyedJaggedTensor.from_lengths_sync(
            keys=list(spec.sequence_keys),
            values=torch.cat([items, *events, self.candidates[rows]]),
            lengths=torch.cat([n] * (1 + len(events)) + [torch.ones(b, dtype=torch.int64)]),
        )
        pooled = [p.gather(rows) for p in self.pooled]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f.key for f in spec.pooled_features],
            values=torch.cat([values for values, _ in pooled]),
            lengths=torch.cat([lengths for _, lengths in pooled]),
        )
        return RecBatch(sparse, sequence, self.dense[rows], self.labels[rows])


@dataclasses.dataclass
class ParquetFiles:
    """What a path read holds: its files (in read order) with their row counts, and the read columns' types."""

    path: str
    files: list[tuple[str, int]]
    schema: dict[str, str]  # column -> Arrow type, of the columns read

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.files)

    def row(self, i: int) -> str:
        """`row i`, and for a directory the file and the row within it."""
        if len(self.files) == 1:
            return f"row {i}"
        local = i
        for name, n in self.files:
            if local < n:
                return f"row {i} ({Path(name).name}: row {local})"
            local -= n
        return f"row {i}"

    def schema_hash(self) -> str:
        return schema_hash(self.schema)


def read_parquet(cfg: ParquetDataConfig, path: str | Path) -> ParquetRows:
    """Read and check the configured columns of `path` (a file or a directory of files)."""
    return read_parquet_files(cfg, path)[0]


def read_parquet_files(cfg: ParquetDataConfig, path: str | Path) -> tuple[ParquetRows, ParquetFiles]:
    """`read_parquet`, with what was read (files, row counts, column types)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("data=parquet needs pyarrow (pip install pyarrow)") from err
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data: no Parquet file or directory at {path}")
    dataset = pq.ParquetDataset(path)
    missing = [c for c in cfg.columns if c not in dataset.schema.names]
    if missing:
        raise DataError(f"data: {path} lacks the columns {missing}; it has {dataset.schema.names}")
    files = ParquetFiles(str(path), [(f.path, f.metadata.num_rows) for f in dataset.fragments],
                         {c: str(dataset.schema.field(c).type) for c in cfg.columns})
    table = dataset.read(columns=cfg.columns)
    if table.num_rows == 0:
        raise DataError(f"data: {path} holds no rows")
    if table.num_rows != files.num_rows:  # the row locations in messages rely on it
        files.files = [(str(path), table.num_rows)]
    spec = cfg.feature_spec()
    column = {name: table.column(name).combine_chunks() for name in cfg.columns}

    def where(name: str) -> str:
        return f"{path}: column {name!r}"

    labels = _numbers(column[cfg.label], where(cfg.label), files)
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise DataError(f"{where(cfg.label)}: labels must be 0 or 1, {files.row(row)} holds {float(labels[row])}")
    history = _id_lists(column[cfg.history_item], where(cfg.history_item), spec.num_items, files)
    events = []
    for f in spec.event_features:
        event = _id_lists(column[f.key], where(f.key), f.num_embeddings, files)
        differs = event.offsets != history.offsets
        if bool(differs.any()):
            row = int(differs.nonzero()[0]) - 1
            held, expected = (int(o[row + 1] - o[row]) for o in (event.offsets, history.offsets))
            raise DataError(f"{where(f.key)}: {files.row(row)} holds {held} ids, its {cfg.history_item!r} list "
                            f"{expected}; an event feature needs one id per history event")
        events.append(event.values)
    if cfg.max_history is not None:
        history, events = _most_recent(history, events, cfg.max_history, path)
    candidates = _ids(column[cfg.candidate_item], where(cfg.candidate_item), spec.num_items, files)
    pooled = [_id_lists(column[f.key], where(f.key), f.num_embeddings, files) for f in spec.pooled_features]
    dense = torch.zeros(table.num_rows, len(cfg.dense_features), dtype=torch.float32)
    for j, name in enumerate(cfg.dense_features):
        dense[:, j] = _dense(column[name], where(name), files)
    times = _times(column[cfg.timestamp], where(cfg.timestamp), files) if cfg.timestamp else None
    return ParquetRows(spec, labels.float(), history, events, candidates, pooled, dense, times), files


def _most_recent(history: Jagged, events: list[torch.Tensor], max_history: int, path: Path):
    """Each history (and its event features) cut to its last `max_history` events: the most recent, oldest first."""
    lengths = history.lengths
    capped = int((lengths > max_history).sum())
    if capped == 0:
        return history, events
    stops = history.offsets[1:]
    index, kept = _ranges(torch.maximum(history.offsets[:-1], stops - max_history), stops)
    log.info("data: %s: %d of %d histories hold more than data.max_history=%d events; each keeps its %d most recent",
             path, capped, lengths.shape[0], max_history, max_history)
    return Jagged(history.values[index], _offsets(kept)), [e[index] for e in events]


def _numbers(array, what: str, files: ParquetFiles) -> torch.Tensor:
    import pyarrow as pa

    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        raise DataError(f"{what} must be numeric, got type {array.type}")
    _no_nulls(array, what, files)
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).astype("float64"))


def _dense(array, what: str, files: ParquetFiles) -> torch.Tensor:
    """A numeric column as float32, every value finite and inside float32's range."""
    values = _numbers(array, what, files)
    bad = ~torch.isfinite(values) | (values.abs() > _FLOAT32_MAX)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        value = array[row].as_py()
        reason = "dense features must be finite" if not math.isfinite(float(values[row])) else \
            "outside float32's range, the dense features' type"
        raise DataError(f"{what}: {files.row(row)} holds {value}; {reason}")
    return values.float()


def _times(array, what: str, files: ParquetFiles) -> torch.Tensor:
    """The timestamp column as int64 (integers, timestamps, dates: in their own unit) or float64, for comparing."""
    import pyarrow as pa

    _no_nulls(array, what, files)
    if pa.types.is_timestamp(array.type) or pa.types.is_date(array.type) or pa.types.is_duration(array.type):
        array = array.cast(pa.int64() if array.type.bit_width == 64 else pa.int32())
    if pa.types.is_integer(array.type):
        values = array.to_numpy()
        if values.dtype == np.uint64 and values.size and int(values.max()) > 2**63 - 1:
            i = int(values.argmax())
            raise DataError(f"{what}: {files.row(i)} holds {int(values[i])}, above 2**63-1: timestamps must fit int64")
        return torch.from_numpy(values.astype(np.int64))
    if pa.types.is_floating(array.type):
        values = torch.from_numpy(array.to_numpy().astype(np.float64))
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise DataError(f"{what}: {files.row(row)} holds {float(values[row])}; timestamps must be finite")
        return values
    raise DataError(f"{what} must hold times (integer, floating point, timestamp or date), got type {array.type}")


def _no_nulls(array, what: str, files: ParquetFiles) -> None:
    if array.null_count:
        row = int(array.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0])
        raise DataError(f"{what}: {files.row(row)} is null; every row needs a value")


def _checked_ids(values: np.ndarray, num_embeddings: int, what: str, row_of) -> torch.Tensor:
    """`values` (any numpy integer type, compared in it: a uint64 id above 2**63-1 is reported as it is) as int64."""
    bad = (values < 0) | (values >= num_embeddings)
    if bad.any():
        i = int(bad.nonzero()[0][0])
        raise DataError(f"{what}: {row_of(i)} holds id {int(values[i])}, outside [0, {num_embeddings}) "
                        f"(num_embeddings {num_embeddings})")
    return torch.from_numpy(values.astype(np.int64))


def _ids(array, what: str, num_embeddings: int, files: ParquetFiles) -> torch.Tensor:
    import pyarrow as pa

    if not pa.types.is_integer(array.type):
        raise DataError(f"{what} must hold integer ids, got type {array.type}")
    _no_nulls(array, what, files)
    return _checked_ids(array.to_numpy(), num_embeddings, what, files.row)


def _id_lists(array, what: str, num_embeddings: int, files: ParquetFiles) -> Jagged:
    """An int column (one id per row) or a list-of-int column, as `Jagged`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(array.type):
        values = _ids(array, what, num_embeddings, files)
        return Jagged(values, torch.arange(values.shape[0] + 1, dtype=torch.int64))
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) or \
            not pa.types.is_integer(array.type.value_type):
        raise DataError(f"{what} must hold integer ids or lists of them, got type {array.type}")
    _no_nulls(array, what, files)
    offsets = _offsets(torch.from_numpy(pc.list_value_length(array).to_numpy().astype(np.int64)))
    flat = pc.list_flatten(array)

    def row_of(i: int) -> str:
        return files.row(int(torch.searchsorted(offsets, int(i), right=True)) - 1)

    if flat.null_count:
        raise DataError(f"{what}: {row_of(int(flat.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]))} "
                        f"holds a null id")
    return Jagged(_checked_ids(flat.to_numpy(), num_embeddings, what, row_of), offsets)


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"parquet:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ParquetRecDataset(IterableDataset):
    """Training batches over `rows`, epoch after epoch, forever (use `DataLoader(dataset, batch_size=None)`).

    Batch `i` holds rows `order_e[j * B : (j + 1) * B]` with `e, j = divmod(i, batches_per_epoch)`: each
    epoch visits every row once, the last batch of an epoch holding the remainder (fewer than B rows), or with
    `drop_last` every row of its full batches (the remainder, `len(rows) % B` rows, left out). `order_e` is the
    file order, or with `shuffle` a permutation drawn from `(seed, e)`. Loader workers split the batches (worker w
    of n yields `start + w`, `start + w + n`, ...), each holding the rows once (shared with the parent process when
    workers fork).
    """

    def __init__(self, rows: ParquetRows, batch_size: int, seed: int, start: int = 0, shuffle: bool = True,
                 drop_last: bool = False):
        super().__init__()
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if drop_last and len(rows) < batch_size:
            raise DataError(f"data: {len(rows)} training rows make no full batch of data.batch_size={batch_size} "
                            f"(data.drop_last=true leaves out an epoch's partial batch); lower data.batch_size or "
                            f"set data.drop_last=false")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self.batches_per_epoch = len(rows) // batch_size if drop_last else math.ceil(len(rows) / batch_size)
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.rows)
            order = (torch.randperm(n, generator=torch.Generator().manual_seed(_epoch_seed(self.seed, epoch)))
                     if self.shuffle else torch.arange(n))
            self._order = (epoch, order)
        return self._order[1]

    def batch(self, index: int) -> RecBatch:
        epoch, j = divmod(index, self.batches_per_epoch)
        return self.rows.batch(self.order(epoch)[j * self.batch_size:(j + 1) * self.batch_size])

    def __iter__(self):
        info = get_worker_info()  # worker w of n yields batches start + w, start + w + n, ... (as the synthetic set)
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        index = self.start + worker
        while True:
            yield self.batch(index)
            index += workers


class ParquetSource:
    """`data=parquet`: the training rows and the eval rows of the configured files.

    Without `eval_path`, the eval rows are the last `eval_fraction` of `path`'s rows, which must be the most recent:
    with `timestamp` set, rows out of time order are an error naming the first of them (or, with `sort_by_time`, the
    rows are sorted by time first, ties keeping file order); without it the order cannot be checked, and a warning
    says so.
    """

    def __init__(self, cfg: ParquetDataConfig, seed: int):
        cfg.check_paths()
        self.cfg = cfg
        self.seed = seed
        self.features = cfg.feature_spec()
        rows, self.train_files = read_parquet_files(cfg, cfg.path)
        rows = self._time_ordered(rows)
        if cfg.eval_path is not None:
            eval_rows, self.eval_files = read_parquet_files(cfg, cfg.eval_path)
            self.train_rows, self.eval_rows = rows, self._time_ordered(eval_rows)
            self.split = f"data.eval_path {cfg.eval_path}"
            log.info("data: %d training rows from %s, %d eval rows from %s", len(rows), cfg.path,
                     len(self.eval_rows), cfg.eval_path)
            self._note_time_overlap()
        else:
            self.eval_files = None
            if cfg.timestamp and not cfg.sort_by_time:
                _check_time_order(rows.times, f"{cfg.path}: column {cfg.timestamp!r}", self.train_files)
            n_eval = math.ceil(len(rows) * cfg.eval_fraction)
            if n_eval >= len(rows):
                raise DataError(f"data: {cfg.path} holds {len(rows)} rows, too few to hold out "
                                f"eval_fraction={cfg.eval_fraction} for eval and train on the rest; "
                                f"give data.eval_path or more rows")
            self.train_rows, self.eval_rows = rows.rows(0, len(rows) - n_eval), rows.rows(len(rows) - n_eval, len(rows))
            order = (f"by time (column {cfg.timestamp!r}, {'sorted' if cfg.sort_by_time else 'order checked'})"
                     if cfg.timestamp else "in file order (time order unchecked: no data.timestamp)")
            self.split = f"the last {n_eval} rows {order}"
            log.info("data: %s: %d training rows, %s held out for eval", cfg.path, len(self.train_rows), self.split)
            if not cfg.timestamp:
                log.warning("data: the eval rows are the last %d rows of %s in file order; nothing checks that they "
                            "are the most recent. Name the time column (data.timestamp=<column>) to check it, or give "
                            "data.eval_path", n_eval, cfg.path)
        self._standardize_dense()

    def _standardize_dense(self) -> None:
        """Dense features as `(x - mean) / std` with the training rows' FP64 mean and standard deviation (1 where
        a feature is constant), for training and eval rows alike; the numbers go to the fingerprint."""
        self.dense_scaling = None
        if not (self.cfg.dense_standardize and self.cfg.dense_features):
            return
        train = self.train_rows.dense.double()
        mean, std = train.mean(0), train.std(0, unbiased=False)
        std = torch.where(std > 0, std, torch.ones_like(std))
        for rows in (self.train_rows, self.eval_rows):
            rows.dense = ((rows.dense.double() - mean) / std).float()
        self.dense_scaling = {name: {"mean": float(m), "std": float(s)}
                              for name, m, s in zip(self.cfg.dense_features, mean, std)}
        log.info("data: dense features standardized by the training rows' mean and std: %s",
                 ", ".join(f"{n} ({v['mean']:.4g}, {v['std']:.4g})" for n, v in self.dense_scaling.items()))

    def _time_ordered(self, rows: ParquetRows) -> ParquetRows:
        if not self.cfg.sort_by_time:
            return rows
        order = torch.sort(rows.times, stable=True).indices
        return rows.take(order)

    def _note_time_overlap(self) -> None:
        """With a timestamp column and a separate eval file: log both time ranges, and whether they overlap."""
        if self.train_rows.times is None:
            return
        train, evals = self.train_rows.times, self.eval_rows.times
        overlap = evals.min() < train.max()
        log.info("data: training rows from t=%s to %s, eval rows from t=%s to %s%s", train.min().item(),
                 train.max().item(), evals.min().item(), evals.max().item(),
                 " (overlapping: fine for a per-user split, where every eval event follows its own user's training "
                 "events)" if overlap else "")

    @property
    def num_eval_rows(self) -> int:
        return len(self.eval_rows)

    def train_dataset(self, start: int) -> ParquetRecDataset:
        return ParquetRecDataset(self.train_rows, self.cfg.batch_size, self.seed, start, self.cfg.shuffle,
                                 self.cfg.drop_last)

    def eval_batches(self, limit: int | None = None) -> Iterator[RecBatch]:
        """The eval rows in file order (time order when sorted), in batches of `batch_size` (the last one may be
        smaller): all of them, or the first `limit` batches. Each batch is built as it is asked for."""
        b, n = self.cfg.batch_size, len(self.eval_rows)
        count = math.ceil(n / b) if limit is None else min(limit, math.ceil(n / b))
        for k in range(count):
            yield self.eval_rows.batch(torch.arange(k * b, min((k + 1) * b, n)))

    def fingerprint(self) -> dict[str, Any]:
        """What the run read: paths, files, row counts, the columns' types and their hash, the split."""
        files = [self.train_files] + ([self.eval_files] if self.eval_files is not None else [])
        return {
            "source": "parquet",
            "paths": {"train": self.cfg.path, "eval": self.cfg.eval_path},
            "files": [name for f in files for name, _ in f.files],
            "bytes": sum(Path(name).stat().st_size for f in files for name, _ in f.files),
            "rows": {"train": len(self.train_rows), "eval": len(self.eval_rows)},
            "schema": self.train_files.schema,
            "schema_hash": self.train_files.schema_hash(),
            "eval_split": self.split,
            "max_history": self.cfg.max_history,
            "dense_standardized": self.dense_scaling,
        }


def _check_time_order(times: torch.Tensor, what: str, files: ParquetFiles) -> None:
    """Raise `DataError` naming the first row whose time is earlier than the row before it."""
    if times.shape[0] < 2:
        return
    earlier = times[1:] < times[:-1]
    if bool(earlier.any()):
        row = int(earlier.nonzero()[0]) + 1
        raise DataError(f"{what}: the rows are not in time order: {files.row(row)} (t={times[row].item()}) is earlier "
                        f"than the row before it (t={times[row - 1].item()}), and the eval rows are the last "
                        f"data.eval_fraction of the rows; sort the file by time, set data.sort_by_time=true, or give "
                        f"data.eval_path")
