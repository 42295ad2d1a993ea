"""The training batch, the interface between any data pipeline and the model.

A pipeline of one's own feeds `RecBatch`es whose keys and id ranges a `FeatureSpec` describes
(`gem_lp.data.spec`); the trainer and `GemRanker` need nothing else from it.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torchrec import KeyedJaggedTensor

from .spec import DataError


class _DropIsFxTracingDeprecation(logging.Filter):
    """torch's ProxyableClassMeta, the metaclass of TorchRec's KeyedJaggedTensor and JaggedTensor, calls the
    deprecated `torch.fx.is_fx_tracing()` on every construction, which logs a deprecation warning meant for
    code that calls it. Neither gem-lp nor its users do: drop that one message, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropIsFxTracingDeprecation())


@dataclasses.dataclass
class RecBatch:
    """One batch of `B` samples, on the CPU as a pipeline yields it (the trainer moves it with `to`).

    The keys named below are those of the batch's `FeatureSpec` (the synthetic data's in brackets).

    Attributes:
        sparse_features: KJT, stride B, one key per pooled feature (`user_segment`, ...): int64 ids,
            any number per sample.
        sequence_features: KJT, stride B: the history's item ids under `spec.history_key` (`hist_item`;
            L_b >= 0 per sample, oldest first), one more id per event under each event feature's key
            (`hist_action`, `hist_gap`; the same L_b), and exactly one id per sample under
            `spec.candidate_key` (`cand_item`), the item to score.
        dense_features: float32 `[B, spec.num_dense]`.
        labels: float32 `[B]` in {0, 1}.
        teacher_logits: float32 `[B]` or None: for synthetic data, the planted teacher's logit
            (labels ~ Bernoulli(sigmoid)), to report the best achievable metrics; models never see it.
        host_sequence_lengths: None, or `sequence_features.lengths()` on the CPU: set by `to()` when the batch moves
            off the CPU, so that the model can lay out its jagged attention without reading lengths back from the
            device (a host sync, which would stall the host until the GPU has caught up).
    """

    sparse_features: KeyedJaggedTensor
    sequence_features: KeyedJaggedTensor
    dense_features: torch.Tensor
    labels: torch.Tensor
    teacher_logits: torch.Tensor | None = None
    host_sequence_lengths: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RecBatch":
        """Copy to `device` with plain `.to()` (no fbgemm op touches device tensors)."""
        return RecBatch(
            sparse_features=kjt_to(self.sparse_features, device, non_blocking),
            sequence_features=kjt_to(self.sequence_features, device, non_blocking),
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            teacher_logits=(None if self.teacher_logits is None
                            else self.teacher_logits.to(device, non_blocking=non_blocking)),
            host_sequence_lengths=(self.sequence_features.lengths() if self.sequence_features.lengths().device.type
                                   == "cpu" else self.host_sequence_lengths),
        )

    def samples(self, start: int, stop: int) -> "RecBatch":
        """The batch of samples `start..stop-1` (every tensor and KJT cut along the batch; CPU, plain torch ops)."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"samples: expected 0 <= start <= stop <= batch size {self.batch_size}, got start={start}, "
                             f"stop={stop}")
        return RecBatch(
            sparse_features=kjt_samples(self.sparse_features, start, stop),
            sequence_features=kjt_samples(self.sequence_features, start, stop),
            dense_features=self.dense_features[start:stop],
            labels=self.labels[start:stop],
            teacher_logits=None if self.teacher_logits is None else self.teacher_logits[start:stop],
        )

    def pin_memory(self) -> "RecBatch":
        return RecBatch(
            sparse_features=self.sparse_features.pin_memory(),
            sequence_features=self.sequence_features.pin_memory(),
            dense_features=self.dense_features.pin_memory(),
            labels=self.labels.pin_memory(),
            teacher_logits=None if self.teacher_logits is None else self.teacher_logits.pin_memory(),
        )


def kjt_to(kjt: KeyedJaggedTensor, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
    """`kjt` copied to `device`, keeping its per-key lengths and offsets (host lists) but not its `to_dict()`.

    TorchRec's `KeyedJaggedTensor.to` hands the copy the source's cached `to_dict()` result, JaggedTensors still
    on the old device: a KJT split on the CPU before the copy would then feed CPU ids to CUDA embeddings. The
    per-key lengths come from the source (a host sync if it is on a GPU; free for CPU batches).
    """
    if kjt.variable_stride_per_key():
        raise ValueError("kjt_to: kjt has a variable stride per key, which this copy does not carry; expected one "
                         "stride (batch size) for every key")
    device = torch.device(device)
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().to(device, non_blocking=non_blocking),
        weights=None if weights is None else weights.to(device, non_blocking=non_blocking),
        lengths=kjt.lengths().to(device, non_blocking=non_blocking),
        offsets=kjt.offsets().to(device, non_blocking=non_blocking),
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key(),
        offset_per_key=kjt.offset_per_key(),
    )


def kjt_samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """The samples `start..stop-1` of every key of `kjt` (one stride for all keys), as a KJT of stride `stop - start`.

    Cut with plain torch ops on the host's tensors (fbgemm's KJT ops need not run where the tensors are).
    """
    if kjt.variable_stride_per_key():
        raise ValueError("kjt_samples: kjt has a variable stride per key; expected one stride (batch size) for "
                         "every key")
    stride = kjt.stride()
    if not 0 <= start <= stop <= stride:
        raise ValueError(f"kjt_samples: expected 0 <= start <= stop <= stride {stride}, got start={start}, stop={stop}")
    num_keys = len(kjt.keys())
    lengths = kjt.lengths().view(num_keys, stride)[:, start:stop]
    offsets = kjt.offsets()
    key_starts = torch.arange(num_keys, device=offsets.device) * stride
    begins, ends = offsets[key_starts + start].tolist(), offsets[key_starts + stop].tolist()
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat([kjt.values()[b:e] for b, e in zip(begins, ends)]),
        weights=None if weights is None else torch.cat([weights[b:e] for b, e in zip(begins, ends)]),
        lengths=lengths.reshape(-1).clone(),
        stride=stop - start,
        length_per_key=[e - b for b, e in zip(begins, ends)],
    )


def rank_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The samples `[start, stop)` of a batch that rank `rank` of `world_size` trains on: contiguous slices in rank
    order, their sizes differing by at most one (equal when `world_size` divides `batch_size`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank_bounds: expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


def rank_slice(batch: RecBatch, rank: int, world_size: int) -> RecBatch:
    """Rank `rank`'s slice of `batch` (see `rank_bounds`): the ranks' slices, in rank order, are the batch.

    Raises `DataError` when the batch holds fewer samples than there are ranks (a rank would get none).
    """
    if batch.batch_size < world_size:
        raise DataError(f"data: a batch of {batch.batch_size} samples cannot give each of {world_size} ranks at least "
                        f"one; use a batch size of at least the number of processes (data.batch_size is the global "
                        f"batch, split over the ranks)")
    return batch.samples(*rank_bounds(batch.batch_size, rank, world_size))
