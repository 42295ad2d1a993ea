"""Speed variants of the Triton attention kernels give the same bits as the paths they replace.

* `q_in_kernel`: Q rounded to its operand in the forward kernel's prologue, or in the producer pass.

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
