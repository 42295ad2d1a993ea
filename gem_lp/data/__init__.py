"""Synthetic TorchRec ranking data with labels from a planted teacher (best achievable AUC known)."""
from .batch import RecBatch
from .config import (CAND_ITEM, HIST_ACTION, HIST_GAP, HIST_ITEM, SEQUENCE_KEYS, SparseFeatureSpec,
                     SyntheticDataConfig, TeacherWeights)
from .sampling import RawSamples, offsets_from_lengths, sample_raw, zipf_ids
from .synthetic import SyntheticRecDataset, batch_seed, make_batch, pack_batch
from .teacher import PlantedTeacher

__all__ = [
    "CAND_ITEM",
    "HIST_ACTION",
    "HIST_GAP",
    "HIST_ITEM",
    "PlantedTeacher",
    "RawSamples",
    "RecBatch",
    "SEQUENCE_KEYS",
    "SparseFeatureSpec",
    "SyntheticDataConfig",
    "SyntheticRecDataset",
    "TeacherWeights",
    "batch_seed",
    "make_batch",
    "offsets_from_lengths",
    "pack_batch",
    "sample_raw",
    "zipf_ids",
]
