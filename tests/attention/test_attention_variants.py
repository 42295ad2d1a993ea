"""Speed variants of the Triton attention kernels give the same bits as the paths they replace.

* `q_in_kernel`: Q rounded to its operand in the forward kernel's prologue, or in the producer pass.
* `producer="strips"`: the producer pass in thread strips, or in 32-token blocks of 4 heads.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) on tiny shapes; the `gpu` tests repeat
the checks with the hardware E4M3 conversion on realistic lengths.
"""
from __future__ import annotations

import pytest
import torch

from gem_lp.attention.triton_attention import attention_forward

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


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)), (x.float() - y.float()).abs().max()


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
    q = randn(int(q_offs[-1]), 2, dim, dtype, outliers=True)
    k, v = randn(int(kv_offs[-1]), 2, dim, dtype), randn(int(kv_offs[-1]), 2, dim, dtype)
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
