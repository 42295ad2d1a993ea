"""Synthetic data: determinism per seed, KJT structure, teacher, dataset positioning and worker sharding."""
import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from gem_lp.data import (CAND_ITEM, HIST_ACTION, HIST_GAP, HIST_ITEM, PlantedTeacher, SparseFeatureSpec,
                         SyntheticDataConfig, SyntheticRecDataset, make_batch, sample_raw, zipf_ids)

CFG = SyntheticDataConfig(batch_size=24, num_items=300, history_mean=10.0, history_min=0, history_max=40,
                          sparse_features=(SparseFeatureSpec("a", 50, 1), SparseFeatureSpec("b", 120, 4)))


@pytest.fixture(scope="module")
def teacher():
    return PlantedTeacher(CFG)


def batch_tensors(batch):
    """Every tensor a batch holds, with the KJT keys, for equality checks."""
    out = {"dense": batch.dense_features, "labels": batch.labels, "teacher_logits": batch.teacher_logits}
    for name in ("sparse_features", "sequence_features"):
        kjt = getattr(batch, name)
        out[f"{name}.keys"] = kjt.keys()
        out[f"{name}.values"] = kjt.values()
        out[f"{name}.lengths"] = kjt.lengths()
    return out


def assert_same(a, b):
    ta, tb = batch_tensors(a), batch_tensors(b)
    for k in ta:
        if isinstance(ta[k], torch.Tensor):
            assert torch.equal(ta[k], tb[k]), k
        else:
            assert ta[k] == tb[k], k


def test_same_seed_same_batches(teacher):
    for index in (0, 1, 7):
        assert_same(make_batch(CFG, teacher, 3, "train", index), make_batch(CFG, PlantedTeacher(CFG), 3, "train", index))


def test_different_seed_split_or_index_differ(teacher):
    base = make_batch(CFG, teacher, 3, "train", 0)
    for other in (make_batch(CFG, teacher, 4, "train", 0), make_batch(CFG, teacher, 3, "eval", 0),
                  make_batch(CFG, teacher, 3, "train", 1)):
        assert not torch.equal(base.dense_features, other.dense_features)
        lengths_equal = torch.equal(base.sequence_features.lengths(), other.sequence_features.lengths())
        assert not (lengths_equal and torch.equal(base.sequence_features.values(), other.sequence_features.values()))


def test_kjt_structure(teacher):
    b = make_batch(CFG, teacher, 0, "train", 5)
    n = CFG.batch_size
    seq = b.sequence_features
    assert seq.keys() == [HIST_ITEM, HIST_ACTION, HIST_GAP, CAND_ITEM]
    assert seq.stride() == n
    lengths = seq.lengths().view(4, n)
    assert torch.equal(lengths[0], lengths[1]) and torch.equal(lengths[0], lengths[2])
    assert torch.equal(lengths[3], torch.ones(n, dtype=lengths.dtype))
    assert int(lengths[0].min()) >= CFG.history_min and int(lengths[0].max()) <= CFG.history_max
    jt = seq.to_dict()
    assert jt[HIST_ITEM].values().dtype == torch.int64
    for key, bound in ((HIST_ITEM, CFG.num_items), (HIST_ACTION, CFG.num_actions), (HIST_GAP, CFG.num_time_buckets),
                       (CAND_ITEM, CFG.num_items)):
        v = jt[key].values()
        assert v.numel() == 0 or (int(v.min()) >= 0 and int(v.max()) < bound), key
    assert seq.length_per_key() == [int(lengths[0].sum())] * 3 + [n]

    sparse = b.sparse_features
    assert sparse.keys() == ["a", "b"]
    for spec in CFG.sparse_features:
        f = sparse.to_dict()[spec.name]
        assert int(f.lengths().min()) >= 1 and int(f.lengths().max()) <= spec.max_ids
        assert int(f.values().min()) >= 0 and int(f.values().max()) < spec.num_embeddings
    assert b.dense_features.shape == (n, CFG.num_dense) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (n,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.batch_size == n


def test_time_gaps_grow_with_age(teacher):
    raw = sample_raw(CFG, 400, torch.Generator().manual_seed(0))
    # the newest event of each history has the smallest bucket of its history (age 1, jitter < 2x)
    ends = torch.cumsum(raw.hist_lengths, 0) - 1
    newest = raw.hist_gaps[ends[raw.hist_lengths > 0]]
    assert int(newest.max()) == 0  # log2(1 * jitter in [0.5, 2)) < 1
    assert int(raw.hist_gaps.max()) <= CFG.num_time_buckets - 1


def test_zipf_ids_are_skewed_and_in_range():
    ids = zipf_ids(20000, 100, 1.1, torch.Generator().manual_seed(0))
    counts = torch.bincount(ids, minlength=100)
    assert ids.min() >= 0 and ids.max() < 100
    assert counts[0] > counts[1] > counts[10] > counts[99]


def test_teacher_is_fixed_informative_and_calibrated(teacher):
    other = PlantedTeacher(CFG)
    assert torch.equal(teacher.item_emb, other.item_emb)
    raw = sample_raw(CFG, 4000, torch.Generator().manual_seed(1))
    logits = teacher.logits(raw)
    terms = teacher.terms(raw)
    w = CFG.teacher_weights
    expect = w.bias + sum(getattr(w, k) * v for k, v in terms.items())
    torch.testing.assert_close(logits, expect)
    for k, v in terms.items():  # standardized on the calibration sample: unit std on fresh data too
        assert 0.8 < float(v.std()) < 1.25, k
    # a different teacher seed gives a different task
    moved = PlantedTeacher(dataclasses.replace(CFG, teacher_seed=CFG.teacher_seed + 1))
    assert not torch.allclose(moved.logits(raw), logits)


def test_labels_follow_the_teacher(teacher):
    batches = [make_batch(CFG, teacher, 0, "eval", i) for i in range(40)]
    p = torch.sigmoid(torch.cat([b.teacher_logits for b in batches]))
    y = torch.cat([b.labels for b in batches])
    n = y.numel()
    assert abs(float(y.mean() - p.mean())) < 4 * float(torch.sqrt(p.mean() * (1 - p.mean()) / n))
    # labels are more often 1 where the teacher says so
    assert float(y[p > 0.5].mean()) > float(y[p < 0.2].mean()) + 0.2


def test_dataset_start_and_length(teacher):
    ds = SyntheticRecDataset(CFG, seed=2, split="train", start=3, num_batches=4, teacher=teacher)
    batches = list(ds)
    assert len(batches) == 4
    for i, b in enumerate(batches):
        assert_same(b, make_batch(CFG, teacher, 2, "train", 3 + i))


def test_dataloader_workers_keep_the_order(teacher):
    ds = SyntheticRecDataset(CFG, seed=2, split="train", start=1, num_batches=5, teacher=teacher)
    single = list(DataLoader(ds, batch_size=None, num_workers=0))
    multi = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(multi) == 5
    for a, b in zip(single, multi):
        assert_same(a, b)


def test_batch_to_device_keeps_everything(teacher):
    b = make_batch(CFG, teacher, 0, "train", 0)
    assert_same(b, b.to("cpu"))


def test_batch_to_device_drops_the_split_cache(teacher):
    """A batch split per key (`to_dict()`, cached by TorchRec) before the copy: the copy's split is on the new
    device (TorchRec's own `.to` hands over the old device's split), its per-key lengths kept."""
    b = make_batch(CFG, teacher, 0, "train", 0)
    for kjt in (b.sparse_features, b.sequence_features):
        kjt.to_dict()
    moved = b.to("meta")
    for src, kjt in ((b.sparse_features, moved.sparse_features), (b.sequence_features, moved.sequence_features)):
        assert kjt.length_per_key() == src.length_per_key() and kjt.keys() == src.keys()
        for key, jt in kjt.to_dict().items():
            assert jt.values().device.type == "meta" and jt.lengths().device.type == "meta", key


@pytest.mark.parametrize("bad, match", [
    (dict(history_min=5, history_max=4), "history_min"),
    (dict(batch_size=0), "batch_size"),
    (dict(candidate_from_history=1.5), "candidate_from_history"),
    (dict(sparse_features=()), "sparse_features"),
    (dict(sparse_features=(SparseFeatureSpec("x", 5), SparseFeatureSpec("x", 6))), "unique"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **bad)


def test_config_from_mapping():
    cfg = SyntheticDataConfig.from_mapping({"batch_size": 8, "sparse_features": [{"name": "u", "num_embeddings": 9}],
                                            "teacher_weights": {"bias": -2.0}})
    assert cfg.sparse_features == (SparseFeatureSpec("u", 9, 1),) and cfg.teacher_weights.bias == -2.0
    with pytest.raises(ValueError, match="unknown data config keys"):
        SyntheticDataConfig.from_mapping({"batch_sise": 8})
    with pytest.raises(ValueError, match="sparse feature"):
        SparseFeatureSpec(HIST_ITEM, 10)


def test_bad_split_and_start(teacher):
    with pytest.raises(ValueError, match="split"):
        SyntheticRecDataset(CFG, seed=0, split="test", teacher=teacher)
    with pytest.raises(ValueError, match="start"):
        SyntheticRecDataset(CFG, seed=0, start=-1, teacher=teacher)


def test_candidate_from_history():
    cfg = dataclasses.replace(CFG, candidate_from_history=1.0, history_mean=1.5, history_sigma=1.0)
    raw = sample_raw(cfg, 300, torch.Generator().manual_seed(3))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), raw.hist_lengths.cumsum(0)])
    assert int((raw.hist_lengths == 0).sum()) > 0  # history_min=0: empty histories take a fresh candidate
    for i in range(300):
        history = raw.hist_items[offsets[i]:offsets[i + 1]]
        if history.numel():
            assert bool((history == raw.candidates[i]).any()), i


def test_kjt_copy_refuses_a_variable_stride_per_key():
    from torchrec import KeyedJaggedTensor

    from gem_lp.data.batch import kjt_to

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(4), lengths=torch.tensor([1, 2, 1]),
                            stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(ValueError, match="variable stride per key"):
        kjt_to(kjt, "cpu")
