"""The training batch: TorchRec KeyedJaggedTensors for the id features, dense features and labels."""
from __future__ import annotations

import dataclasses

import torch
from torchrec import KeyedJaggedTensor


@dataclasses.dataclass
class RecBatch:
    """One batch of `B` samples.

    Attributes:
        sparse_features: KJT with one key per pooled id feature, `1..max_ids` int64 ids per sample.
        sequence_features: KJT with keys `hist_item`, `hist_action`, `hist_gap` (the same lengths
            `L_b` per sample: history item ids, action types, time-gap buckets, oldest first) and
            `cand_item` (length 1 per sample: the candidate item, looked up in the item table).
        dense_features: float32 `[B, num_dense]`.
        labels: float32 `[B]` in {0, 1}.
        teacher_logits: float32 `[B]`, the planted teacher's logit (labels ~ Bernoulli(sigmoid));
            for reporting the best achievable metrics only — models never see it.
    """

    sparse_features: KeyedJaggedTensor
    sequence_features: KeyedJaggedTensor
    dense_features: torch.Tensor
    labels: torch.Tensor
    teacher_logits: torch.Tensor

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
            teacher_logits=self.teacher_logits.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "RecBatch":
        return RecBatch(
            sparse_features=self.sparse_features.pin_memory(),
            sequence_features=self.sequence_features.pin_memory(),
            dense_features=self.dense_features.pin_memory(),
            labels=self.labels.pin_memory(),
            teacher_logits=self.teacher_logits.pin_memory(),
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
