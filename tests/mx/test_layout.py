"""128x4 blocked scale layout: byte-identical to torchao's to_blocked, invertible, and the offset formula."""
import pytest
import torch

from gem_lp.mx import blocked_index, blocked_size, from_blocked, to_blocked

SHAPES = [(1, 1), (1, 4), (31, 3), (100, 5), (128, 4), (129, 4), (300, 64), (256, 7)]


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_matches_torchao(rows, cols):
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    ours = to_blocked(s)
    theirs = utils.to_blocked(s.view(torch.float8_e8m0fnu)).view(torch.uint8).flatten()
    assert ours.numel() == blocked_size(rows, cols)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_round_trip_and_formula(rows, cols):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    b = to_blocked(s)
    assert torch.equal(from_blocked(b, rows, cols), s)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(b[blocked_index(r, c, cols)], s)
    # every byte that no scale maps to is padding, and padding is 0
    used = torch.zeros_like(b, dtype=torch.bool)
    used[blocked_index(r, c, cols).flatten()] = True
    assert b[~used].eq(0).all() and used.sum() == rows * cols


def test_errors():
    with pytest.raises(ValueError, match="scale must be 2-D"):
        to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scale must be uint8"):
        to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="blocked must be a flat tensor of 512 bytes"):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 4, 4)
