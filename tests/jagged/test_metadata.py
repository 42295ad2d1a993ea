"""JaggedLayout: the padded-row arithmetic, the tile->sequence map, one host sync, and every error."""
import pytest
import torch

from gem_lp.jagged import JaggedLayout, quantize_jagged
from gem_lp.jagged.metadata import tile_sequences


def offsets_of(lengths, dtype=torch.int64):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_layout_fields(dtype, mixed_lengths):
    offsets = offsets_of(mixed_lengths, dtype)
    values = torch.zeros(sum(mixed_lengths), 1, 32)
    layout = JaggedLayout.from_offsets(offsets, values)
    assert layout.offsets is offsets and layout.lengths.dtype == dtype
    assert layout.lengths.tolist() == mixed_lengths
    padded = [-(-n // 128) * 128 for n in mixed_lengths]
    assert layout.scale_offsets.dtype == torch.int64
    assert layout.scale_offsets.tolist() == [sum(padded[:b]) for b in range(len(padded) + 1)]
    assert layout.padded_total == sum(padded) and layout.num_tiles == sum(padded) // 128
    assert layout.max_len == max(mixed_lengths) and layout.total == sum(mixed_lengths)
    assert layout.batch_size == len(mixed_lengths)
    # each tile's owner: the sequence whose padded rows contain the tile's first row
    want = [b for b, p in enumerate(padded) for _ in range(p // 128)]
    assert layout.tile_seq.tolist() == want
    # each tile's first padded row as a packed token of its sequence, and that sequence's end
    starts = [sum(mixed_lengths[:b]) for b in range(len(mixed_lengths) + 1)]
    first_tile = {b: sum(padded[:b]) // 128 for b in range(len(padded))}
    assert layout.tile_tokens.dtype == torch.int64 and layout.tile_tokens.shape == (layout.num_tiles, 2)
    assert layout.tile_tokens.tolist() == [[starts[b] + 128 * (i - first_tile[b]), starts[b + 1]]
                                           for i, b in enumerate(want)]


def test_tile_map_skips_runs_of_empty_sequences():
    lengths = [0, 0, 5, 0, 0, 0, 200, 0]
    layout = JaggedLayout.from_offsets(offsets_of(lengths), total=205)
    assert layout.tile_seq.tolist() == [2, 6, 6]
    assert layout.tile_tokens.tolist() == [[0, 5], [5, 205], [133, 205]]
    assert tile_sequences(layout.scale_offsets, 0).numel() == 0


def test_one_host_sync_and_none_with_precomputed(monkeypatch, mixed_lengths):
    offsets = offsets_of(mixed_lengths)
    calls = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls.append(self.shape)
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    layout = JaggedLayout.from_offsets(offsets, total=sum(mixed_lengths))
    assert len(calls) == 1
    calls.clear()
    fast = JaggedLayout.from_offsets(offsets, total=layout.total, max_len=layout.max_len,
                                     padded_total=layout.padded_total)
    assert calls == [] and fast.padded_total == layout.padded_total and fast.max_len == layout.max_len
    assert torch.equal(fast.scale_offsets, layout.scale_offsets) and torch.equal(fast.tile_seq, layout.tile_seq)
    assert torch.equal(fast.tile_tokens, layout.tile_tokens)
    JaggedLayout.from_offsets(offsets, total=layout.total, max_len=layout.max_len,
                              padded_total=layout.padded_total, validate=True)
    assert len(calls) == 1


def test_empty_batch():
    layout = JaggedLayout.from_offsets(torch.zeros(1, dtype=torch.int32), torch.empty(0, 2, 32))
    assert (layout.batch_size, layout.total, layout.max_len, layout.padded_total) == (0, 0, 0, 0)
    assert layout.tile_tokens.shape == (0, 2)
    assert layout.scale_offsets.tolist() == [0] and layout.lengths.numel() == 0


@pytest.mark.parametrize("offsets,match,exc", [
    ([0, 3, 5], "must be a torch.Tensor", TypeError),
    (torch.tensor([[0, 3, 5]]), r"offsets must be 1-D \[B\+1\]", ValueError),
    (torch.tensor([0.0, 3.0, 5.0]), "offsets must be int32 or int64, got torch.float32", TypeError),
    (torch.tensor([0, 3, 5], dtype=torch.int16), "offsets must be int32 or int64", TypeError),
    (torch.tensor([], dtype=torch.int64), "B\\+1 >= 1 elements", ValueError),
    (torch.tensor([1, 3, 5]), r"offsets must start at 0, got offsets\[0\] = 1", ValueError),
    (torch.tensor([0, 4, 3, 5]), r"non-decreasing, got offsets\[1\] = 4 > offsets\[2\] = 3", ValueError),
    (torch.tensor([0, 3, 6]), r"offsets must end at values.shape\[0\] = 5, got offsets\[-1\] = 6", ValueError),
])
def test_offsets_errors(offsets, match, exc):
    with pytest.raises(exc, match=match):
        JaggedLayout.from_offsets(offsets, torch.zeros(5, 1, 32))
    if isinstance(offsets, torch.Tensor):  # the public op reports the same
        with pytest.raises(exc, match=match):
            quantize_jagged(torch.zeros(5, 1, 32), offsets)


def test_device_mismatch_error():
    offsets = torch.tensor([0, 5], device="meta")
    with pytest.raises(ValueError, match="same device as values: offsets on meta, values on cpu"):
        JaggedLayout.from_offsets(offsets, torch.zeros(5, 1, 32))


def test_precomputed_value_errors():
    offsets = offsets_of([3, 200])
    with pytest.raises(ValueError, match="max_len=100 disagrees with the offsets, which give 200"):
        JaggedLayout.from_offsets(offsets, total=203, max_len=100)
    with pytest.raises(ValueError, match="padded_total=128 disagrees with the offsets, which give 384"):
        JaggedLayout.from_offsets(offsets, total=203, padded_total=128)
    with pytest.raises(ValueError, match=r"offsets must end at total = 7"):
        JaggedLayout.from_offsets(offsets, total=7)
    with pytest.raises(ValueError, match="total=9 disagrees with values.shape\\[0\\]=203"):
        JaggedLayout.from_offsets(offsets, torch.zeros(203, 1, 32), total=9)
    with pytest.raises(ValueError, match="max_len must be a non-negative int"):
        JaggedLayout.from_offsets(offsets, total=203, max_len=-1, padded_total=384)
    with pytest.raises(ValueError, match="padded_total=256 disagrees with the offsets, which give 384"):
        JaggedLayout.from_offsets(offsets, total=203, max_len=200, padded_total=256, validate=True)


def test_quantize_argument_errors():
    values, offsets = torch.zeros(5, 2, 64), torch.tensor([0, 5])
    with pytest.raises(ValueError, match=r"values must be 3-D \[T, H, D\]"):
        quantize_jagged(values[:, 0], offsets)
    with pytest.raises(TypeError, match="values must be float32, bfloat16 or float16"):
        quantize_jagged(values.to(torch.int32), offsets)
    with pytest.raises(ValueError, match="positive multiple of 32, got D = 48"):
        quantize_jagged(torch.zeros(5, 2, 48), offsets)
    with pytest.raises(ValueError, match="H >= 1 heads"):
        quantize_jagged(torch.zeros(5, 0, 64), offsets)
    with pytest.raises(ValueError, match="orientations must be one of|orientation must be one of"):
        quantize_jagged(values, offsets, ("hdim", "rows"))
    with pytest.raises(TypeError, match=r"write \('seq',\)"):
        quantize_jagged(values, offsets, "seq")
    with pytest.raises(ValueError, match="must not repeat"):
        quantize_jagged(values, offsets, ("seq", "seq"))
    with pytest.raises(ValueError, match="at least one"):
        quantize_jagged(values, offsets, ())
    with pytest.raises(ValueError, match="scaling must be one of"):
        quantize_jagged(values, offsets, scaling="round")
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize_jagged(values, offsets, backend="cuda")
    layout = JaggedLayout.from_offsets(torch.tensor([0, 4]), total=4)
    with pytest.raises(ValueError, match="describes T = 4 tokens, but values.shape\\[0\\] = 5"):
        quantize_jagged(values, layout)
