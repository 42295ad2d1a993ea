"""`quantize_jagged`'s payloads and blocked scales are byte for byte the varlen operands of LP-FA4 (Meta's MXFP8
FlashAttention-4, facebookresearch/ads_model_kernel_library `lp_fa4`, 0.1.0.dev0): its layout, stated
independently here — per head, the `hdim` scales `[Tp, D/32]` and the `seq` scales `[D, Tp/32]` of the sequences
each padded with zero scale rows to a multiple of 128 tokens, packed by quack's `pack_scale_2d_to_blocked_contig`
(the 128x4 tiles cuBLAS and the block-scaled MMA read), the `hdim` bytes viewed as `[H * Tp / 4, 16]`, the `seq`
bytes as `[H * 32, Tp / 8]` — with its per-sequence quantization from the same scale rule."""
import pytest
import torch

from gem_lp.jagged import quantize_jagged
from gem_lp.mx.reference import quantize_reference

blocked_pack = pytest.importorskip("quack.blockscaled").pack_scale_2d_to_blocked_contig

LENGTHS = (1, 31, 32, 33, 127, 128, 129, 300)


def _round_up(n: int) -> int:
    return (n + 127) // 128 * 128


def _lp_fa4_layout(x: torch.Tensor, lengths):
    """The operands as LP-FA4 lays them out, built from per-sequence reference quantizations."""
    heads, dim = x.shape[1], x.shape[2]
    hdim_scales, seq_scales, hdim_payload, seq_payload = [], [], [], []
    start = 0
    for n in lengths:
        seg = x[start:start + n]
        start += n
        h = quantize_reference(seg, axis=-1)  # 1x32 along D: [n, H, D/32] scales
        pad = torch.zeros(heads, _round_up(n), dim // 32, dtype=torch.uint8)
        pad[:, :n] = h.scale.permute(1, 0, 2)
        hdim_scales.append(pad)
        hdim_payload.append(h.data)
        s = quantize_reference(seg.permute(1, 2, 0), axis=-1, allow_partial=True)  # 32x1 along tokens
        pad = torch.zeros(heads, dim, _round_up(n) // 32, dtype=torch.uint8)
        pad[..., :s.scale.shape[-1]] = s.scale
        seq_scales.append(pad)
        seq_payload.append(s.data.permute(2, 0, 1))
    tp = sum(_round_up(n) for n in lengths)
    hdim = blocked_pack(torch.cat(hdim_scales, dim=1)).reshape(-1, 16)
    seq = blocked_pack(torch.cat(seq_scales, dim=2)).reshape(heads * 32, -1)
    assert hdim.shape == (heads * tp // 4, 16) and seq.shape == (heads * 32, tp // 8)
    return torch.cat(hdim_payload), hdim, torch.cat(seq_payload), seq


@pytest.mark.parametrize("heads", [1, 3])
def test_payloads_and_scales_are_lp_fa4_bytes(heads):
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(sum(LENGTHS), heads, 128, generator=g) * torch.exp2(
        torch.randint(-8, 9, (sum(LENGTHS), heads, 1), generator=g).float())
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    ours = quantize_jagged(x, offsets, ("hdim", "seq"), backend="reference")
    hdim_q, hdim_s, seq_q, seq_s = _lp_fa4_layout(x, LENGTHS)
    assert torch.equal(ours.payload_hdim.view(torch.uint8), hdim_q.view(torch.uint8))
    assert torch.equal(ours.payload_seq.view(torch.uint8), seq_q.view(torch.uint8))
    assert torch.equal(ours.scale_hdim.reshape(-1, 16), hdim_s.view(torch.uint8))
    assert torch.equal(ours.scale_seq.reshape(heads * 32, -1), seq_s.view(torch.uint8))
