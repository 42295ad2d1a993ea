"""The `cute` attention backend on the GPU against the reference recipes (and the MX device helpers against the
MX reference bit for bit). sm_90 / sm_100 with the CuTe DSL stack only."""
import math

import pytest
import torch

from gem_lp.attention import jagged_attention, jagged_attention_kvpacked, jagged_attention_qkvpacked
from gem_lp.mx import dequantize, quantize_reference
from gem_lp.accuracy import sqnr_db

from cute_gpu import require_cute_gpu

pytestmark = pytest.mark.gpu
require_cute_gpu()

DEV = "cuda"
# odd lengths around the 32-token MX blocks and the kernels' 64/128-row tiles, an empty one, a long one
LENGTHS = [0, 1, 31, 33, 127, 128, 129, 300, 700]


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int64,
                        device=DEV)


def case(mode, heads, dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    if mode == "self":
        q_offs, kv_offs, lq = offsets(LENGTHS), None, sum(LENGTHS)
        tk = lq
    elif mode == "cross":  # more queries than keys in places (causal leaves rows with no key), an empty history
        ql, kl = [5, 40, 0, 3, 33, 130], [2, 70, 9, 0, 31, 257]
        q_offs, kv_offs, lq, tk = offsets(ql), offsets(kl), sum(ql), sum(kl)
    elif mode == "target":  # one query per sequence against its history
        q_offs, kv_offs, lq, tk = offsets([1] * len(LENGTHS)), offsets(LENGTHS), len(LENGTHS), sum(LENGTHS)
    elif mode.startswith("broadcast"):
        lq = int(mode[len("broadcast"):])
        q_offs, kv_offs, tk = None, offsets(LENGTHS), sum(LENGTHS)
    else:
        raise ValueError(mode)
    q = torch.randn(lq, heads, dim, generator=g, device=DEV)
    k = torch.randn(tk, heads, dim, generator=g, device=DEV)
    v = torch.randn(tk, heads, dim, generator=g, device=DEV)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, q_offs, kv_offs, mode.startswith("broadcast")


def run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse=None, **kw):
    o, lse = jagged_attention(q, k, v, q_offs, kv_offs, broadcast_q=bq, return_lse=True, **kw)
    loss = (o.float() * d_out).sum()
    if d_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * d_lse).sum()
    return (o, lse) + torch.autograd.grad(loss, (q, k, v))


NAMES = ("O", "LSE", "dQ", "dK", "dV")


def compare(got, want, floor_db, what):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape, a.dtype, b.dtype)
        if name == "LSE":
            fin = torch.isfinite(b)
            assert torch.equal(fin, torch.isfinite(a)), (what, "LSE -inf rows")
            torch.testing.assert_close(a[fin], b[fin], rtol=0, atol=2e-3, msg=f"{what} LSE")
            continue
        assert torch.isfinite(a.float()).all(), (what, name)
        s = sqnr_db(a, b)
        print(f"{what} {name}: {s:.1f} dB")
        assert s > floor_db, (what, name, s)


@pytest.mark.parametrize("mode", ["self", "cross", "target", "broadcast4", "broadcast64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
def test_mxfp8_matches_reference_recipe(mode, causal, dim, p_quant):
    """The kernels round the reference's values: agreement to FP32 summation order (>= 35 dB; most tensors
    land far above), and the recipe's accuracy against FP32."""
    q, k, v, q_offs, kv_offs, bq = case(mode, heads=3, dim=dim, seed=dim + causal)
    t_out = q.shape[0] * (kv_offs.numel() - 1) if bq else q.shape[0]
    d_out = torch.randn(t_out, 3, dim, device=DEV)
    d_lse = torch.randn(t_out, 3, device=DEV)
    kw = dict(causal=causal, precision="mxfp8", p_quant=p_quant)
    got = run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse, backend="cute", **kw)
    want = run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse, backend="reference", **kw)
    compare(got, want, 35.0, f"{mode} causal={causal} D={dim} {p_quant}")
    exact = run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse, backend="reference", causal=causal, precision="fp32")
    for name, a, b in zip(NAMES, got, exact):
        if name not in ("LSE",) and not (name in ("dQ", "dK") and mode != "self"):
            assert sqnr_db(a, b) > 20, (name, sqnr_db(a, b))


@pytest.mark.parametrize("mode", ["self", "cross", "target", "broadcast4"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bf16_matches_reference(mode, causal, dtype):
    """bf16: FlashAttention-4 against the reference bf16 recipe (the same roundings up to where the max sits)."""
    q, k, v, q_offs, kv_offs, bq = case(mode, heads=2, dim=128, dtype=dtype, seed=3)
    t_out = q.shape[0] * (kv_offs.numel() - 1) if bq else q.shape[0]
    d_out = torch.randn(t_out, 2, 128, device=DEV)
    d_lse = torch.randn(t_out, 2, device=DEV)
    kw = dict(causal=causal, precision="bf16")
    got = run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse, backend="cute", **kw)
    want = run(q, k, v, q_offs, kv_offs, bq, d_out, d_lse, backend="reference", **kw)
    compare(got, want, 35.0, f"bf16 {mode} causal={causal} {dtype}")


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_views_of_a_fused_projection(precision, causal):
    """q, k, v as the model hands them: views into one `[T, 3, H, D]` projection output (token rows 3 H D apart),
    read in place; the outputs and the projection's gradient as with contiguous copies, against the reference."""
    g = torch.Generator(device=DEV).manual_seed(11)
    t, offs = sum(LENGTHS), offsets(LENGTHS)
    qkv = torch.randn(t, 3, 2, 128, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    d_out = torch.randn(t, 2, 128, generator=g, device=DEV)
    results = {}
    for backend in ("cute", "reference"):
        q, k, v = qkv.unbind(1)
        o = jagged_attention(q, k, v, offs, causal=causal, precision=precision, backend=backend)
        (d_qkv,) = torch.autograd.grad((o.float() * d_out).sum(), qkv)
        results[backend] = (o, d_qkv)
    for name, a, b in zip(("O", "dQKV"), results["cute"], results["reference"]):
        s = sqnr_db(a, b)
        assert s > 35.0, (precision, causal, name, s)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("packing", ["qkv", "kv", "kv broadcast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_forms_equal_the_views(precision, packing, dtype):
    """The packed forms, whose kernels write dQ, dK, dV into one gradient tensor (the cast path for FP32), against
    `jagged_attention` on the same views: O equal, gradients to the backward's FP32 atomics order."""
    g = torch.Generator(device=DEV).manual_seed(17)
    t, offs = sum(LENGTHS), offsets(LENGTHS)
    b = len(LENGTHS)
    packed = torch.randn(t, 3 if packing == "qkv" else 2, 2, 128, generator=g, device=DEV).to(dtype).requires_grad_()
    broadcast = packing == "kv broadcast"
    q = torch.randn(4 if broadcast else 2 * b, 2, 128, generator=g, device=DEV).to(dtype).requires_grad_()
    q_offs = None if broadcast else torch.arange(0, 2 * b + 1, 2, device=DEV)
    kw = dict(precision=precision, backend="cute", return_lse=True)
    if packing == "qkv":
        got = jagged_attention_qkvpacked(packed, offs, causal=True, **kw)
        want = jagged_attention(*packed.unbind(1), offs, causal=True, **kw)
        inputs = (packed,)
    else:
        got = jagged_attention_kvpacked(q, packed, q_offs, offs, broadcast_q=broadcast, **kw)
        want = jagged_attention(q, *packed.unbind(1), q_offs, offs, broadcast_q=broadcast, **kw)
        inputs = (q, packed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    d_out = torch.randn(got[0].shape, generator=g, device=DEV)
    grads = [torch.autograd.grad((o[0].float() * d_out).sum(), inputs) for o in (got, want)]
    for a, w in zip(*grads):
        assert a.shape == w.shape and a.dtype == w.dtype
        assert sqnr_db(a, w) > 60, (precision, packing, dtype, sqnr_db(a, w))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_empty_batches(precision):
    for lengths in ([], [0, 0, 0]):
        offs = offsets(lengths)
        q = torch.zeros(0, 2, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        o, lse = jagged_attention(q, q, q, offs, precision=precision, backend="cute", return_lse=True)
        assert o.shape == (0, 2, 64) and lse.shape == (0, 2)
        o.float().sum().backward()
        assert q.grad.shape == q.shape


def test_auto_picks_cute():
    q, k, v, q_offs, kv_offs, bq = case("self", heads=1, dim=64)
    a = jagged_attention(q, k, v, q_offs, precision="mxfp8")
    b = jagged_attention(q, k, v, q_offs, precision="mxfp8", backend="cute")
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- device helpers, bit for bit


def _rows(n, lo, hi, signed, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mag = torch.exp2(torch.empty(n, 32, device=DEV).uniform_(lo, hi, generator=g))
    if signed:
        mag = torch.where(torch.rand(n, 32, device=DEV, generator=g) < 0.5, -mag, mag)
    # zeros, a whole-zero row, and exact E4M3 ties
    mag[:, 5] = 0.0
    mag[3] = 0.0
    return mag


@pytest.mark.parametrize("mode", ["const_p", "e4m3"])
def test_probe_fixed_scale_bits(mode):
    """P with const_p's fixed scale: e4m3(256 p) 2^-8 (`const_p`), or the payload e4m3(x) itself."""
    from cute_probe import run_probe

    from gem_lp.attention.reference import const_p

    x = _rows(4096, -30, 0, signed=False, seed=1).clamp(max=1.0)
    x[7] = torch.arange(32, device=DEV) / 31  # includes p = 1 and p = 0
    if mode != "const_p":
        x = x * 256  # the payload 256 p
    y, sums = run_probe(x, mode)
    want = const_p(x) if mode == "const_p" else const_p(x / 256) * 256
    assert torch.equal(y.float(), want)
    torch.testing.assert_close(sums, want.sum(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["block_signed", "block_p"])
def test_probe_block_bits(mode):
    from cute_probe import run_probe

    signed = mode == "block_signed"  # block_p: P's non-negative blocks
    lo, hi = (-100, 100) if signed else (-60, 0)
    x = _rows(4096, lo, hi, signed=signed, seed=2)
    if signed:
        x[11, 3] = float("nan")
        x[12, 9] = float("inf")
    y, _ = run_probe(x, mode)
    want = dequantize(quantize_reference(x, axis=-1))
    nan_rows = torch.isnan(want).any(-1)
    assert torch.isnan(y[nan_rows].float()).all()
    # BF16 holds every MX value whose block byte is at least 3 (values >= 2^-133)
    ok = ~nan_rows & (want.abs().amax(-1) > 2.0**-100)
    assert torch.equal(y[ok].float(), want[ok])
