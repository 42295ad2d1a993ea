"""The feature spec: which keys of a `RecBatch` the model reads, and the size of each embedding table.

A data pipeline (the synthetic generator, the Parquet reader, or the user's own) describes its batches
with one `FeatureSpec`; `GemRanker` builds its tables and checks its inputs from it and from nothing else.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

ITEM_TABLE = "item"  # the table shared by the history items and the candidate


@dataclasses.dataclass(frozen=True)
class EmbeddingFeature:
    """An id feature with its own embedding table.

    Attributes:
        key: its key in the batch's KeyedJaggedTensor.
        num_embeddings: rows of its table; every id must lie in `[0, num_embeddings)`.
        table: the table's name (its parameters are `...embeddings.<table>.weight`); default: `key`.
    """

    key: str
    num_embeddings: int
    table: str = ""

    def __post_init__(self):
        if not self.key:
            raise ValueError("an embedding feature needs a non-empty key")
        if self.num_embeddings < 1:
            raise ValueError(f"feature {self.key!r}: num_embeddings must be >= 1, got {self.num_embeddings}")
        if not self.table:
            object.__setattr__(self, "table", self.key)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """What the model reads from a `RecBatch` (see `gem_lp.data.batch.RecBatch` for the tensors).

    `sequence_features` (one KJT) holds, per sample:
      * `history_key`: the history's item ids (any length L_b >= 0, oldest first), looked up in the item table;
      * each of `event_features`: one more id per history event (the same length L_b), each in its own table,
        added to the item's embedding (e.g. the action type and the time since the event);
      * `candidate_key`: exactly one id, the item to score, looked up in the item table.
    `sparse_features` (one KJT) holds each of `pooled_features`: any number of ids per sample, mean-pooled
    in its own table (no ids: a zero vector). `dense_features` is float `[B, num_dense]`.

    Attributes:
        num_items: rows of the item table.
        num_dense: width of `dense_features` (>= 0; with none, `dense_features` is `[B, 0]`).
        pooled_features: at least one.
        event_features: may be empty.
    """

    num_items: int
    num_dense: int
    pooled_features: tuple[EmbeddingFeature, ...]
    event_features: tuple[EmbeddingFeature, ...] = ()
    history_key: str = "hist_item"
    candidate_key: str = "cand_item"

    def __post_init__(self):
        object.__setattr__(self, "pooled_features", tuple(self.pooled_features))
        object.__setattr__(self, "event_features", tuple(self.event_features))
        if self.num_items < 1:
            raise ValueError(f"feature spec: num_items must be >= 1, got {self.num_items}")
        if self.num_dense < 0:
            raise ValueError(f"feature spec: num_dense must be >= 0, got {self.num_dense}")
        if not self.pooled_features:
            raise ValueError("feature spec: pooled_features must list at least one feature")
        if not self.history_key or not self.candidate_key or self.history_key == self.candidate_key:
            raise ValueError(f"feature spec: history_key and candidate_key must be two different non-empty keys, "
                             f"got {self.history_key!r} and {self.candidate_key!r}")
        sequence_keys = self.sequence_keys
        if len(set(sequence_keys)) != len(sequence_keys):
            raise ValueError(f"feature spec: the sequence keys must be unique, got {list(sequence_keys)}")
        pooled_keys = [f.key for f in self.pooled_features]
        if len(set(pooled_keys)) != len(pooled_keys):
            raise ValueError(f"feature spec: the pooled feature keys must be unique, got {pooled_keys}")
        tables = [f.table for f in self.event_features]
        if ITEM_TABLE in tables or len(set(tables)) != len(tables):
            raise ValueError(f"feature spec: event feature tables must be unique and not {ITEM_TABLE!r}, "
                             f"got {tables}")

    @property
    def sequence_keys(self) -> tuple[str, ...]:
        """The keys of `sequence_features`, in the order the synthetic and Parquet sources write them."""
        return (self.history_key, *(f.key for f in self.event_features), self.candidate_key)


class DataError(ValueError):
    """Data that cannot be trained or evaluated on as given; the message names the file, column or row."""


def schema_hash(schema: dict[str, str]) -> str:
    """A stable hash of column names and types (their order does not matter): 16 hex digits of SHA-256."""
    return hashlib.sha256(json.dumps(sorted(schema.items())).encode()).hexdigest()[:16]
