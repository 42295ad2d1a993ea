"""Configuration of the synthetic ranking data set (`gem_lp/configs/data/synthetic.yaml` fills these dataclasses).

They are the structured-config schema Hydra checks that yaml and the command line against (types at
composition, ranges in `__post_init__`), so they are plain (not frozen) dataclasses.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .spec import EmbeddingFeature, FeatureSpec

# Keys of the sequence KeyedJaggedTensor. The candidate shares the item table with the history.
HIST_ITEM = "hist_item"
HIST_ACTION = "hist_action"
HIST_GAP = "hist_gap"
CAND_ITEM = "cand_item"
SEQUENCE_KEYS = (HIST_ITEM, HIST_ACTION, HIST_GAP, CAND_ITEM)


@dataclasses.dataclass
class SparseFeatureSpec:
    """One pooled (non-sequence) id feature: `1..max_ids` Zipf-distributed ids per sample."""

    name: str
    num_embeddings: int
    max_ids: int = 1

    def __post_init__(self):
        if not self.name or self.name in SEQUENCE_KEYS:
            raise ValueError(f"sparse feature name must be non-empty and not one of {SEQUENCE_KEYS}, got {self.name!r}")
        if self.num_embeddings < 1:
            raise ValueError(f"sparse feature {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}")
        if self.max_ids < 1:
            raise ValueError(f"sparse feature {self.name!r}: max_ids must be >= 1, got {self.max_ids}")


@dataclasses.dataclass
class TeacherWeights:
    """Weights of the planted teacher's standardized logit terms (each term has unit std on calibration data)."""

    interest: float = 1.2  # target attention of the candidate over the history
    affinity: float = 0.6  # pooled sparse user vector x candidate
    sparse_bias: float = 0.4  # per-id biases of the pooled sparse features
    dense: float = 0.8  # linear + pairwise terms of the dense features
    item_bias: float = 0.4  # per-candidate popularity bias
    bias: float = -1.2  # constant: sets the base rate (about 0.3 with the defaults)


@dataclasses.dataclass
class SyntheticDataConfig:
    """Everything that defines the synthetic task; see `gem_lp/configs/data/synthetic.yaml` for the defaults.

    History lengths are lognormal with mean `history_mean` (before clipping to
    `[history_min, history_max]`) and log-std `history_sigma`.
    """

    batch_size: int = 128
    # The eval set: the first eval_samples samples of the eval stream (an endless stream has no natural whole)
    eval_samples: int = 4096
    num_items: int = 2000
    num_actions: int = 4
    num_time_buckets: int = 8
    history_mean: float = 24.0
    history_sigma: float = 0.6
    history_min: int = 1
    history_max: int = 64
    candidate_from_history: float = 0.5  # probability that the candidate repeats a history item
    zipf_exponent: float = 1.1
    num_dense: int = 16
    sparse_features: tuple[SparseFeatureSpec, ...] = (
        SparseFeatureSpec("user_segment", 500, 1),
        SparseFeatureSpec("user_interests", 1000, 5),
        SparseFeatureSpec("context", 64, 2),
    )
    teacher_dim: int = 16
    teacher_seed: int = 2024
    teacher_temperature: float = 4.0
    teacher_weights: TeacherWeights = dataclasses.field(default_factory=TeacherWeights)

    def __post_init__(self):
        self.sparse_features = tuple(self.sparse_features)
        positive = ("batch_size", "eval_samples", "num_actions", "num_time_buckets", "num_dense", "teacher_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_items < 2:  # one item leaves the teacher nothing to rank: every label comes out the same
            raise ValueError(f"data.num_items must be >= 2, got {self.num_items}")
        if not 0 <= self.history_min <= self.history_max or self.history_max < 1:
            raise ValueError(
                f"data.history_min and data.history_max must satisfy 0 <= min <= max and max >= 1, "
                f"got {self.history_min}, {self.history_max}"
            )
        if self.history_mean <= 0 or self.history_sigma < 0:
            raise ValueError(f"data.history_mean must be > 0 and data.history_sigma >= 0, got "
                             f"{self.history_mean}, {self.history_sigma}")
        if not 0.0 <= self.candidate_from_history <= 1.0:
            raise ValueError(f"data.candidate_from_history must be in [0, 1], got {self.candidate_from_history}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"data.zipf_exponent must be > 0, got {self.zipf_exponent}")
        if len(self.sparse_features) == 0:
            raise ValueError("data.sparse_features must list at least one feature")
        names = [f.name for f in self.sparse_features]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sparse_features names must be unique, got {names}")

    def feature_spec(self) -> FeatureSpec:
        """The keys and table sizes of this task's batches, as the model reads them."""
        return FeatureSpec(
            num_items=self.num_items,
            num_dense=self.num_dense,
            pooled_features=tuple(EmbeddingFeature(f.name, f.num_embeddings) for f in self.sparse_features),
            event_features=(EmbeddingFeature(HIST_ACTION, self.num_actions, table="action"),
                            EmbeddingFeature(HIST_GAP, self.num_time_buckets, table="time_gap")),
            history_key=HIST_ITEM,
            candidate_key=CAND_ITEM,
        )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "SyntheticDataConfig":
        """Build from a plain mapping (e.g. `OmegaConf.to_container(cfg.data)`); unknown keys are errors."""
        cfg = dict(cfg)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown data config keys {unknown}; expected a subset of {sorted(known)}")
        if "sparse_features" in cfg:
            cfg["sparse_features"] = tuple(SparseFeatureSpec(**dict(f)) for f in cfg["sparse_features"])
        if "teacher_weights" in cfg:
            cfg["teacher_weights"] = TeacherWeights(**dict(cfg["teacher_weights"]))
        return cls(**cfg)
