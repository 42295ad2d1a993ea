"""Data sources: what the trainer asks of a data pipeline, and the one `data=...` selects."""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from torch.utils.data import IterableDataset

from .batch import RecBatch, rank_slice
from .config import SyntheticDataConfig
from .parquet import ParquetDataConfig, ParquetSource
from .spec import FeatureSpec
from .synthetic import SyntheticSource


class DataSource(Protocol):
    """A pipeline the trainer can run on. Bring your own by implementing these members (`num_eval_rows` and
    `fingerprint` are optional: without them `metrics.json` records what the trainer counted, and the data config).

    Attributes:
        features: the keys and table sizes of its batches (the model is built from it).
        num_eval_rows: the number of samples in the whole eval set.
    """

    features: FeatureSpec
    num_eval_rows: int

    def train_dataset(self, start: int) -> IterableDataset:
        """Training `RecBatch`es from batch index `start` on, without end; batch `i` must depend only on `i`
        (and the source's settings), so that a resumed run continues exactly."""

    def eval_batches(self, limit: int | None = None) -> Iterable[RecBatch]:
        """The fixed eval set in batches, from its first: all of them (`limit` None) or the first `limit`. Called
        once per evaluation, each call yielding the same batches (build them as they are asked for: the trainer
        keeps none between evaluations); the labels must hold both classes."""

    def fingerprint(self) -> dict[str, Any]:
        """What the data is, for `metrics.json`'s `data`: at least `source` (a name); e.g. paths, row counts and
        a `schema_hash` of the columns' names and types."""


def make_source(cfg: Any, seed: int) -> DataSource:
    """The source of a data config: `SyntheticDataConfig` or `ParquetDataConfig`."""
    if isinstance(cfg, SyntheticDataConfig):
        return SyntheticSource(cfg, seed)
    if isinstance(cfg, ParquetDataConfig):
        return ParquetSource(cfg, seed)
    raise TypeError(f"data: expected a SyntheticDataConfig or ParquetDataConfig (data=synthetic or data=parquet), "
                    f"got {type(cfg).__name__}")


class RankSlices(IterableDataset):
    """`(slice, batch size)`: rank `rank`'s slice (`gem_lp.data.batch.rank_slice`) of every batch of `dataset`,
    with the size of the whole batch, for training on `world_size` processes: the ranks' slices of batch `i`, in
    rank order, are batch `i` of a single process. Each rank generates (or reads) the whole batch and keeps its
    slice, so the stream stays a pure function of the batch index, whatever the number of processes."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"RankSlices: expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def __iter__(self):
        for batch in self.dataset:
            yield rank_slice(batch, self.rank, self.world_size), batch.batch_size
