"""`jagged_attention` with `max_seqlen_q` / `max_seqlen_k`: offsets taken as given (no host copy), the same results
as checked offsets, clear errors for the arguments' form (CPU); on the GPU, a call captured in a CUDA graph and
replayed on other offsets of the same shape equals the eager call on them."""
import pytest
import torch

from gem_lp.attention import jagged_attention

LENGTHS = [5, 0, 33, 1, 31]


def _offsets(lengths, device="cpu"):
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths), 0)]).to(device)


@pytest.mark.parametrize("mode", ["self", "broadcast"])
def test_unchecked_offsets_give_the_checked_result(mode):
    offs = _offsets(LENGTHS)
    t = int(offs[-1])
    q = torch.randn(4 if mode == "broadcast" else t, 2, 32, requires_grad=True)
    k, v = (torch.randn(t, 2, 32, requires_grad=True) for _ in range(2))
    outs = []
    for bound in (None, 64):
        if mode == "broadcast":
            o = jagged_attention(q, k, v, None, offs, broadcast_q=True, precision="fp32", max_seqlen_k=bound)
        else:
            o = jagged_attention(q, k, v, offs, causal=True, precision="fp32", max_seqlen_q=bound,
                                 max_seqlen_k=bound)
        grads = torch.autograd.grad(o.sum(), (q, k, v))
        outs.append((o, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unchecked_offsets_argument_errors():
    offs = _offsets(LENGTHS)
    t = int(offs[-1])
    q, k, v = (torch.randn(t, 2, 32) for _ in range(3))
    with pytest.raises(ValueError, match="max_seqlen_q needs max_seqlen_k"):
        jagged_attention(q, k, v, offs, max_seqlen_q=64)
    with pytest.raises(ValueError, match="give both"):
        jagged_attention(q, k, v, offs, max_seqlen_k=64)
    with pytest.raises(ValueError, match="max_seqlen_k must be None or a non-negative int"):
        jagged_attention(q, k, v, offs, max_seqlen_q=64, max_seqlen_k=-1)
    with pytest.raises(ValueError, match="max_seqlen_q must be None or a non-negative int"):
        jagged_attention(q, k, v, offs, max_seqlen_q=True, max_seqlen_k=64)
    with pytest.raises(ValueError, match="pass kv_offsets and q_offsets=None"):
        jagged_attention(q[:4], k, v, torch.tensor([0, 4]), offs, broadcast_q=True, max_seqlen_k=64)
    with pytest.raises(ValueError, match="same number of sequences"):
        jagged_attention(q, k, v, offs, offs[:-1], max_seqlen_q=64, max_seqlen_k=64)
    with pytest.raises(ValueError, match="self-attention: k must have Tq=70 rows, got 69"):
        jagged_attention(q, k[:-1], v[:-1], offs, max_seqlen_q=64, max_seqlen_k=64)
    with pytest.raises(TypeError, match="q_offsets must be int32 or int64"):
        jagged_attention(q, k, v, offs.float(), max_seqlen_q=64, max_seqlen_k=64)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("mode", ["self", "broadcast", "target"])
def test_captured_attention_replays_on_new_offsets(precision, mode):
    """One forward and backward captured with unchecked device offsets, replayed on other lengths with the same
    number of sequences and tokens: the eager call's output and gradients on those lengths (checked offsets)."""
    from cute_gpu import require_cute_gpu

    require_cute_gpu(9)
    dev, h, d = "cuda", 2, 128
    first, second = [40, 0, 300, 7, 129, 1], [1, 128, 33, 200, 31, 84]
    assert sum(first) == sum(second)
    t, b = sum(first), len(first)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

    q_rows = {"self": t, "broadcast": 4, "target": b}[mode]
    q, k, v, grad = rand(q_rows, h, d), rand(t, h, d), rand(t, h, d), rand(b * 4 if mode == "broadcast" else q_rows,
                                                                           h, d)
    q_offs = _offsets([1] * b, dev)

    def call(q, k, v, offs, bound):
        kw = dict(precision=precision, max_seqlen_q=bound, max_seqlen_k=bound)
        if mode == "self":
            return jagged_attention(q, k, v, offs, causal=True, **kw)
        if mode == "broadcast":
            return jagged_attention(q, k, v, None, offs, broadcast_q=True, **kw)
        return jagged_attention(q, k, v, q_offs, offs, **kw)

    def step(offs, bound):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (static_q, static_k, static_v))
        out = call(q_, k_, v_, offs, bound)
        return (out, *torch.autograd.grad(out, (q_, k_, v_), grad))

    static_q, static_k, static_v, static_offs = q.clone(), k.clone(), v.clone(), _offsets(first, dev)
    step(static_offs, t)  # kernels built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = step(static_offs, t)
    static_offs.copy_(_offsets(second, dev))
    graph.replay()
    eager = step(_offsets(second, "cpu"), None)
    torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=0)  # the forward is deterministic
    for name, a, e in zip(("dQ", "dK", "dV"), captured[1:], eager[1:]):  # dQ: FP32 atomics, in any order
        torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2, msg=lambda m: f"{name}: {m}")
