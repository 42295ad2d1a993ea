"""Speed variants of the Triton attention kernels give the same bits as the paths they replace.

* `q_in_kernel`: Q rounded to its operand in the forward kernel's prologue, or in the producer pass.
* `producer="strips"`: the producer pass in thread strips, or in 32-token blocks of 4 heads.
* `kv_in_kernel`: K and V tiles rounded in the forward loop, or in the producer pass.
* `kv_tma`: full K and V tiles loaded through tensor descriptors, or by pointers.
* broadcast_q (its own tile map, dQ as a sum of per-sequence partials): the same as the batch with the
  shared queries repeated for every sequence.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) on tiny shapes; the `gpu` tests repeat
the checks with the hardware E4M3 conversion on realistic lengths.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from gem_lp.attention.triton_attention import (
    ORIENT_AS_IS,
    ORIENT_HDIM,
    ORIENT_NONE,
    ORIENT_SEQ,
    _operand_tile,
    attention_backward,
    attention_forward,
    jagged_attention_triton,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FWD_CFG = (64, 32, 1, 1)  # several query and key tiles per sequence on the lengths below


def offsets_of(lengths) -> torch.Tensor:
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offs.to(DEV)


def randn(rows: int, heads: int, dim: int, dtype=torch.bfloat16, outliers: bool = False) -> torch.Tensor:
    x = torch.randn(rows, heads, dim)
    if outliers:  # a few channels x20 and one tiny block: scales far apart inside one tile
        x[:, :, torch.randperm(dim)[:3]] *= 20.0
        x[:1, :, :32] *= 1e-30
    return x.to(dtype).to(DEV)


def orientation_sensitive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v (FP32 copies) whose last 32-feature block spans more than E4M3's range in one direction only,
    so that O changes if K or V is rounded along the wrong axis (elsewhere both axes give E4M3's relative
    precision and O hardly moves): features 16..31 of the block are 2^20 larger in q and 2^-20 smaller in k
    and v. Along D (hdim) q keeps only them, k loses them (their q.k terms vanish: the correct K), v loses
    them; along tokens (seq) k and v keep them."""
    q, k, v = (x.float().clone() for x in (q, k, v))
    hi = slice(q.shape[2] - 16, q.shape[2])
    q[:, :, hi] *= 2.0**20
    k[:, :, hi] *= 2.0**-20
    v[:, :, hi] *= 2.0**-20
    return q, k, v


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)), (x.float() - y.float()).abs().max()


# ----------------------------------------------------------------------------- the in-kernel operand rounding


@triton.jit
def _operand_tile_kernel(x_ptr, out_ptr, ORIENT: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                         HW_CAST: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    y = _operand_tile(tl.load(x_ptr + i), ORIENT, R, C, HW_CAST, INTERPRET)
    tl.store(out_ptr + i, y.to(tl.float32))


def test_operand_tile_matches_reference_quantization():
    """`_operand_tile` on a `[64, 64]` tile whose rows and columns span 2^40: hdim = 1x32 blocks along the
    columns, seq = 32x1 blocks along the rows (reference quantize-dequantize, rceil), then BF16; none =
    BF16 rounding; as-is = unchanged."""
    from gem_lp.mx import dequantize, quantize_reference

    x = torch.randn(64, 64) * 2.0 ** torch.randint(-20, 21, (64, 1)) * 2.0 ** torch.randint(-20, 21, (1, 64))
    want = {ORIENT_HDIM: dequantize(quantize_reference(x, axis=1)).bfloat16().float(),
            ORIENT_SEQ: dequantize(quantize_reference(x, axis=0)).bfloat16().float(),
            ORIENT_NONE: x.bfloat16().float(), ORIENT_AS_IS: x}
    for orient, w in want.items():
        out = torch.empty(64, 64, device=DEV)
        _operand_tile_kernel[(1,)](x.to(DEV), out, ORIENT=orient, R=64, C=64, HW_CAST=DEV.type == "cuda",
                                   INTERPRET=DEV.type != "cuda")
        assert torch.equal(out.cpu(), w), orient
    assert not torch.equal(want[ORIENT_HDIM], want[ORIENT_SEQ])


# ----------------------------------------------------------------------------- Q in the kernel's prologue


@pytest.mark.parametrize("dim,precision,p_quant,causal,dtype", [
    (64, "mxfp8", "const_p", False, torch.bfloat16),
    (128, "mxfp8", "dynamic", True, torch.bfloat16),
    (64, "mxfp8", "const_p", True, torch.float32),
    (64, "bf16", "const_p", True, torch.float32),  # FP32 inputs of the 16-bit recipe: Q rounded to BF16
    (64, "bf16", "const_p", False, torch.float16),  # 16-bit inputs: Q taken as it is either way
])
def test_q_in_kernel_is_bit_identical(dim, precision, p_quant, causal, dtype):
    q_offs, kv_offs = offsets_of([33, 0, 70, 5]), offsets_of([40, 3, 64, 31])
    q = randn(int(q_offs[-1]), 2, dim, outliers=True)
    k, v = randn(int(kv_offs[-1]), 2, dim), randn(int(kv_offs[-1]), 2, dim)
    if dtype != torch.float16:  # (2^20 is past FP16's range)
        q, k, v = orientation_sensitive(q, k, v)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(causal=causal, precision=precision, p_quant=p_quant, config=FWD_CFG)
    assert_same(attention_forward(q, k, v, q_offs, kv_offs, q_in_kernel=True, **kw),
                attention_forward(q, k, v, q_offs, kv_offs, q_in_kernel=False, **kw))


def test_q_in_kernel_broadcast_q():
    kv_offs = offsets_of([0, 70, 5, 33])
    k, v = randn(int(kv_offs[-1]), 2, 64), randn(int(kv_offs[-1]), 2, 64)
    q = randn(40, 2, 64, outliers=True)
    kw = dict(broadcast_q=True, precision="mxfp8", p_quant="dynamic", config=FWD_CFG)
    assert_same(attention_forward(q, k, v, None, kv_offs, q_in_kernel=True, **kw),
                attention_forward(q, k, v, None, kv_offs, q_in_kernel=False, **kw))


# ----------------------------------------------------------------------------- K and V rounded in the loop


@pytest.mark.parametrize("dim,precision,p_quant,causal,dtype", [
    (64, "mxfp8", "const_p", False, torch.bfloat16),
    (128, "mxfp8", "dynamic", True, torch.bfloat16),
    (64, "bf16", "const_p", True, torch.float32),
])
def test_kv_in_kernel_is_bit_identical(dim, precision, p_quant, causal, dtype):
    """Masked last tiles, causal diagonals and outlier channels: the rounding of every KV tile in the loop
    equals the producer pass's (V's 32-token blocks start at the sequence's first token in both)."""
    q_offs, kv_offs = offsets_of([33, 0, 70, 5]), offsets_of([40, 3, 95, 31])
    q, k, v = orientation_sensitive(randn(int(q_offs[-1]), 2, dim), randn(int(kv_offs[-1]), 2, dim, outliers=True),
                                    randn(int(kv_offs[-1]), 2, dim, outliers=True))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(causal=causal, precision=precision, p_quant=p_quant, config=FWD_CFG)
    assert_same(attention_forward(q, k, v, q_offs, kv_offs, kv_in_kernel=True, **kw),
                attention_forward(q, k, v, q_offs, kv_offs, kv_in_kernel=False, **kw))


def test_kv_in_kernel_needs_the_producer_variant():
    offs = offsets_of([5])
    x = randn(5, 1, 64)
    with pytest.raises(ValueError, match="kv_in_kernel"):
        attention_forward(x, x, x, offs, offs, precision="mxfp8", variant="fp8_qk", kv_in_kernel=True)


# ----------------------------------------------------------------------------- K and V through tensor descriptors


@pytest.mark.parametrize("precision,causal,kv_in_kernel,dtype", [
    ("mxfp8", False, False, torch.bfloat16),
    ("mxfp8", True, True, torch.bfloat16),
    ("bf16", True, False, torch.float16),
    ("bf16", False, True, torch.float32),
])
def test_kv_tma_is_bit_identical(precision, causal, kv_in_kernel, dtype):
    """Full tiles through the descriptors (rows of one head of the `[T, H*D]` view), masked tiles by
    pointers: O and LSE equal the pointer loads' on sequences with full and partial tiles, H = 3."""
    q_offs, kv_offs = offsets_of([33, 0, 70, 5]), offsets_of([64, 3, 95, 31])
    q = randn(int(q_offs[-1]), 3, 64, dtype)
    k, v = randn(int(kv_offs[-1]), 3, 64, dtype), randn(int(kv_offs[-1]), 3, 64, dtype)
    kw = dict(causal=causal, precision=precision, config=FWD_CFG, kv_in_kernel=kv_in_kernel)
    assert_same(attention_forward(q, k, v, q_offs, kv_offs, kv_tma=True, **kw),
                attention_forward(q, k, v, q_offs, kv_offs, kv_tma=False, **kw))


# ----------------------------------------------------------------------------- broadcast_q


@pytest.mark.parametrize("lq,causal,kv_in_kernel", [(100, False, True), (40, True, False)])
def test_broadcast_q_equals_repeated_queries(lq, causal, kv_in_kernel):
    """broadcast_q (direct tile map, several query tiles when Lq > BLOCK_M) gives the bits of the batch
    with the queries repeated per sequence; its backward's dK, dV are those bits too, and dQ is the sum
    over sequences of the repeated batch's dQ (FP32 partials, so to FP32 summation order)."""
    kv_offs = offsets_of([0, 70, 5, 129])
    batch = kv_offs.numel() - 1
    tk = int(kv_offs[-1])
    k, v = randn(tk, 2, 64, outliers=True), randn(tk, 2, 64)
    q = randn(lq, 2, 64)
    q_rep = q.repeat(batch, 1, 1)
    q_offs = offsets_of([lq] * batch)
    kw = dict(causal=causal, precision="mxfp8", p_quant="dynamic")
    o, lse = attention_forward(q, k, v, None, kv_offs, broadcast_q=True, kv_in_kernel=kv_in_kernel, config=FWD_CFG,
                               **kw)
    o_rep, lse_rep = attention_forward(q_rep, k, v, q_offs, kv_offs, config=FWD_CFG, **kw)
    assert_same((o, lse), (o_rep, lse_rep))
    do = randn(o.shape[0], 2, 64)
    bwd = dict(config=(32, 64, 1, 1), grad_dtype=torch.float32, **kw)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, None, kv_offs, broadcast_q=True, **bwd)
    dq_rep, dk_rep, dv_rep = attention_backward(do, q_rep, k, v, o, lse, q_offs, kv_offs, **bwd)
    assert_same((dk, dv), (dk_rep, dv_rep))
    torch.testing.assert_close(dq, dq_rep.view(batch, lq, 2, 64).sum(0), rtol=1e-5, atol=1e-6)
    # the atomic variant adds the same per-sequence terms in another order
    dq_at, dk_at, dv_at = attention_backward(do, q, k, v, o, lse, None, kv_offs, broadcast_q=True,
                                             bwd_variant="atomic", **bwd)
    assert_same((dk_at, dv_at), (dk, dv))
    torch.testing.assert_close(dq_at, dq, rtol=1e-5, atol=1e-6)


def test_broadcast_q_autograd_empty_batch_and_no_queries():
    """Edge cases of the partial-dQ sum: no sequence (dQ = 0) and no shared query (empty outputs)."""
    k = randn(0, 1, 64).requires_grad_()
    v = randn(0, 1, 64).requires_grad_()
    q = randn(8, 1, 64).requires_grad_()
    o = jagged_attention_triton(q, k, v, None, offsets_of([]), broadcast_q=True, precision="mxfp8")
    assert o.shape == (0, 1, 64)
    o.float().sum().backward()
    assert q.grad is None or bool((q.grad == 0).all())
    q0 = randn(0, 1, 64)
    kv_offs = offsets_of([3, 5])
    k, v = randn(8, 1, 64), randn(8, 1, 64)
    o, lse = attention_forward(q0, k, v, None, kv_offs, broadcast_q=True)
    dq, dk, dv = attention_backward(o, q0, k, v, o, lse, None, kv_offs, broadcast_q=True)
    assert dq.shape == (0, 1, 64) and bool((dk == 0).all()) and bool((dv == 0).all())


# ----------------------------------------------------------------------------- sm_90 builds


def test_sm90_builds_of_the_default_launches():
    """Every default launch (forward mxfp8 and bf16, backward, broadcast_q; the strips producer) builds for
    sm_90 on this machine and fits a program's shared memory on the H200: the benchmark's `--compile-only
    --defaults`, in a child process (under pytest on CPU the kernels are interpreted, which cannot compile)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join("benchmarks", "bench_attention.py"), "--compile-only",
                           "--defaults"], env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for kernel in ("_attn_fwd_kernel", "_operand_strips_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"):
        assert kernel in done.stdout, done.stdout[-4000:]
    assert "FAILED" not in done.stdout and "EXCEEDS" not in done.stdout, done.stdout[-4000:]
    assert "WGMMA SERIALIZED" not in done.stdout, done.stdout[-4000:]
    # the backward key-tile kernel sits at 255 registers: loads placed away from their uses, or addresses kept
    # live across its loop, make it spill (92 bytes before Δ and the store addresses were moved)
    kv = [line for line in done.stdout.splitlines() if line.lstrip().startswith("bwd mxfp8 default")
          and "_attn_bwd_kv_kernel" in line]
    assert kv and all(re.search(r"spill bytes\s+0\b", line) for line in kv), done.stdout[-4000:]


# ----------------------------------------------------------------------------- GPU: hardware casts, real lengths


def _gpu_batch(lengths, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    t = int(offs[-1])
    return [torch.randn(t, heads, dim, generator=g).bfloat16().cuda() for _ in range(3)], offs


GPU_LENGTHS = [0, 1, 31, 33, 127, 129, 500, 1023, 257, 64, 2000]


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
def test_gpu_q_in_kernel_is_bit_identical(dim, p_quant):
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 3, dim)
    q[5:9, :, :32] *= 1e-30  # a few tiny blocks
    for causal in (False, True):
        kw = dict(causal=causal, precision="mxfp8", p_quant=p_quant)
        assert_same(attention_forward(q, k, v, offs, offs, q_in_kernel=True, **kw),
                    attention_forward(q, k, v, offs, offs, q_in_kernel=False, **kw))


# ----------------------------------------------------------------------------- the strips producer


@pytest.mark.parametrize("strips", [None, (32, 8, False, 2), (64, 2, True, 2)])
def test_strips_producer_is_bit_identical(strips):
    """Every orientation (hdim, seq, square, plain BF16) over four tensors with their own offsets, FP32 and
    BF16 inputs, H = 3 (not a power of two): the same operand bytes as the blocks producer; Δ = rowsum(dO ⊙ O)
    - dLSE to FP32 summation order."""
    from gem_lp.attention.triton_attention import ORIENT_HDIM, ORIENT_NONE, ORIENT_SEQ, ORIENT_SQUARE, _operands

    q_offs, kv_offs = offsets_of([5, 0, 70, 33, 129]), offsets_of([64, 1, 0, 100, 31])
    tq, tk = int(q_offs[-1]), int(kv_offs[-1])
    q, do, o = randn(tq, 3, 64, outliers=True), randn(tq, 3, 64), randn(tq, 3, 64)
    k, v = randn(tk, 3, 64, dtype=torch.float32, outliers=True), randn(tk, 3, 64, dtype=torch.float32)
    dlse = torch.randn(tq, 3).to(DEV)
    hw = DEV.type == "cuda"
    for orients in ((ORIENT_HDIM, ORIENT_SEQ, ORIENT_NONE, ORIENT_SQUARE),
                    (ORIENT_SQUARE, ORIENT_HDIM, ORIENT_SEQ, ORIENT_HDIM)):
        specs = [(q, q_offs, orients[0], True), (k, kv_offs, orients[1], True), (v, kv_offs, orients[2], True),
                 (do, q_offs, orients[3], True)]
        want, delta_want = _operands(specs, hw_cast=hw, o=o, dlse=dlse)
        got, delta = _operands(specs, hw_cast=hw, o=o, dlse=dlse, producer="strips", strips=strips)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        torch.testing.assert_close(delta, delta_want, rtol=1e-5, atol=1e-5)
    # Δ only (no operand written), without dLSE
    (none,), delta = _operands([(do, q_offs, ORIENT_NONE, False)], hw_cast=hw, o=o, producer="strips", strips=strips)
    assert none is None
    torch.testing.assert_close(delta, (do.float() * o.float()).sum(-1), rtol=1e-5, atol=1e-5)


def test_strips_producer_head_dim_128_forward():
    """The forward with the strips producer (K hdim, V seq; Q in the producer too) equals the default's bits."""
    offs = offsets_of([45, 0, 97, 32])
    q, k, v = (randn(int(offs[-1]), 2, 128, outliers=True) for _ in range(3))
    kw = dict(causal=True, precision="mxfp8", p_quant="dynamic", config=FWD_CFG, q_in_kernel=False)
    assert_same(attention_forward(q, k, v, offs, offs, producer="strips", **kw),
                attention_forward(q, k, v, offs, offs, producer="blocks", **kw))


def test_strips_launch_checked():
    from gem_lp.attention.triton_attention import ORIENT_HDIM, _operands

    offs = offsets_of([5])
    x = randn(5, 1, 64)
    for bad, match in (((48, 8, False, 2), "rows"), ((32, 3, False, 2), "thread_rows"), ((32, 8, False, 3), "warps"),
                       ((32, 8), "rows, thread_rows")):
        with pytest.raises(ValueError, match=match):
            _operands([(x, offs, ORIENT_HDIM, True)], hw_cast=False, producer="strips", strips=bad)
    with pytest.raises(ValueError, match="producer must be one of"):
        _operands([(x, offs, ORIENT_HDIM, True)], hw_cast=False, producer="rows")


@pytest.mark.gpu
def test_gpu_kv_in_kernel_and_broadcast_q():
    (q, k, v), offs = _gpu_batch([100, 0, 2000, 37, 1023, 64] * 3, 2, 128, seed=5)
    k[3:7, :, 32:64] *= 1e-30
    for causal in (False, True):
        kw = dict(causal=causal, precision="mxfp8")
        assert_same(attention_forward(q, k, v, offs, offs, kv_in_kernel=True, **kw),
                    attention_forward(q, k, v, offs, offs, **kw))
    qb = q[:64].contiguous()
    batch = offs.numel() - 1
    o, lse = attention_forward(qb, k, v, None, offs, broadcast_q=True, kv_in_kernel=True, precision="mxfp8")
    o_rep, lse_rep = attention_forward(qb.repeat(batch, 1, 1), k, v, offsets_of([64] * batch), offs,
                                       precision="mxfp8")
    assert_same((o, lse), (o_rep, lse_rep))
    do = torch.randn_like(o)
    dq, dk, dv = attention_backward(do, qb, k, v, o, lse, None, offs, broadcast_q=True, grad_dtype=torch.float32)
    dq_at, dk_at, dv_at = attention_backward(do, qb, k, v, o, lse, None, offs, broadcast_q=True,
                                             bwd_variant="atomic", grad_dtype=torch.float32)
    assert_same((dk, dv), (dk_at, dv_at))
    torch.testing.assert_close(dq, dq_at, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_gpu_kv_tma_is_bit_identical(precision):
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 3, 128, seed=6)
    for causal in (False, True):
        for cfg in (None, (128, 128, 8, 2), (128, 64, 8, 3)):
            kw = dict(causal=causal, precision=precision, config=cfg)
            assert_same(attention_forward(q, k, v, offs, offs, kv_tma=True, **kw),
                        attention_forward(q, k, v, offs, offs, **kw))
