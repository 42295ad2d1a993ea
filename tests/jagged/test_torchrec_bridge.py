"""TorchRec bridge: JaggedTensor / KeyedJaggedTensor <-> (values, offsets), views, errors."""
import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor  # noqa: E402

from gem_lp.jagged import quantize_jagged  # noqa: E402
from gem_lp.jagged.torchrec_bridge import from_jagged_tensor, from_kjt, to_jagged_tensor  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_from_jagged_tensor_heads_view(dtype):
    lengths = torch.tensor([2, 0, 5], dtype=dtype)
    values = torch.randn(7, 96)
    jt = JaggedTensor(values=values, lengths=lengths)
    v, offsets = from_jagged_tensor(jt, heads=3)
    assert v.shape == (7, 3, 32) and v.data_ptr() == values.data_ptr()
    assert offsets.tolist() == [0, 2, 2, 7] and offsets.dtype == dtype
    v1, offsets1 = from_jagged_tensor(jt)
    assert v1 is values and torch.equal(offsets1, offsets)


def test_from_jagged_tensor_errors():
    jt = JaggedTensor(values=torch.randn(7, 96), lengths=torch.tensor([2, 5]))
    with pytest.raises(ValueError, match="E = 96 of jt.values\\(\\) is not divisible by heads = 5"):
        from_jagged_tensor(jt, heads=5)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        from_jagged_tensor(jt, heads=0)
    with pytest.raises(TypeError, match="jt must be a torchrec JaggedTensor"):
        from_jagged_tensor(torch.randn(7, 96), heads=2)
    with pytest.raises(ValueError, match=r"needs jt.values\(\) of shape \[T, E\]"):
        from_jagged_tensor(JaggedTensor(values=torch.randn(7), lengths=torch.tensor([7])), heads=1)


def test_to_jagged_tensor_round_trip():
    values, offsets = torch.randn(40, 2, 32), torch.tensor([0, 33, 33, 40])
    jt = to_jagged_tensor(values, offsets)
    assert jt.values() is values and jt.lengths().tolist() == [33, 0, 7]
    v, o = from_jagged_tensor(jt)
    assert v is values and torch.equal(o, offsets)
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        to_jagged_tensor(values, offsets.float())


def test_from_kjt_views_each_feature():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.arange(10), lengths=torch.tensor([1, 0, 2, 3, 4, 0]))
    va, oa = from_kjt(kjt, "a")
    vb, ob = from_kjt(kjt, "b")
    assert va.tolist() == [0, 1, 2] and oa.tolist() == [0, 1, 1, 3]
    assert vb.tolist() == [3, 4, 5, 6, 7, 8, 9] and ob.tolist() == [0, 3, 7, 7]
    assert vb.data_ptr() == kjt.values().data_ptr() + 3 * kjt.values().element_size()  # a view
    with pytest.raises(KeyError, match="key 'c' is not a feature of kjt"):
        from_kjt(kjt, "c")
    with pytest.raises(TypeError, match="kjt must be a torchrec KeyedJaggedTensor"):
        from_kjt({"a": 1}, "a")


def test_embedding_output_quantizes(mixed_lengths):
    ec = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
        name="t0", embedding_dim=64, num_embeddings=100, feature_names=["f"])])
    lengths = torch.tensor(mixed_lengths)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.randint(0, 100, (int(lengths.sum()),)),
                                              lengths=lengths)
    values, offsets = from_jagged_tensor(ec(kjt)["f"], heads=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: compiled on a GPU, else interpreted
    values, offsets = values.to(device), offsets.to(device)
    ref = quantize_jagged(values, offsets, ("hdim", "seq"), backend="reference")
    ours = quantize_jagged(values, offsets, ("hdim", "seq"), backend="triton")
    for name in ("payload_hdim", "payload_seq", "scale_hdim", "scale_seq"):
        assert torch.equal(getattr(ours, name).view(torch.uint8), getattr(ref, name).view(torch.uint8))
