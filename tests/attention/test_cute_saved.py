"""What the cute backend's MXFP8 attention keeps for its backward, on the CPU: the kernels are stand-ins that record
their operands (they run on the GPU only: `test_cute_attention.py`), the producer pass runs in Triton's interpreter.
The op keeps Q, K (square) and V (hdim) packed as MX, not q, k, v, and its backward gets, decoded from them, the same
operands as quantizing q, k, v there would give."""
import pytest
import torch

pytest.importorskip("flash_attn.cute")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in kernels on the CPU (the producer in Triton's "
                                "interpreter); on a GPU, test_cute_attention.py runs the real ones")

from gem_lp.attention.cute import interface as cute_interface  # noqa: E402
from gem_lp.attention.cute import launch  # noqa: E402
from gem_lp.attention.producer import ORIENT_HDIM, ORIENT_SQUARE, mx_operands  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    calls = {}

    def forward(q, k, v, cu_q, cu_k, **kwargs):
        calls["forward"] = (q, k, v)
        return torch.zeros(q.shape, dtype=torch.bfloat16), torch.zeros(q.shape[1], q.shape[0])

    def backward(q, k, v, do, out, lse, dlse, cu_q, cu_k, dq=None, dk=None, dv=None, **kwargs):
        calls["backward"] = (q, k, v, do)
        calls["outputs"] = (dq, dk, dv)
        return tuple(x.clone() if given is None else given.copy_(x) for x, given in ((q, dq), (k, dk), (v, dv)))

    monkeypatch.setattr(launch, "mx_forward", forward)
    monkeypatch.setattr(launch, "mx_backward", backward)
    monkeypatch.setattr(cute_interface, "build_arch", lambda device: "sm_90a")
    return calls


def _saved_by(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        result = fn()
    return result, saved


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_mxfp8_keeps_packed_operands_and_decodes_them_for_the_backward(recorded, broadcast_q):
    lengths = [31, 0, 1, 129, 40]
    offs = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t, heads, dim = int(offs[-1]), 2, 64
    qkv = (torch.randn(t, 3, heads, dim) * 3).bfloat16().requires_grad_()
    q, k, v = qkv.unbind(1)
    if broadcast_q:
        q = (torch.randn(8, heads, dim) * 3).bfloat16().requires_grad_()
        vb = cute_interface.varlen_batch(None, offs, None, offs, broadcast_q=True, q_rows=8, device=q.device)
    else:
        vb = cute_interface.varlen_batch(offs, None, offs, offs, broadcast_q=False, q_rows=t, device=q.device)
    (out, lse), saved = _saved_by(
        lambda: cute_interface.CuteAttention.apply(q, k, v, vb, False, "mxfp8", 0.125, "const_p", None))
    # six packed tensors (payload and scales of Q, K, V), O and LSE: no BF16 copy of q, k or v
    assert sorted(str(s.dtype) for s in saved) == sorted(["torch.uint8"] * 6 + ["torch.bfloat16", "torch.float32"])
    assert sum(s.numel() for s in saved if s.dtype == torch.uint8) < 1.1 * (q.numel() + k.numel() + v.numel())
    d_out = torch.randn(out.shape).bfloat16()
    out.backward(d_out)
    want = mx_operands([(q.detach(), vb.q_offsets, ORIENT_SQUARE), (k.detach(), vb.kv_offsets, ORIENT_SQUARE),
                        (v.detach(), vb.kv_offsets, ORIENT_HDIM), (d_out, vb.out_offsets, ORIENT_SQUARE)])
    got = recorded["backward"]
    if broadcast_q:  # the kernels see the shared queries once per sequence
        assert torch.equal(got[0].view(torch.int16), want[0].repeat(len(lengths), 1, 1).view(torch.int16))
        got, want = got[1:], want[1:]
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("packing", ["qkv", "kv", "kv broadcast"])
def test_packed_inputs_get_one_gradient_written_in_place(recorded, packing):
    """With q, k, v (or k, v) packed in one tensor, the kernels write dQ, dK, dV into views of that tensor's
    gradient (no copy into it afterwards); the gradient is what the three separate ones stack to."""
    lengths = [31, 0, 1, 129, 40]
    offs = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t, heads, dim = int(offs[-1]), 2, 64
    packed = (torch.randn(t, 3 if packing == "qkv" else 2, heads, dim) * 3).bfloat16().requires_grad_()
    broadcast = packing == "kv broadcast"
    if packing == "qkv":
        inputs = (packed, None, None)
        vb = cute_interface.varlen_batch(offs, None, offs, offs, broadcast_q=False, q_rows=t, device=packed.device)
        q = packed[:, 0]
    else:
        rows = 8 if broadcast else len(lengths)
        q = (torch.randn(rows, heads, dim) * 3).bfloat16().requires_grad_()
        q_offs = None if broadcast else torch.arange(len(lengths) + 1)
        vb = cute_interface.varlen_batch(q_offs, offs, q_offs, offs, broadcast_q=broadcast, q_rows=rows,
                                         device=q.device)
        inputs = (q, packed, None)
    out, _ = cute_interface.CuteAttention.apply(*inputs, vb, False, "mxfp8", 0.125, "const_p", packing.split()[0])
    out.backward(torch.randn(out.shape).bfloat16())
    dq, dk, dv = recorded["outputs"]
    got_q, got_k, got_v = recorded["backward"][:3]
    # the kernels' outputs are views of one buffer shaped as the packed tensor (leaf .grad may be a copy of it)
    buffer = dk._base
    assert buffer is not None and dv._base is buffer and buffer.shape == packed.shape
    assert dk.data_ptr() == buffer[:, -2].data_ptr() and dv.data_ptr() == buffer[:, -1].data_ptr()
    assert torch.equal(packed.grad, buffer)
    if packing == "qkv":
        assert dq._base is buffer and dq.data_ptr() == buffer.data_ptr()
        assert torch.equal(packed.grad, torch.stack([got_q, got_k, got_v], 1))
    else:
        assert dq is None  # q is not in the packed tensor
        assert torch.equal(packed.grad, torch.stack([got_k, got_v], 1))
        want_dq = got_q.view(len(lengths), 8, heads, dim).sum(0, dtype=torch.float32).bfloat16() if broadcast else got_q
        assert torch.equal(q.grad, want_dq)
