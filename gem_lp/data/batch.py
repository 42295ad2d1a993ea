"""The training batch, the interface between any data pipeline and the model.

A pipeline of one's own feeds `RecBatch`es whose keys and id ranges a `FeatureSpec` describes
(`gem_lp.data.spec`); the trainer and `GemRanker` need nothing else from it.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torchrec import KeyedJaggedTensor


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
    """

    sparse_features: KeyedJaggedTensor
    sequence_features: KeyedJaggedTensor
    dense_features: torch.Tensor
    labels: torch.Tensor
    teacher_logits: torch.Tensor | None = None

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
