"""The producer pass (`gem_lp.attention.producer`): MX-exact BF16 operands equal to the reference quantization,
per sequence, bit for bit. Runs the Triton kernel on the GPU when there is one, else in Triton's interpreter."""
import pytest
import torch

from gem_lp.attention.producer import ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE, mx_operands
from gem_lp.attention.reference import mx_hdim, mx_seq, mx_square

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offsets_of(lengths) -> torch.Tensor:
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offs.to(DEV)


def randn(rows, heads, dim, dtype=torch.bfloat16, outliers=False):
    x = torch.randn(rows, heads, dim)
    if outliers:  # a few channels x20, as activations with outlier features have
        x[:, :, torch.randperm(dim)[:3]] *= 20.0
    return x.to(dtype).to(DEV)


def per_sequence(x, offs, fn):
    """`fn` on each sequence of `x [T, H, D]` as `[H, L padded to 32, D]` (zeros never raise a max)."""
    out = torch.empty(x.shape)
    o = offs.tolist()
    for s, e in zip(o[:-1], o[1:]):
        if e > s:
            xs = torch.nn.functional.pad(x[s:e].float().cpu().transpose(0, 1), (0, 0, 0, (-(e - s)) % 32))
            out[s:e] = fn(xs)[:, : e - s].transpose(0, 1)
    return out


@pytest.mark.parametrize("dim", [64, 128])
def test_operands_match_reference_quantization(dim):
    """One launch over four tensors with their own offsets (odd lengths, an empty sequence), in BF16 and FP32."""
    q_offs, kv_offs = offsets_of([5, 0, 70, 33, 1]), offsets_of([64, 1, 0, 100, 127])
    q, do = randn(int(q_offs[-1]), 3, dim, outliers=True), randn(int(q_offs[-1]), 3, dim)
    k, v = randn(int(kv_offs[-1]), 3, dim, dtype=torch.float32), randn(int(kv_offs[-1]), 3, dim)
    q_h, k_s, v_h, do_sq = mx_operands([(q, q_offs, ORIENT_HDIM), (k, kv_offs, ORIENT_SEQ), (v, kv_offs, ORIENT_HDIM),
                                        (do, q_offs, ORIENT_SQUARE)])
    assert all(t.dtype == torch.bfloat16 for t in (q_h, k_s, v_h, do_sq))
    assert torch.equal(q_h.float().cpu(), per_sequence(q, q_offs, mx_hdim))
    assert torch.equal(k_s.float().cpu(), per_sequence(k, kv_offs, mx_seq))
    assert torch.equal(v_h.float().cpu(), per_sequence(v, kv_offs, mx_hdim))
    assert torch.equal(do_sq.float().cpu(), per_sequence(do, q_offs, mx_square))


def test_nan_blocks_and_empty_batches():
    offs = offsets_of([40])
    x = randn(40, 1, 64)
    x[3, 0, 5] = float("nan")
    (sq,) = mx_operands([(x, offs, ORIENT_SQUARE)])
    assert torch.isnan(sq[:32, 0, :32]).all()
    assert not torch.isnan(sq[32:]).any() and not torch.isnan(sq[:, :, 32:]).any()
    for lengths in ([], [0, 0]):
        o = offsets_of(lengths)
        (out,) = mx_operands([(torch.zeros(0, 2, 64, device=DEV), o, ORIENT_HDIM)])
        assert out.shape == (0, 2, 64)


def test_argument_errors():
    offs = offsets_of([4])
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_operands([(randn(4, 1, 48), offs, ORIENT_HDIM)])
    with pytest.raises(ValueError, match="orient"):
        mx_operands([(randn(4, 1, 64), offs, 7)])
    with pytest.raises(ValueError, match="1 to 4"):
        mx_operands([(randn(4, 1, 64), offs, ORIENT_HDIM)] * 5)


def test_strided_token_rows_are_read_in_place():
    """q, k, v as views of a fused [T, 3, H, D] projection give the same operands as contiguous copies."""
    offs = offsets_of([33, 0, 64])
    qkv = randn(97, 3 * 2, 64).view(97, 3, 2, 64)
    views = qkv.unbind(1)
    got = mx_operands([(views[0], offs, ORIENT_HDIM), (views[1], offs, ORIENT_SQUARE), (views[2], offs, ORIENT_SEQ)])
    want = mx_operands([(views[0].contiguous(), offs, ORIENT_HDIM), (views[1].contiguous(), offs, ORIENT_SQUARE),
                        (views[2].contiguous(), offs, ORIENT_SEQ)])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contiguous heads and features"):
        mx_operands([(qkv.permute(0, 2, 1, 3)[:, 0], offs, ORIENT_HDIM)])


def test_empty_inputs_with_any_strides():
    """An empty gradient may come with strides (0, 0, 0) (an expanded zero); nothing is read or written."""
    offs = offsets_of([0, 0])
    empty = torch.zeros(1, 2, 64, device=DEV).expand(0, 2, 64)
    (out,) = mx_operands([(empty, offs, ORIENT_SQUARE)])
    assert out.shape == (0, 2, 64)
