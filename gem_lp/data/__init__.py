"""Ranking data as TorchRec KJT batches (`RecBatch`, described by a `FeatureSpec`): the synthetic task with
labels from a planted teacher (best achievable AUC known), Parquet logs, and the `DataSource` interface."""
from .batch import RecBatch, kjt_samples, rank_bounds, rank_slice
from .config import (CAND_ITEM, HIST_ACTION, HIST_GAP, HIST_ITEM, SEQUENCE_KEYS, SparseFeatureSpec,
                     SyntheticDataConfig, TeacherWeights)
from .parquet import ColumnFeature, ParquetDataConfig, ParquetRecDataset, ParquetSource, read_parquet
from .sampling import RawSamples, offsets_from_lengths, sample_raw, zipf_ids
from .source import DataSource, RankSlices, make_source
from .spec import ITEM_TABLE, DataError, EmbeddingFeature, FeatureSpec
from .synthetic import SyntheticRecDataset, SyntheticSource, batch_seed, make_batch, pack_batch
from .teacher import PlantedTeacher

__all__ = [
    "CAND_ITEM",
    "ColumnFeature",
    "DataError",
    "DataSource",
    "EmbeddingFeature",
    "FeatureSpec",
    "HIST_ACTION",
    "HIST_GAP",
    "HIST_ITEM",
    "ITEM_TABLE",
    "ParquetDataConfig",
    "ParquetRecDataset",
    "ParquetSource",
    "PlantedTeacher",
    "RankSlices",
    "RawSamples",
    "RecBatch",
    "SEQUENCE_KEYS",
    "SparseFeatureSpec",
    "SyntheticDataConfig",
    "SyntheticRecDataset",
    "SyntheticSource",
    "TeacherWeights",
    "batch_seed",
    "kjt_samples",
    "make_batch",
    "make_source",
    "offsets_from_lengths",
    "pack_batch",
    "rank_bounds",
    "rank_slice",
    "read_parquet",
    "sample_raw",
    "zipf_ids",
]
