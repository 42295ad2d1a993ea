"""A batch cut over ranks: the slices, in rank order, are the batch (every KJT key, dense features, labels)."""
import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem_lp.data import (DataError, PlantedTeacher, RankSlices, SparseFeatureSpec, SyntheticDataConfig,
                         SyntheticRecDataset, kjt_samples, make_batch, rank_bounds, rank_slice)

CFG = SyntheticDataConfig(batch_size=10, num_items=200, history_mean=6.0, history_min=0, history_max=20,
                          sparse_features=(SparseFeatureSpec("a", 30, 1), SparseFeatureSpec("b", 50, 4)))


@pytest.fixture(scope="module")
def batch():
    return make_batch(CFG, PlantedTeacher(CFG), 0, "train", 3)


def per_sample(kjt: KeyedJaggedTensor) -> list[dict[str, list[int]]]:
    """The reference: each sample's ids under each key, read one sample at a time."""
    out = []
    for i in range(kjt.stride()):
        sample = {}
        for key in kjt.keys():
            jt = kjt[key]
            offsets = jt.offsets()
            sample[key] = jt.values()[offsets[i]:offsets[i + 1]].tolist()
        out.append(sample)
    return out


def test_rank_bounds_cover_the_batch_in_order():
    for batch_size in (1, 7, 10, 32):
        for world in range(1, batch_size + 1):
            bounds = [rank_bounds(batch_size, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == batch_size
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="rank < world_size"):
        rank_bounds(10, 2, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_make_the_batch(batch, world):
    slices = [rank_slice(batch, r, world) for r in range(world)]
    assert sum(s.batch_size for s in slices) == batch.batch_size
    for name in ("sparse_features", "sequence_features"):
        parts = [getattr(s, name) for s in slices]
        assert all(p.keys() == getattr(batch, name).keys() for p in parts)
        assert sum((per_sample(p) for p in parts), []) == per_sample(getattr(batch, name))
        for part in parts:  # per-key lengths known up front, as a pipeline's KJTs are
            assert part.length_per_key() == [int(part[k].lengths().sum()) for k in part.keys()]
    for name in ("dense_features", "labels", "teacher_logits"):
        assert torch.equal(torch.cat([getattr(s, name) for s in slices]), getattr(batch, name))


def test_kjt_samples_keeps_weights_and_refuses_bad_bounds():
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y"], values=torch.arange(7), weights=torch.arange(7.0),
                                              lengths=torch.tensor([1, 2, 0, 3, 1, 0]))
    part = kjt_samples(kjt, 1, 3)
    assert part.stride() == 2 and part.lengths().tolist() == [2, 0, 1, 0]
    assert part.values().tolist() == [1, 2, 6] and part.weights().tolist() == [1.0, 2.0, 6.0]
    with pytest.raises(ValueError, match="start <= stop <= stride 3"):
        kjt_samples(kjt, 2, 4)


def test_a_batch_smaller_than_the_number_of_ranks_is_refused(batch):
    with pytest.raises(DataError, match="a batch of 10 samples cannot give each of 11 ranks at least one"):
        rank_slice(batch, 0, 11)


def test_rank_slices_stream_keeps_the_batch_size():
    dataset = SyntheticRecDataset(CFG, seed=1, start=4, num_batches=2)
    whole = list(dataset)
    for rank in range(3):
        got = list(RankSlices(dataset, rank, 3))
        assert [size for _, size in got] == [CFG.batch_size] * 2
        for (part, _), full in zip(got, whole):
            assert torch.equal(part.labels, full.labels[slice(*rank_bounds(CFG.batch_size, rank, 3))])
