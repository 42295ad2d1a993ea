"""Jagged attention on CUDA: the auto route of the 16-bit recipe (FlashAttention-4 on the cute backend), the
reference at realistic lengths (bounded memory), and CPU/GPU agreement of the reference."""
import math
import time

import pytest
import torch

from gem_lp.attention import jagged_attention
from gem_lp.accuracy import cosine, sqnr_db

pytestmark = pytest.mark.gpu


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device=device)


def qkv(tokens, heads, dim, dtype, device, seed=0, q_tokens=None):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(q_tokens or tokens, heads, dim, generator=g, device=device).to(dtype).requires_grad_()
    k = torch.randn(tokens, heads, dim, generator=g, device=device).to(dtype).requires_grad_()
    v = torch.randn(tokens, heads, dim, generator=g, device=device).to(dtype).requires_grad_()
    return q, k, v


def forward_backward(q, k, v, d_out, **kwargs):
    o = jagged_attention(q, k, v, **kwargs)
    grads = torch.autograd.grad(o, (q, k, v), d_out)
    return (o,) + grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_auto_route_matches_fp32_reference(dim, causal, dtype):
    """backend='auto' on CUDA takes FlashAttention-4 for the 16-bit recipe; same semantics."""
    lengths = [1, 31, 33, 127, 129, 700, 1000]
    offs = offsets(lengths, "cuda")
    q, k, v = qkv(int(offs[-1]), 4, dim, dtype, "cuda")
    d_out = torch.randn(q.shape, device="cuda").to(dtype)
    auto = forward_backward(q, k, v, d_out, q_offsets=offs, causal=causal, precision="bf16")
    ref16 = forward_backward(q, k, v, d_out, q_offsets=offs, causal=causal, precision="bf16", backend="reference")
    ref32 = forward_backward(q, k, v, d_out, q_offsets=offs, causal=causal, precision="fp32", backend="reference")
    for name, a, r16, r32 in zip(["O", "dQ", "dK", "dV"], auto, ref16, ref32):
        assert a.dtype == dtype and a.shape == r32.shape
        print(f"{name}: auto vs fp32 {sqnr_db(a, r32):.1f} dB, bf16 reference vs fp32 {sqnr_db(r16, r32):.1f} dB")
        assert cosine(a, r32) > 0.9999 and sqnr_db(a, r32) > 35, name
        assert sqnr_db(a, r16) > 35, name


def test_bf16_auto_route_cross_and_empty_sequences():
    """Cross-attention lengths, empty sequences and a non-default scale through the auto route."""
    q_offs, kv_offs = offsets([5, 0, 40, 1], "cuda"), offsets([70, 0, 9, 300], "cuda")
    q, _, _ = qkv(46, 2, 64, torch.bfloat16, "cuda", q_tokens=46)
    _, k, v = qkv(379, 2, 64, torch.bfloat16, "cuda", seed=1)
    d_out = torch.randn(q.shape, device="cuda").bfloat16()
    kwargs = dict(q_offsets=q_offs, kv_offsets=kv_offs, precision="bf16", softmax_scale=0.2)
    auto = forward_backward(q, k, v, d_out, **kwargs)
    ref = forward_backward(q, k, v, d_out, backend="reference", **dict(kwargs, precision="fp32"))
    for name, a, r in zip(["O", "dQ", "dK", "dV"], auto, ref):
        assert sqnr_db(a, r) > 35, name


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_reference_on_gpu_matches_cpu(precision):
    lengths = [0, 1, 31, 33, 127, 129]
    offs = offsets(lengths)
    q, k, v = qkv(int(offs[-1]), 2, 64, torch.float32, "cpu")
    d_out = torch.randn(q.shape)
    kwargs = dict(q_offsets=offs, causal=True, precision=precision, backend="reference")
    cpu = forward_backward(q, k, v, d_out, **kwargs)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    gpu = forward_backward(qc, kc, vc, d_out.cuda(), **dict(kwargs, q_offsets=offs.cuda()))
    for name, a, b in zip(["O", "dQ", "dK", "dV"], gpu, cpu):
        # different GEMM summation orders may flip a rare E4M3 rounding; anything more is a bug
        assert sqnr_db(a.cpu(), b) > 45, name


def test_mxfp8_reference_at_long_lengths_fits_in_memory():
    """The reference must run on the GPU at lengths of a few thousand, memory bounded by its chunking."""
    lengths = [3274, 2048, 1500, 1024, 700, 129, 33, 1]
    offs = offsets(lengths, "cuda")
    heads, dim = 8, 128
    q, k, v = qkv(int(offs[-1]), heads, dim, torch.bfloat16, "cuda")
    d_out = torch.randn(q.shape, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    got = forward_backward(q, k, v, d_out, q_offsets=offs, causal=True, precision="mxfp8")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    ref = forward_backward(q, k, v, d_out, q_offsets=offs, causal=True, precision="fp32", backend="reference")
    figures = {n: (cosine(a, r), sqnr_db(a, r)) for n, a, r in zip(["O", "dQ", "dK", "dV"], got, ref)}
    print(f"\nmxfp8 reference, {sum(lengths)} tokens, H{heads} D{dim}: {seconds:.2f} s fwd+bwd, "
          f"peak {peak / 2**30:.2f} GiB; " + ", ".join(f"{n} cos {c:.5f} {s:.1f} dB" for n, (c, s) in figures.items()))
    assert peak < 40 * 2**30
    for name, (c, s) in figures.items():
        assert c > 0.99 and s > 20, name
    assert all(math.isfinite(t.float().sum().item()) for t in got)
