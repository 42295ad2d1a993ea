"""The cute backend's per-call layout (`varlen_batch`), built on the CPU here (it is plain torch)."""
import torch

from gem_lp.attention.cute.interface import varlen_batch
from gem_lp.attention.interface import _checked


def _batch(q_offsets, kv_offsets, *, broadcast_q=False, q_rows=0, total_q=0, total_k=0):
    q_offs = None if broadcast_q else _checked(q_offsets, "q_offsets", total_q)
    kv_offs = _checked(kv_offsets if kv_offsets is not None else q_offsets, "kv_offsets", total_k)
    return varlen_batch(q_offsets, kv_offsets, q_offs, kv_offs, broadcast_q=broadcast_q, q_rows=q_rows,
                        device=torch.device("cpu"))


def test_self_attention_layout_from_int32_offsets_and_cached_per_tensor():
    offsets = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    vb = _batch(offsets, None, total_q=11, total_k=11)
    assert vb.cu_q.dtype == torch.int32 and vb.q_offsets.dtype == torch.int64
    assert vb.cu_q.tolist() == vb.cu_k.tolist() == offsets.tolist() == vb.out_offsets.tolist()
    assert (vb.max_q, vb.max_k, vb.batch, vb.broadcast_q) == (7, 7, 4, False)
    again = _batch(offsets, None, total_q=11, total_k=11)
    assert again.cu_q is vb.cu_q and again.kv_offsets is vb.kv_offsets  # built once per offsets tensor
    assert vb.q_offsets.data_ptr() != offsets.data_ptr()  # a copy: the caller may write its tensor later
    offsets[4] = 20  # an in-place write moves the version: the layout is rebuilt
    assert _batch(offsets, None, total_q=20, total_k=20).max_q == 10


def test_cross_and_broadcast_layouts():
    q_offsets, kv_offsets = torch.arange(4), torch.tensor([0, 5, 5, 9])
    vb = _batch(q_offsets, kv_offsets, total_q=3, total_k=9)
    assert vb.cu_q.tolist() == [0, 1, 2, 3] and vb.cu_k.tolist() == [0, 5, 5, 9] and (vb.max_q, vb.max_k) == (1, 5)
    vb = _batch(None, kv_offsets, broadcast_q=True, q_rows=4, total_k=9)
    assert vb.cu_q.tolist() == [0, 4, 8, 12] == vb.out_offsets.tolist() and vb.q_offsets.tolist() == [0, 4]
    assert (vb.max_q, vb.max_k, vb.batch) == (4, 5, 3)
    empty = _batch(None, torch.zeros(1, dtype=torch.int64), broadcast_q=True, q_rows=4, total_k=0)
    assert (empty.max_q, empty.max_k, empty.batch) == (0, 0, 0) and empty.cu_q.tolist() == [0]
