"""Real logs from Parquet: one row per sample, read into `RecBatch`es (`data=parquet data.path=...`).

Columns (names set in the config, `gem_lp/configs/data/parquet.yaml`):

* `label`: 0 or 1 (any numeric type);
* `history_item`: list of int item ids, the user's history, oldest first (may be empty);
* each of `event_features`: list of int ids of the same length as `history_item` in every row;
* `candidate_item`: int, the item to score;
* each of `pooled_features`: int, or list of int (any number of ids);
* each of `dense_features`: a numeric column, one float feature.

Nothing is dropped, clipped or cast silently: nulls, ids outside `[0, num_embeddings)`, non-finite dense
values, labels other than 0/1 and event lists whose length differs from the history's are errors naming
the column and the row. The file is read once into memory (pyarrow); batch `i` of the training stream is a
pure function of `(seed, i)`, so a run resumes exactly.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from pathlib import Path

import torch
from omegaconf import MISSING
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from .batch import RecBatch
from .spec import DataError, EmbeddingFeature, FeatureSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ColumnFeature:
    """An id column and the size of its embedding table (ids in `[0, num_embeddings)`)."""

    column: str = MISSING
    num_embeddings: int = MISSING


@dataclasses.dataclass
class ParquetDataConfig:
    """Where the logs are and which column is what (see the module docstring for the column types).

    `eval_path` holds the eval rows; without it, the last `eval_fraction` of `path`'s rows (the most recent,
    for logs written in time order) are held out for eval and never trained on.
    """

    path: str = MISSING  # a .parquet file, or a directory of them
    eval_path: str | None = None
    eval_fraction: float = 0.1
    batch_size: int = 128
    shuffle: bool = True  # a new order of the training rows every epoch (drawn from the seed and the epoch)
    label: str = "label"
    history_item: str = "hist_item"
    candidate_item: str = "cand_item"
    num_items: int = MISSING  # rows of the item table, shared by history_item and candidate_item
    event_features: list[ColumnFeature] = dataclasses.field(default_factory=list)
    pooled_features: list[ColumnFeature] = MISSING
    dense_features: list[str] = MISSING

    def __post_init__(self):
        for name in ("path", "num_items", "pooled_features", "dense_features"):
            if getattr(self, name) == MISSING:
                raise ValueError(f"data.{name} is required for data=parquet (see gem_lp/configs/data/parquet.yaml)")
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
        if not self.pooled_features:
            raise ValueError("data.pooled_features must list at least one {column, num_embeddings}")
        if not self.dense_features:
            raise ValueError("data.dense_features must list at least one numeric column")
        columns = self.columns
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"data: each column may have one role only; used twice: {repeated}")

    def check_paths(self) -> None:
        """Raise FileNotFoundError naming the key when `path` or `eval_path` does not exist."""
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                raise FileNotFoundError(f"data.{key}: no Parquet file or directory at {value}")

    @property
    def columns(self) -> list[str]:
        """Every column read, in the order of the module docstring."""
        return [self.label, self.history_item, *(f.column for f in self.event_features), self.candidate_item,
                *(f.column for f in self.pooled_features), *self.dense_features]

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

    def rows(self, lo: int, hi: int) -> "Jagged":
        start, stop = int(self.offsets[lo]), int(self.offsets[hi])
        return Jagged(self.values[start:stop], self.offsets[lo:hi + 1] - start)

    def index(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `values`, lengths) of `rows`, concatenated in the order given."""
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        total = int(lengths.sum())
        out_starts = torch.cumsum(lengths, 0) - lengths
        return torch.repeat_interleave(starts - out_starts, lengths, output_size=total) + torch.arange(total), lengths

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, lengths) of `rows`, concatenated in the order given."""
        index, lengths = self.index(rows)
        return self.values[index], lengths


@dataclasses.dataclass
class ParquetRows:
    """Every column of some Parquet rows in memory, as torch tensors, in file order."""

    spec: FeatureSpec
    labels: torch.Tensor  # float32 [N]
    history: Jagged  # item ids
    events: list[torch.Tensor]  # per event feature, int64 values aligned with `history.values`
    candidates: torch.Tensor  # int64 [N]
    pooled: list[Jagged]
    dense: torch.Tensor  # float32 [N, F]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def rows(self, lo: int, hi: int) -> "ParquetRows":
        history = self.history.rows(lo, hi)
        start, stop = int(self.history.offsets[lo]), int(self.history.offsets[hi])
        return ParquetRows(self.spec, self.labels[lo:hi], history, [e[start:stop] for e in self.events],
                           self.candidates[lo:hi], [p.rows(lo, hi) for p in self.pooled], self.dense[lo:hi])

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


def read_parquet(cfg: ParquetDataConfig, path: str | Path) -> ParquetRows:
    """Read and check the configured columns of `path` (a file or a directory of files)."""
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
    table = dataset.read(columns=cfg.columns)
    if table.num_rows == 0:
        raise DataError(f"data: {path} holds no rows")
    spec = cfg.feature_spec()
    column = {name: table.column(name).combine_chunks() for name in cfg.columns}
    where = f"{path}: column"

    labels = _numbers(column[cfg.label], f"{where} {cfg.label!r}")
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise DataError(f"{where} {cfg.label!r}: labels must be 0 or 1, row {row} holds {float(labels[row])}")
    history = _id_lists(column[cfg.history_item], f"{where} {cfg.history_item!r}", spec.num_items)
    events = []
    for f in spec.event_features:
        event = _id_lists(column[f.key], f"{where} {f.key!r}", f.num_embeddings)
        differs = event.offsets != history.offsets
        if bool(differs.any()):
            row = int(differs.nonzero()[0]) - 1
            held, expected = (int(o[row + 1] - o[row]) for o in (event.offsets, history.offsets))
            raise DataError(f"{where} {f.key!r}: row {row} holds {held} ids, its {cfg.history_item!r} list {expected}; "
                            f"an event feature needs one id per history event")
        events.append(event.values)
    candidates = _ids(column[cfg.candidate_item], f"{where} {cfg.candidate_item!r}", spec.num_items)
    pooled = [_id_lists(column[f.key], f"{where} {f.key!r}", f.num_embeddings) for f in spec.pooled_features]
    dense = torch.stack([_numbers(column[c], f"{where} {c!r}").float() for c in cfg.dense_features], dim=1)
    if not bool(torch.isfinite(dense).all()):
        row, col = (int(i) for i in (~torch.isfinite(dense)).nonzero()[0])
        raise DataError(f"{where} {cfg.dense_features[col]!r}: row {row} holds {float(dense[row, col])}; "
                         f"dense features must be finite")
    return ParquetRows(spec, labels.float(), history, events, candidates, pooled, dense.contiguous())


def _numbers(array, what: str) -> torch.Tensor:
    import pyarrow as pa

    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        raise DataError(f"{what} must be numeric, got type {array.type}")
    _no_nulls(array, what)
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).astype("float64"))


def _no_nulls(array, what: str) -> None:
    if array.null_count:
        row = array.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]
        raise DataError(f"{what}: row {row} is null; every row needs a value")


def _checked_ids(values: torch.Tensor, num_embeddings: int, what: str, row_of) -> torch.Tensor:
    bad = (values < 0) | (values >= num_embeddings)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise DataError(f"{what}: row {row_of(i)} holds id {int(values[i])}, outside [0, {num_embeddings}) "
                         f"(num_embeddings {num_embeddings})")
    return values


def _ids(array, what: str, num_embeddings: int) -> torch.Tensor:
    import pyarrow as pa

    if not pa.types.is_integer(array.type):
        raise DataError(f"{what} must hold integer ids, got type {array.type}")
    _no_nulls(array, what)
    values = torch.from_numpy(array.to_numpy().astype("int64"))
    return _checked_ids(values, num_embeddings, what, lambda i: i)


def _id_lists(array, what: str, num_embeddings: int) -> Jagged:
    """An int column (one id per row) or a list-of-int column, as `Jagged`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(array.type):
        values = _ids(array, what, num_embeddings)
        return Jagged(values, torch.arange(values.shape[0] + 1, dtype=torch.int64))
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) or \
            not pa.types.is_integer(array.type.value_type):
        raise DataError(f"{what} must hold integer ids or lists of them, got type {array.type}")
    _no_nulls(array, what)
    lengths = torch.from_numpy(pc.list_value_length(array).to_numpy().astype("int64"))
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    flat = pc.list_flatten(array)
    if flat.null_count:
        i = flat.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]
        row = int(torch.searchsorted(offsets, int(i), right=True)) - 1
        raise DataError(f"{what}: row {row} holds a null id")
    values = torch.from_numpy(flat.to_numpy().astype("int64"))
    _checked_ids(values, num_embeddings, what, lambda i: int(torch.searchsorted(offsets, i, right=True)) - 1)
    return Jagged(values, offsets)


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"parquet:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ParquetRecDataset(IterableDataset):
    """Training batches over `rows`, epoch after epoch, forever (use `DataLoader(dataset, batch_size=None)`).

    Batch `i` holds rows `order_e[j * B : (j + 1) * B]` with `e, j = divmod(i, batches_per_epoch)`: each
    epoch visits every row once, the last batch of an epoch holding the remainder (fewer than B rows, not
    dropped). `order_e` is the file order, or with `shuffle` a permutation drawn from `(seed, e)`.
    """

    def __init__(self, rows: ParquetRows, batch_size: int, seed: int, start: int = 0, shuffle: bool = True):
        super().__init__()
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self.batches_per_epoch = math.ceil(len(rows) / batch_size)
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
    """`data=parquet`: the training rows and the eval rows of the configured files."""

    def __init__(self, cfg: ParquetDataConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.features = cfg.feature_spec()
        rows = read_parquet(cfg, cfg.path)
        if cfg.eval_path is not None:
            self.train_rows, self.eval_rows = rows, read_parquet(cfg, cfg.eval_path)
            log.info("data: %d training rows from %s, %d eval rows from %s", len(rows), cfg.path,
                     len(self.eval_rows), cfg.eval_path)
        else:
            n_eval = math.ceil(len(rows) * cfg.eval_fraction)
            if n_eval >= len(rows):
                raise DataError(f"data: {cfg.path} holds {len(rows)} rows, too few to hold out "
                                 f"eval_fraction={cfg.eval_fraction} for eval and train on the rest; "
                                 f"give data.eval_path or more rows")
            self.train_rows, self.eval_rows = rows.rows(0, len(rows) - n_eval), rows.rows(len(rows) - n_eval, len(rows))
            log.info("data: %s: %d training rows, the last %d rows held out for eval", cfg.path,
                     len(self.train_rows), n_eval)

    def train_dataset(self, start: int) -> ParquetRecDataset:
        return ParquetRecDataset(self.train_rows, self.cfg.batch_size, self.seed, start, self.cfg.shuffle)

    def eval_batches(self, limit: int) -> list[RecBatch]:
        """The eval rows in file order, in batches of `batch_size` (the last one may be smaller), at most `limit`."""
        b, n = self.cfg.batch_size, len(self.eval_rows)
        count = math.ceil(n / b)
        if count > limit:
            log.info("data: evaluating on the first %d of %d eval batches (trainer.eval_batches=%d)", limit, count,
                     limit)
            count = limit
        return [self.eval_rows.batch(torch.arange(k * b, min((k + 1) * b, n))) for k in range(count)]
