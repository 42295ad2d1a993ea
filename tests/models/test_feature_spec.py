"""The model is configured by a FeatureSpec: any pipeline's RecBatch with its own keys and sizes feeds it."""
import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from gem_lp.data import EmbeddingFeature, FeatureSpec, RecBatch, SyntheticDataConfig
from gem_lp.models import GemModelConfig, GemRanker

SMALL = GemModelConfig(embedding_dim=32, d_model=64, num_heads=2, head_dim=32, num_blocks=1, mlp_hidden=64,
                       dense_hidden=32, head_hidden=64)
SPEC = FeatureSpec(num_items=40, num_dense=3, history_key="viewed", candidate_key="shown",
                   event_features=(EmbeddingFeature("dwell_bucket", 5),),
                   pooled_features=(EmbeddingFeature("country", 10), EmbeddingFeature("tags", 30, table="tag")))


def own_batch(history_lengths=(2, 0, 3), dwell_lengths=None):
    """A RecBatch built by hand, as a user's own pipeline would."""
    b = len(history_lengths)
    n = torch.tensor(history_lengths)
    dwell = torch.tensor(dwell_lengths if dwell_lengths is not None else history_lengths)
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=["viewed", "dwell_bucket", "shown"],
        values=torch.cat([torch.randint(0, 40, (int(n.sum()),)), torch.randint(0, 5, (int(dwell.sum()),)),
                          torch.randint(0, 40, (b,))]),
        lengths=torch.cat([n, dwell, torch.ones(b, dtype=torch.int64)]))
    tags = torch.tensor([1, 0, 2])
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["tags", "country"],  # any key order
        values=torch.cat([torch.randint(0, 30, (int(tags.sum()),)), torch.randint(0, 10, (b,))]),
        lengths=torch.cat([tags, torch.ones(b, dtype=torch.int64)]))
    return RecBatch(sparse, sequence, torch.randn(b, 3), torch.tensor([1.0, 0.0, 1.0]))


def test_a_batch_with_its_own_keys_trains():
    model = GemRanker(SMALL, SPEC)
    tables = {c.name: c.feature_names for c in model.sequence_embeddings.embedding_configs()}
    assert tables == {"item": ["viewed", "shown"], "dwell_bucket": ["dwell_bucket"]}
    bags = {c.name: (c.feature_names, c.num_embeddings) for c in model.pooled_embeddings.embedding_bag_configs()}
    assert bags == {"pooled_country": (["country"], 10), "pooled_tag": (["tags"], 30)}
    batch = own_batch()
    logits = model(batch)
    assert logits.shape == (3,) and torch.isfinite(logits).all()
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_event_features_must_follow_the_history():
    with pytest.raises(ValueError, match=r"sequence_features\['dwell_bucket'\] must hold one id per history event "
                                         r"\('viewed': 5 ids\), got 4"):
        GemRanker(SMALL, SPEC)(own_batch(dwell_lengths=(2, 0, 2)))


def test_the_synthetic_spec_keeps_the_table_names():
    spec = SyntheticDataConfig().feature_spec()
    assert spec.sequence_keys == ("hist_item", "hist_action", "hist_gap", "cand_item")
    assert [f.table for f in spec.event_features] == ["action", "time_gap"]


@pytest.mark.parametrize("bad, match", [
    (dict(num_dense=-1), "num_dense must be >= 0"),
    (dict(pooled_features=()), "pooled_features must list at least one"),
    (dict(candidate_key="viewed"), "two different non-empty keys"),
    (dict(event_features=(EmbeddingFeature("shown", 3),)), "sequence keys must be unique"),
    (dict(event_features=(EmbeddingFeature("x", 3, table="item"),)), "event feature tables must be unique"),
])
def test_spec_errors(bad, match):
    import dataclasses

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SPEC, **bad)
