"""`qk_rotation="hadamard"`: the matrix, exactness against no rotation, gradients, errors, and its accuracy gain."""
import math

import pytest
import torch

from gem_lp.attention import attention_reference, jagged_attention, make_plan
from gem_lp.rotation import hadamard_matrix, hadamard_transform, rotate_qk
from gem_lp.accuracy import sqnr_db


def offsets(lengths):
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


@pytest.mark.parametrize("dim", [1, 2, 32, 64, 128])
def test_matrix_is_orthonormal_symmetric_walsh_hadamard(dim):
    h = hadamard_matrix(dim, torch.float64)
    assert h.shape == (dim, dim)
    torch.testing.assert_close(h @ h.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((dim, dim), 1 / math.sqrt(dim), dtype=torch.float64))
    if dim >= 2:  # Sylvester's construction: H_2n = [[H_n, H_n], [H_n, -H_n]]
        half = hadamard_matrix(dim // 2, torch.float64) / math.sqrt(2)
        torch.testing.assert_close(h, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0))


def test_transform_spreads_an_outlier_channel_and_keeps_dtype():
    x = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    x[..., 9] = 16.0
    y = hadamard_transform(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y.abs(), torch.full_like(y, 2.0))  # 16 / sqrt(64) in every channel
    with torch.autocast("cpu", dtype=torch.bfloat16):  # FP32 math whatever autocast says
        assert hadamard_transform(torch.ones(1, 64)).dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp32", "bf16", "mxfp8"])
def test_qk_unchanged_in_exact_arithmetic(precision):
    """Rotated and plain attention agree to FP32 rounding under the fp32 recipe; the other recipes round the
    rotated operands, so they agree to their own accuracy."""
    g = torch.Generator().manual_seed(0)
    offs = offsets([40, 1, 70])
    q, k, v = (torch.randn(111, 2, 64, generator=g).requires_grad_() for _ in range(3))
    d_out = torch.randn(111, 2, 64, generator=g)
    results = []
    for rotation in (None, "hadamard"):
        o, lse = jagged_attention(q, k, v, offs, causal=True, precision=precision, qk_rotation=rotation,
                                  return_lse=True)
        results.append([o, lse, *torch.autograd.grad((o * d_out).sum(), (q, k, v))])
    if precision == "fp32":
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    else:
        floor = 40 if precision == "bf16" else 20
        for a, b in zip(*results):
            assert sqnr_db(a, b) > floor


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_fp64_through_rotation_and_reference(causal):
    """d/dq, d/dk through the rotation (autograd) and the fp32 recipe's backward, against finite differences;
    LSE's gradient included."""
    g = torch.Generator().manual_seed(1)
    offs = offsets([3, 1, 5])
    q, k, v = (torch.randn(9, 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    plan = make_plan(offs, offs, broadcast_q=False, q_len=9, heads=1)

    def fn(a, b, c):
        a, b = rotate_qk(a, b, "hadamard")
        return attention_reference(a, b, c, plan, causal=causal, precision="fp32", scale=0.7)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_broadcast_q_and_empty_sequences():
    g = torch.Generator().manual_seed(2)
    kv_offs = offsets([0, 33, 5])
    q = torch.randn(4, 2, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(38, 2, 32, generator=g) for _ in range(2))
    plain = jagged_attention(q, k, v, None, kv_offs, broadcast_q=True, precision="fp32")
    rotated = jagged_attention(q, k, v, None, kv_offs, broadcast_q=True, precision="fp32", qk_rotation="hadamard")
    torch.testing.assert_close(rotated, plain, rtol=2e-5, atol=2e-5)
    assert torch.all(rotated[:4] == 0)  # the empty sequence: no visible key


def test_errors():
    q = torch.randn(10, 2, 48)
    offs = offsets([10])
    with pytest.raises(ValueError, match=r"qk_rotation='hadamard' needs a head dim that is a power of two.*D=48"):
        jagged_attention(q, q, q, offs, precision="fp32", qk_rotation="hadamard")
    with pytest.raises(ValueError, match=r"D=96"):
        jagged_attention(*(torch.randn(10, 2, 96) for _ in range(3)), offs, precision="mxfp8", qk_rotation="hadamard")
    with pytest.raises(ValueError, match="qk_rotation must be None or 'hadamard', got 'givens'"):
        jagged_attention(q, q, q, offs, qk_rotation="givens")
    with pytest.raises(ValueError, match="qk_rotation must be None or 'hadamard', got 'none'"):
        jagged_attention(q, q, q, offs, qk_rotation="none")


@pytest.mark.parametrize("dim", [64, 128])
def test_hadamard_recovers_mxfp8_on_shared_outlier_channels(dim):
    """Q and K with two shared channels x20 (logits dominated by their products): the rotation takes O and dV
    from ~10-12 dB to >= 20 dB (D = 64 and 128, causal and not)."""
    from gem_lp.attention.error_budget import INPUT_KINDS, attention_with_grads, make_inputs

    kind = next(k for k in INPUT_KINDS if k.name == "channels x20")
    q, k, v, d_out, offs = make_inputs(kind, dim=dim, seed=1)
    for causal in (False, True):
        ref = attention_with_grads(*(t.double() for t in (q, k, v, d_out)), offs, causal=causal, precision="fp32")
        plain = attention_with_grads(q, k, v, d_out, offs, causal=causal, precision="mxfp8")
        rotated = attention_with_grads(q, k, v, d_out, offs, causal=causal, precision="mxfp8", qk_rotation="hadamard")
        for i in (0, 3):  # O, dV
            assert sqnr_db(plain[i], ref[i]) < 15
            assert sqnr_db(rotated[i], ref[i]) > 20
