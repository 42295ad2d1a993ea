"""Synthetic ranking batches as TorchRec KJTs, and the `IterableDataset` that streams them.

Batch `i` of split `s` under seed `seed` is a pure function of `(seed, s, i)` (its own generator,
seeded by a hash of the three), so iteration can start at any position (checkpoint resume) and
several loader workers produce exactly the batches a single process would.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from .batch import RecBatch
from .config import CAND_ITEM, HIST_ACTION, HIST_GAP, HIST_ITEM, SyntheticDataConfig
from .sampling import RawSamples, sample_raw
from .spec import ITEM_TABLE, FeatureSpec, schema_hash
from .teacher import PlantedTeacher

SPLITS = ("train", "eval")


def batch_seed(seed: int, split: str, index: int) -> int:
    """A 63-bit generator seed for batch `index` of `split` (distinct streams per split and seed)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    digest = hashlib.blake2b(f"{seed}:{split}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def pack_batch(cfg: SyntheticDataConfig, raw: RawSamples, logits: torch.Tensor, labels: torch.Tensor) -> RecBatch:
    """Pack raw samples into KJTs (CPU, `from_lengths_sync` so per-key lengths are known up front)."""
    b = raw.batch_size
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[f.name for f in cfg.sparse_features],
        values=torch.cat(raw.sparse_ids),
        lengths=torch.cat(raw.sparse_lengths),
    )
    n = raw.hist_lengths
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=[HIST_ITEM, HIST_ACTION, HIST_GAP, CAND_ITEM],
        values=torch.cat([raw.hist_items, raw.hist_actions, raw.hist_gaps, raw.candidates]),
        lengths=torch.cat([n, n, n, torch.ones(b, dtype=torch.int64)]),
    )
    return RecBatch(sparse, sequence, raw.dense, labels, logits)


def make_batch(cfg: SyntheticDataConfig, teacher: PlantedTeacher, seed: int, split: str, index: int) -> RecBatch:
    """Batch `index` of `split`: features, teacher logits, and labels ~ Bernoulli(sigmoid(logit))."""
    g = torch.Generator().manual_seed(batch_seed(seed, split, index))
    raw = sample_raw(cfg, cfg.batch_size, g)
    logits = teacher.logits(raw)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
    return pack_batch(cfg, raw, logits, labels)


class SyntheticRecDataset(IterableDataset):
    """Streams `RecBatch`es (use `DataLoader(dataset, batch_size=None)`).

    Args:
        cfg: the task definition.
        seed: data seed; the same seed gives identical batches.
        split: `"train"` or `"eval"` (independent streams).
        start: index of the first batch (to resume a run).
        num_batches: stop after this many batches; `None` streams forever.
        teacher: the labelling model; built from `cfg` when not given (its parameters depend
            only on `cfg.teacher_seed`, so train and eval share it).
    """

    def __init__(self, cfg: SyntheticDataConfig, seed: int, split: str = "train", start: int = 0,
                 num_batches: int | None = None, teacher: PlantedTeacher | None = None):
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be None or >= 0, got {num_batches}")
        self.cfg = cfg
        self.seed = seed
        self.split = split
        self.start = start
        self.num_batches = num_batches
        self.teacher = teacher if teacher is not None else PlantedTeacher(cfg)

    def batch(self, index: int) -> RecBatch:
        return make_batch(self.cfg, self.teacher, self.seed, self.split, index)

    def __iter__(self):
        # Worker w of n yields batches start + w, start + w + n, ...; the DataLoader's round-robin
        # over workers then restores the single-process order.
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        index = self.start + worker
        stop = None if self.num_batches is None else self.start + self.num_batches
        while stop is None or index < stop:
            yield self.batch(index)
            index += workers


class SyntheticSource:
    """`data=synthetic`: the training stream and the eval set of the planted-teacher task (the first
    `eval_samples` samples of the eval stream)."""

    def __init__(self, cfg: SyntheticDataConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.features = cfg.feature_spec()
        self.teacher = PlantedTeacher(cfg)
        self._eval_cache: list[RecBatch] = []

    @property
    def num_eval_rows(self) -> int:
        return self.cfg.eval_samples

    def train_dataset(self, start: int) -> SyntheticRecDataset:
        return SyntheticRecDataset(self.cfg, self.seed, "train", start=start, teacher=self.teacher)

    def eval_batches(self, limit: int | None = None) -> Iterator[RecBatch]:
        """The eval set in batches of `batch_size` (the last one cut to the remainder of `eval_samples`): all of
        them, or the first `limit`. Each batch is generated when first asked for and kept (`eval_samples` bounds
        them, and generating a batch of GPU size is costly)."""
        b, n = self.cfg.batch_size, self.cfg.eval_samples
        count = math.ceil(n / b) if limit is None else min(limit, math.ceil(n / b))
        for k in range(count):
            if k == len(self._eval_cache):
                batch = make_batch(self.cfg, self.teacher, self.seed, "eval", k)
                self._eval_cache.append(batch if (k + 1) * b <= n else batch.samples(0, n - k * b))
            yield self._eval_cache[k]

    def fingerprint(self) -> dict[str, Any]:
        """The task: its seed and config, the eval set's size, the batches' keys and tables (and their hash)."""
        schema = feature_schema(self.features)
        return {"source": "synthetic", "seed": self.seed, "config": dataclasses.asdict(self.cfg),
                "rows": {"train": None, "eval": self.cfg.eval_samples}, "schema": schema,
                "schema_hash": schema_hash(schema)}


def feature_schema(spec: FeatureSpec) -> dict[str, str]:
    """The keys of a spec's batches with what each holds (for a data fingerprint)."""
    out = {spec.history_key: f"history ids, table {ITEM_TABLE} of {spec.num_items}",
           spec.candidate_key: f"candidate id, table {ITEM_TABLE} of {spec.num_items}"}
    out.update({f.key: f"event ids, table {f.table} of {f.num_embeddings}" for f in spec.event_features})
    out.update({f"pooled:{f.key}": f"pooled ids, table {f.table} of {f.num_embeddings}" for f in spec.pooled_features})
    out["dense"] = f"float32 x {spec.num_dense}"
    return out
