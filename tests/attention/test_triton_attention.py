"""Triton jagged attention against the reference recipe (same precision) and against a tile model of the kernel.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) on tiny shapes. Tolerances, stated:

* Forward vs a plain-PyTorch model of the kernel's own tile walk (`tile_model_forward`: online softmax
  over BLOCK_N-key tiles, P rounded relative to the running max): the same arithmetic up to FP32
  summation order, so O to within one output rounding (2^-8 relative + 1e-5) on at least 99% of the
  elements (a P element at a rounding midpoint may flip), LSE to 1e-5.
* Forward vs `reference.py`: the reference rounds p relative to the final row max, so each P element
  may round differently, by at most |P_k - P_r| <= 2u p + 2a (E4M3 u = 2^-4, a = 2^-18; BF16 u = 2^-8,
  a = 0) and |O_k - O_r| <= (2u Σ p|v| + 2a Σ|v|) / l + output rounding, checked per element. LSE to 1e-5.
* Backward vs `reference.py` given the same O and LSE: the same rounding points, so agreement up to FP32
  summation order: relative Frobenius error <= 2^-10, elementwise <= 2^-7 |ref| + 2^-10 max|ref|.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from gem_lp.attention import jagged_attention
from gem_lp.attention.reference import mx_hdim, mx_seq
from gem_lp.attention.triton_attention import (
    FWD_CONFIGS,
    _grid_round,
    _mx_round_rows_fast,
    _mx_round_square_fast,
    attention_backward,
    attention_forward,
    jagged_attention_triton,
)
from gem_lp.mx import dequantize, quantize_reference
from gem_lp.numerics import cosine, sqnr_db

LOG2E = 1.4426950408889634
LENGTHS = [0, 1, 31, 33, 127, 129]
FWD_CFG = (64, 32, 1, 1)  # BLOCK_M, BLOCK_N, warps, stages: several tiles per sequence on these lengths
BWD_CFG = (32, 64, 1, 1)


# The same tests run the kernels on a GPU when there is one (hardware casts, compiled kernels), else in
# Triton's interpreter on the CPU.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offsets_of(lengths) -> torch.Tensor:
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offs.to(DEV)


def randn(rows: int, heads: int, dim: int, dtype=torch.bfloat16, outliers: bool = False) -> torch.Tensor:
    x = torch.randn(rows, heads, dim)
    if outliers:  # a few channels x20, as activations with outlier features have
        x[:, :, torch.randperm(dim)[:3]] *= 20.0
    return x.to(dtype).to(DEV)


def reference(q, k, v, q_offs, kv_offs=None, **kw):
    return jagged_attention(q, k, v, q_offs, kv_offs, backend="reference", return_lse=True, **kw)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- the kernel's tile walk


def _round_p_model(p: torch.Tensor, precision: str, p_quant: str, dtype: torch.dtype) -> torch.Tensor:
    """P as the kernel's P.V operand; const_p returns 256 p rounded (the kernel divides by 256 at the end)."""
    if precision == "bf16":
        return p.to(dtype).float()
    if p_quant == "const_p":
        return (256.0 * p).to(torch.float8_e4m3fn).float()
    return mx_hdim(p)  # 1x32 blocks along kv; the tile starts at a multiple of 32 from the sequence start


def tile_model_forward(q, k, v, q_offs, kv_offs, *, causal, broadcast_q, precision, p_quant, block_n):
    """O (FP32) and LSE of the kernel's algorithm in plain PyTorch: per sequence, KV tiles of block_n keys."""
    q, k, v, q_offs, kv_offs = (None if x is None else x.cpu() for x in (q, k, v, q_offs, kv_offs))
    heads, dim = q.shape[1], q.shape[2]
    c = LOG2E / math.sqrt(dim)
    op16 = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    batch = kv_offs.numel() - 1
    outs, lses = [], []
    for b in range(batch):
        qb = q if broadcast_q else q[q_offs[b]:q_offs[b + 1]]
        kb, vb = k[kv_offs[b]:kv_offs[b + 1]], v[kv_offs[b]:kv_offs[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        pad = (-lk) % 32
        qh, kh, vh = (x.float().transpose(0, 1) for x in (qb, kb, vb))  # [H, L, D]
        if precision == "mxfp8":
            qh, kh = mx_hdim(qh), mx_hdim(kh)
            vh = mx_seq(torch.nn.functional.pad(vh, (0, 0, 0, pad)))[:, :lk] if lk else vh
        else:
            qh, kh, vh = (x.to(op16).float() for x in (qh, kh, vh))
        m = torch.full((heads, lq), -math.inf)
        l = torch.zeros(heads, lq)
        acc = torch.zeros(heads, lq, dim)
        i = torch.arange(lq)[:, None]
        for start in range(0, lk, block_n):
            j = torch.arange(start, min(start + block_n, lk))
            s = (qh @ kh[:, j].transpose(1, 2)) * c
            if causal:
                s = s.masked_fill(~(j[None, :] <= i + (lk - lq)), -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            p = torch.exp2(s - m_safe[..., None])
            alpha = torch.exp2(m - m_safe)
            l = l * alpha + p.sum(-1)
            width = j.numel()
            p_full = torch.nn.functional.pad(p, (0, (-width) % 32))
            pq = _round_p_model(p_full, precision, p_quant, op16)[..., :width]
            acc = acc * alpha[..., None] + pq @ vh[:, j]
            m = m_new
        empty = l == 0
        denom = torch.where(empty, 1.0, l)
        lse = torch.where(empty, -math.inf, (m + torch.log2(denom)) * math.log(2))
        if precision == "mxfp8" and p_quant == "const_p":
            denom = denom * 256.0
        outs.append((acc / denom[..., None]).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def output_bound(q, k, v, q_offs, kv_offs, o_ref, o_ker, *, causal, broadcast_q, precision):
    """Per-element bound on |O_kernel - O_reference| of the module docstring."""
    q, k, v, q_offs, kv_offs, o_ref, o_ker = (None if x is None else x.cpu()
                                              for x in (q, k, v, q_offs, kv_offs, o_ref, o_ker))
    u, a = (2.0**-4, 2.0**-18) if precision == "mxfp8" else (2.0**-8, 0.0)
    u += 2.0**-20  # FP32 exp2 / summation slack
    dim = q.shape[2]
    bounds = []
    for b in range(kv_offs.numel() - 1):
        qb = q if broadcast_q else q[q_offs[b]:q_offs[b + 1]]
        kb, vb = k[kv_offs[b]:kv_offs[b + 1]], v[kv_offs[b]:kv_offs[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        if lq == 0 or lk == 0:
            bounds.append(torch.zeros(lq, q.shape[1], dim))
            continue
        qh, kh, vh = (x.float().transpose(0, 1) for x in (qb, kb, vb))
        if precision == "mxfp8":
            pad = (-lk) % 32
            qh, kh = mx_hdim(qh), mx_hdim(kh)
            vh = mx_seq(torch.nn.functional.pad(vh, (0, 0, 0, pad)))[:, :lk] if lk else vh
        s = qh @ kh.transpose(1, 2) / math.sqrt(dim)
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        s = s.masked_fill(~visible, -math.inf)
        mx = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(mx == -math.inf, 0.0, mx))
        l = p.sum(-1, keepdim=True)
        av = vh.abs()
        num = 2 * u * (p @ av) + 2 * a * (visible.float() @ av)
        bounds.append((num / torch.where(l == 0, 1.0, l)).transpose(0, 1))
    bound = torch.cat(bounds)
    return bound + 2.0**-8 * torch.maximum(o_ref.float().abs(), o_ker.float().abs()) + 1e-5


def check_forward(q, k, v, q_offs, kv_offs=None, *, causal=False, broadcast_q=False, precision="mxfp8",
                  p_quant="const_p", config=FWD_CFG, **kw):
    kv = q_offs if kv_offs is None else kv_offs
    o, lse = attention_forward(q, k, v, q_offs, kv, causal=causal, broadcast_q=broadcast_q, precision=precision,
                               p_quant=p_quant, config=config, **kw)
    o_ref, lse_ref = reference(q, k, v, None if broadcast_q else q_offs, kv, causal=causal,
                               broadcast_q=broadcast_q, precision=precision, p_quant=p_quant)
    assert o.dtype == q.dtype and o.shape == o_ref.shape and lse.dtype == torch.float32
    # LSE: unquantized in both; -inf exactly where a query sees no key
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin].float(), rtol=0, atol=1e-5)
    # tight: the kernel's own tile walk
    o_model, lse_model = tile_model_forward(q, k, v, q_offs, kv, causal=causal, broadcast_q=broadcast_q,
                                            precision=precision, p_quant=p_quant, block_n=config[1])
    # (a P element next to a rounding midpoint may round the other way under another FP32 summation
    # order, moving its row by one rounding step; such rows stay inside the reference bound below)
    off = (o.float().cpu() - o_model).abs() > 2.0**-8 * o_model.abs() + 1e-5
    assert off.float().mean().item() <= 0.01, f"{off.sum().item()} of {off.numel()} elements off the tile model"
    torch.testing.assert_close(lse[fin].cpu(), lse_model[fin.cpu()], rtol=0, atol=1e-5)
    # stated bound against the reference
    bound = output_bound(q, k, v, q_offs, kv, o_ref, o, causal=causal, broadcast_q=broadcast_q, precision=precision)
    err = (o.float() - o_ref.float()).abs().cpu()
    assert bool((err <= bound).all()), f"max excess over the bound {(err - bound).max().item()}"
    return o, lse, o_ref, lse_ref


def check_backward(q, k, v, q_offs, kv_offs=None, *, causal=False, broadcast_q=False, precision="mxfp8",
                   p_quant="const_p", with_dlse=False, config=BWD_CFG, **kw):
    """Kernel backward vs the reference's, both given the reference's O and LSE (and the same dO, dLSE)."""
    kv = q_offs if kv_offs is None else kv_offs
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, None if broadcast_q else q_offs, kv, causal=causal,
                               broadcast_q=broadcast_q, precision=precision, p_quant=p_quant)
    do = torch.randn(o_ref.shape).to(q.dtype).to(DEV)
    dlse = torch.randn(lse_ref.shape).to(DEV) if with_dlse else None
    loss = (o_ref.float() * do.float()).sum()
    if with_dlse:
        loss = loss + torch.where(torch.isfinite(lse_ref), lse_ref * dlse, 0.0).sum()
    loss.backward()
    dq, dk, dv = attention_backward(do, q, k, v, o_ref.detach(), lse_ref.detach().float(), q_offs, kv,
                                    causal=causal, broadcast_q=broadcast_q, precision=precision, p_quant=p_quant,
                                    dlse=dlse, config=config, **kw)
    for name, out, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        assert rel_err(out, ref) <= 2.0**-10, f"{name}: relative error {rel_err(out, ref)}"
        tol = 2.0**-7 * ref.float().abs() + 2.0**-10 * ref.float().abs().max()
        assert bool(((out.float() - ref.float()).abs() <= tol).all()), name
    return dq, dk, dv


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("precision,p_quant,causal", [
    ("mxfp8", "const_p", False),
    ("mxfp8", "dynamic", True),
    ("mxfp8", "dynamic", False),
    ("bf16", "const_p", True),
])
def test_forward_mixed_lengths(precision, p_quant, causal):
    offs = offsets_of(LENGTHS)
    t = int(offs[-1])
    q, k, v = (randn(t, 2, 64) for _ in range(3))
    check_forward(q, k, v, offs, causal=causal, precision=precision, p_quant=p_quant)


def test_forward_head_dim_128_outliers_and_block_sizes():
    offs = offsets_of([45, 0, 97])
    t = int(offs[-1])
    q, k, v = (randn(t, 1, 128, outliers=True) for _ in range(3))
    check_forward(q, k, v, offs, causal=True, p_quant="const_p", config=(32, 64, 1, 1))


def test_forward_broadcast_q():
    kv_offs = offsets_of([0, 70, 5, 33])
    t = int(kv_offs[-1])
    k, v = randn(t, 2, 64), randn(t, 2, 64)
    for lq, causal in ((4, False), (64, True)):
        q = randn(lq, 2, 64)
        o, lse, _, _ = check_forward(q, k, v, None, kv_offs, broadcast_q=True, causal=causal, p_quant="dynamic")
        assert o.shape == (4 * lq, 2, 64)


def test_forward_target_and_cross_attention():
    kv_offs = offsets_of([40, 0, 129, 7])
    t = int(kv_offs[-1])
    k, v = randn(t, 2, 64), randn(t, 2, 64)
    # target attention: one query per sequence (causal, bottom-right: it sees every key)
    q_offs = offsets_of([1, 1, 1, 1])
    q = randn(4, 2, 64)
    check_forward(q, k, v, q_offs, kv_offs, causal=True)
    # cross-attention with Lq > Lk: the first queries of sequence 3 see no key (O = 0, LSE = -inf)
    q_offs = offsets_of([33, 2, 60, 12])
    q = randn(int(q_offs[-1]), 2, 64)
    o, lse, _, _ = check_forward(q, k, v, q_offs, kv_offs, causal=True, p_quant="dynamic")
    rows = slice(int(q_offs[3]), int(q_offs[3]) + 5)
    assert bool((o[rows] == 0).all()) and bool(torch.isneginf(lse[rows]).all())
    assert bool((o[int(q_offs[1]):int(q_offs[2])] == 0).all())  # a sequence without keys


def test_forward_input_dtypes():
    offs = offsets_of([31, 65])
    t = int(offs[-1])
    q, k, v = (randn(t, 1, 64, dtype=torch.float32) for _ in range(3))
    check_forward(q, k, v, offs, precision="mxfp8")
    check_forward(q, k, v, offs, precision="bf16")  # FP32 inputs: BF16 operands
    q, k, v = (x.half() for x in (q, k, v))
    check_forward(q, k, v, offs, precision="bf16", causal=True)  # FP16 operands and P


def test_forward_variants_match_producer():
    """The in-loop dequantization reads the same MX values (bit-equal O); FP8 QK^T per 32-chunk with
    promotion sums the same exact products in another order (O to within one output rounding)."""
    offs = offsets_of([0, 37, 100])
    t = int(offs[-1])
    for dim in (64, 128):
        q, k, v = (randn(t, 2, dim) for _ in range(3))
        o, lse = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", config=FWD_CFG)
        o_loop, lse_loop = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8",
                                             variant="dequant_in_loop", config=FWD_CFG)
        assert torch.equal(o_loop, o) and torch.equal(lse_loop, lse)
        o_fp8, lse_fp8 = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", variant="fp8_qk",
                                           config=FWD_CFG)
        torch.testing.assert_close(o_fp8.float(), o.float(), rtol=2.0**-7, atol=1e-5)
        torch.testing.assert_close(lse_fp8, lse, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("precision,p_quant,causal", [
    ("mxfp8", "const_p", False),
    ("mxfp8", "dynamic", True),
    ("bf16", "const_p", True),
])
def test_backward_mixed_lengths(precision, p_quant, causal):
    offs = offsets_of(LENGTHS)
    t = int(offs[-1])
    q, k, v = (randn(t, 2, 64) for _ in range(3))
    check_backward(q, k, v, offs, causal=causal, precision=precision, p_quant=p_quant, with_dlse=causal)


def test_backward_head_dim_128_broadcast_q_and_cross():
    kv_offs = offsets_of([70, 0, 33])
    t = int(kv_offs[-1])
    k, v = randn(t, 1, 128, outliers=True), randn(t, 1, 128)
    q = randn(40, 1, 128)
    dq, _, _ = check_backward(q, k, v, None, kv_offs, broadcast_q=True, causal=True, p_quant="dynamic")
    assert dq.shape == q.shape  # summed over the batch
    q_offs = offsets_of([1, 3, 50])  # target-like and Lq > Lk cross-attention
    q = randn(int(q_offs[-1]), 1, 128)
    check_backward(q, k, v, q_offs, kv_offs, causal=True, config=(64, 32, 1, 1))


def test_backward_variants_and_fp16_dq_accumulation():
    """dQ by atomics (FP32 buffer) equals the split kernels' dQ up to summation order; the FP16 buffer with a
    static scale rounds each partial sum to FP16; dK and dV never depend on the dQ variant."""
    offs = offsets_of([50, 0, 97])
    t = int(offs[-1])
    q, k, v = (randn(t, 2, 64) for _ in range(3))
    o, lse = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", config=FWD_CFG)
    do = randn(t, 2, 64)
    args = (do, q, k, v, o, lse, offs, offs)
    kw = dict(causal=True, precision="mxfp8", config=BWD_CFG, grad_dtype=torch.float32)
    dq, dk, dv = attention_backward(*args, **kw)
    dq32, dk32, dv32 = attention_backward(*args, bwd_variant="atomic", **kw)
    dq16, dk16, dv16 = attention_backward(*args, bwd_variant="atomic", dq_accum="fp16", dq_static_scale=2.0**6, **kw)
    assert torch.equal(dk32, dk) and torch.equal(dv32, dv) and torch.equal(dk16, dk) and torch.equal(dv16, dv)
    assert rel_err(dq32, dq) < 1e-5
    torch.testing.assert_close(dq16, dq32, rtol=2.0**-8, atol=2.0**-8 * dq32.abs().max().item())
    assert not torch.equal(dq16, dq32)  # the FP16 buffer really is FP16


def test_backward_mxfp8_grad_format_matches_quantize_jagged():
    """dK, dV emitted by the epilogue as square MXFP8 equal `quantize_jagged_reference` of the dense FP32
    gradients of the same kernel (payload and both blocked scale forms, bit for bit)."""
    from gem_lp.jagged import JaggedLayout, quantize_jagged_reference

    offs = offsets_of([0, 33, 70, 5])
    t = int(offs[-1])
    for dim in (64, 128):
        q, k, v = (randn(t, 1, dim) for _ in range(3))
        o, lse = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", config=FWD_CFG)
        do = randn(t, 1, dim)
        args = (do, q, k, v, o, lse, offs, offs)
        _, dk, dv = attention_backward(*args, causal=True, config=BWD_CFG, grad_dtype=torch.float32)
        _, dk_mx, dv_mx = attention_backward(*args, causal=True, config=BWD_CFG, grad_format="mxfp8")
        assert dk_mx.orientations == ("square",)
        layout = JaggedLayout.from_offsets(offs, k)
        for dense, got in ((dk, dk_mx), (dv, dv_mx)):
            want = quantize_jagged_reference(dense, layout, ("square",), "rceil")
            assert torch.equal(got.payload_square.view(torch.uint8), want.payload_square.view(torch.uint8))
            assert torch.equal(got.scale_square_hdim, want.scale_square_hdim)
            assert torch.equal(got.scale_square_seq, want.scale_square_seq)


# ----------------------------------------------------------------------------- producer pass


def _per_sequence(x: torch.Tensor, offs: torch.Tensor, fn) -> torch.Tensor:
    """Apply `fn` to each sequence of `x [T, H, D]` as `[H, L padded to 32, D]` (zeros never raise a max)."""
    out = torch.empty(x.shape)
    o = offs.tolist()
    for s, e in zip(o[:-1], o[1:]):
        if e > s:
            xs = torch.nn.functional.pad(x[s:e].float().cpu().transpose(0, 1), (0, 0, 0, (-(e - s)) % 32))
            out[s:e] = fn(xs)[:, : e - s].transpose(0, 1)
    return out


def test_producer_pass_matches_reference_quantization():
    """One launch over four tensors with their own offsets: hdim, seq, square and plain BF16 rounding, and
    Δ = rowsum(dO ⊙ O) - dLSE of the rounded dO on the last; heads in groups with a partial last group (H = 6)."""
    from gem_lp.attention.reference import mx_square
    from gem_lp.attention.triton_attention import ORIENT_HDIM, ORIENT_NONE, ORIENT_SEQ, ORIENT_SQUARE, _operands

    q_offs, kv_offs = offsets_of([5, 0, 70, 33]), offsets_of([64, 1, 0, 100])
    q, do = randn(int(q_offs[-1]), 6, 64, outliers=True), randn(int(q_offs[-1]), 6, 64)
    k, v = randn(int(kv_offs[-1]), 6, 64, dtype=torch.float32), randn(int(kv_offs[-1]), 6, 64)
    o = randn(int(q_offs[-1]), 6, 64)
    dlse = torch.randn(int(q_offs[-1]), 6).to(DEV)
    (q_h, k_s, v_q, do_sq), delta = _operands(
        [(q, q_offs, ORIENT_HDIM, True), (k, kv_offs, ORIENT_SEQ, True), (v, kv_offs, ORIENT_NONE, True),
         (do, q_offs, ORIENT_SQUARE, True)], hw_cast=DEV.type == "cuda", o=o, dlse=dlse)
    assert torch.equal(q_h.float().cpu(), _per_sequence(q, q_offs, mx_hdim))
    assert torch.equal(k_s.float().cpu(), _per_sequence(k, kv_offs, mx_seq))
    assert torch.equal(v_q.cpu(), v.cpu())  # already BF16: rounding is the identity
    assert torch.equal(do_sq.float().cpu(), _per_sequence(do, q_offs, mx_square))
    want = (do_sq.float() * o.float()).sum(-1) - dlse  # the dO that dP = dO V^T uses
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)
    (k_bf16,), _ = _operands([(k, kv_offs, ORIENT_NONE, True)], hw_cast=False)
    assert torch.equal(k_bf16, k.bfloat16())  # round to nearest even


# ----------------------------------------------------------------------------- the in-register MX rounding


@triton.jit
def _grid_round_kernel(x_ptr, byte_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _grid_round(tl.load(x_ptr + i), tl.load(byte_ptr + i)))


@triton.jit
def _block_round_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, SQUARE: tl.constexpr):
    i = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    if SQUARE:
        tl.store(out_ptr + i, _mx_round_square_fast(tl.load(x_ptr + i), R, C, False))
    else:
        tl.store(out_ptr + i, _mx_round_rows_fast(tl.load(x_ptr + i), R, C, False))


def test_grid_rounding_is_exact_at_every_e4m3_midpoint():
    """`_grid_round` (magic-number addition) equals the reference's quantize-dequantize on every E4M3 value,
    every midpoint between neighbours (ties to even), one FP32 ulp either side, and across scales that
    put the values in the subnormal range; `_mx_round_square_fast` equals the reference on 32x32 blocks."""
    from gem_lp.mx.reference import encode_payload, scale_f32

    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    base = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    base = torch.cat([base, -base])
    for byte in (8, 9, 20, 119, 127, 140, 217):  # `_grid_round`'s range; the callers fall back outside it
        x = base * scale_f32(torch.tensor(byte, dtype=torch.uint8))
        b = torch.full(x.shape, byte, dtype=torch.int32)
        want = encode_payload(x, b.to(torch.uint8)).float() * scale_f32(b.to(torch.uint8))
        n = triton.next_power_of_2(x.numel())
        xp, bp = torch.zeros(n), torch.full((n,), byte, dtype=torch.int32)
        xp[: x.numel()] = x
        out = torch.empty(n)
        xp, bp, out = xp.to(DEV), bp.to(DEV), out.to(DEV)
        _grid_round_kernel[(1,)](xp, bp, out, N=n)
        assert torch.equal(out[: x.numel()].cpu(), want), byte
    # blocks across 60 decades, all-zero blocks, and (one run each) a tiny block (byte < 8), a NaN, a huge
    # value: the last three take the conversion path for the whole tile
    x = torch.randn(64, 64) * torch.logspace(-30, 30, 64)[:, None]
    x[:32, 32:] = 0.0
    for special in (None, (1e-38, 0.0), (float("nan"), 0.0), (1e35, 0.0)):
        xs = x.clone()
        if special is not None:
            xs[40:, :32] *= 1e-30  # (rows 40.. are large; this keeps them finite)
            xs[5, 7], xs[6, 7] = special
        xd = xs.to(DEV)
        for square in (True, False):
            out = torch.empty_like(xd)
            _block_round_kernel[(1,)](xd, out, R=64, C=64, SQUARE=square)
            want = dequantize(quantize_reference(xs, block="square") if square else quantize_reference(xs, axis=1))
            assert torch.equal(out.cpu().nan_to_num(7.0), want.nan_to_num(7.0)), (special, square)


# ----------------------------------------------------------------------------- autograd, custom op, compile


def test_autograd_matches_kernels_and_accuracy_table(capsys):
    """Gradients through `jagged_attention_triton` equal the backward kernel on the forward's own O and LSE;
    accuracy of mxfp8 and bf16 against the FP32 oracle (printed) beside the reference's."""
    offs = offsets_of([33, 0, 127, 1])
    t = int(offs[-1])
    rows = []
    for outliers in (False, True):
        x = [randn(t, 2, 64, dtype=torch.float32, outliers=outliers) for _ in range(3)]
        do = torch.randn(t, 2, 64).to(DEV)
        xr = [a.clone().requires_grad_() for a in x]
        o32 = jagged_attention(*xr, offs, causal=True, precision="fp32", backend="reference")
        o32.backward(do)
        oracle = (o32.detach(), *(a.grad for a in xr))
        for precision in ("mxfp8", "bf16"):
            xb = [a.bfloat16().requires_grad_() for a in x]
            o, lse = jagged_attention_triton(*xb, offs, causal=True, precision=precision, return_lse=True,
                                             fwd_config=FWD_CFG, bwd_config=BWD_CFG)
            o.backward(do.bfloat16())
            got = (o.detach(), *(a.grad for a in xb))
            direct = attention_backward(do.bfloat16(), *(a.detach() for a in xb), o.detach(), lse.detach(), offs,
                                        offs, causal=True, precision=precision, config=BWD_CFG)
            for g, d in zip(got[1:], direct):
                assert torch.equal(g, d)
            xr = [a.detach().bfloat16().requires_grad_() for a in x]
            o_ref = jagged_attention(*xr, offs, causal=True, precision=precision, backend="reference")
            o_ref.backward(do.bfloat16())
            ref = (o_ref.detach(), *(a.grad for a in xr))
            for name, g, r, w in zip(("O", "dQ", "dK", "dV"), got, ref, oracle):
                rows.append((precision, outliers, name, sqnr_db(g.float(), w), cosine(g.float(), w),
                             sqnr_db(r.float(), w)))
    with capsys.disabled():
        print("\nprecision outliers tensor  SQNR(kernel)  cos(kernel)  SQNR(reference)")
        for p, out, name, s, c, sr in rows:
            print(f"{p:9s} {str(out):8s} {name:6s} {s:12.1f} {c:12.5f} {sr:16.1f}")
    for p, outliers, name, s, c, sr in rows:
        if not outliers:  # on randn (with outlier channels the recipe itself, reference included, drops lower)
            assert c >= 0.99 and s >= 20.0, (p, name, s, c)
        assert s >= sr - 1.0, (p, outliers, name, s, sr)  # the online rounding costs no accuracy of note


def test_custom_op_registration():
    offs = offsets_of([20, 13])
    q, k, v = (randn(33, 1, 64) for _ in range(3))
    args = (q, k, v, offs, offs, True, False, "mxfp8", 0.125, "const_p", "producer", False, True, False, False,
            "strips", True, "split", "fp32", 1.0, [64, 32, 1, 1], [32, 64, 1, 1], [])
    torch.library.opcheck(torch.ops.gem_lp.jagged_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_eager_calls_skip_the_custom_ops_with_the_same_results(monkeypatch):
    """Eager calls run the ops' implementations and registered backward without the dispatcher (host time);
    they give what the custom ops give, and traced calls (a dispatch mode active) still go through the ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import gem_lp.attention.triton_attention as ta

    offs = offsets_of([20, 13, 0, 31])
    t = int(offs[-1])
    q, k, v = (randn(t, 2, 64).requires_grad_() for _ in range(3))
    do = randn(t, 2, 64)

    def run():
        o, lse = jagged_attention_triton(q, k, v, offs, causal=True, precision="mxfp8", return_lse=True,
                                         fwd_config=FWD_CFG, bwd_config=BWD_CFG)
        return (o, lse, *torch.autograd.grad((o, lse), (q, k, v), (do, torch.ones_like(lse))))

    eager = run()

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        through_ops = run()
    assert any("jagged_attention_fwd" in op for op in Seen.ops) and any("jagged_attention_bwd" in op
                                                                        for op in Seen.ops)
    for a, b in zip(eager, through_ops):
        assert torch.equal(a, b)

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(ta, "_attention_fwd_op", refuse)
    monkeypatch.setattr(ta, "_attention_bwd_op", refuse)
    for a, b in zip(run(), eager):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph():
    """A model calling the kernels compiles as one graph (the ops are opaque custom ops with fake impls)."""
    offs = offsets_of([40, 0, 25])
    t = int(offs[-1])
    w = torch.nn.Linear(64, 3 * 64).bfloat16()

    def block(x):
        q, k, v = w(x).view(t, 1, 3, 64).unbind(2)
        o = jagged_attention_triton(q.contiguous(), k.contiguous(), v.contiguous(), offs, causal=True,
                                    precision="mxfp8", fwd_config=FWD_CFG, bwd_config=BWD_CFG)
        return o.float().square().sum()

    x = randn(t, 1, 64).squeeze(1)
    w = w.to(DEV)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    le, lc = block(xe), compiled(xc)
    le.backward()
    lc.backward()
    assert torch.equal(le, lc) and torch.equal(xe.grad, xc.grad)


# ----------------------------------------------------------------------------- errors


def test_errors():
    offs = offsets_of([5, 7])
    q, k, v = (randn(12, 1, 64) for _ in range(3))
    f = jagged_attention_triton
    with pytest.raises(ValueError, match="head dim D in"):
        f(*(randn(12, 1, 96) for _ in range(3)), offs)
    with pytest.raises(TypeError, match="share one dtype"):
        f(q, k.float(), v, offs)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        f(q.double(), k.double(), v.double(), offs)
    with pytest.raises(ValueError, match="one device"):
        f(q, k.to("meta"), v, offs)
    with pytest.raises(ValueError, match="contiguous"):
        f(randn(24, 1, 64)[::2], k, v, offs)
    with pytest.raises(ValueError, match="precision must be one of"):
        f(q, k, v, offs, precision="fp32")
    with pytest.raises(ValueError, match="p_quant"):
        f(q, k, v, offs, precision="mxfp8", p_quant="static")
    with pytest.raises(ValueError, match="MXFP8 forward variant"):
        f(q, k, v, offs, variant="fp8_qk")
    with pytest.raises(ValueError, match="dq_accum"):
        f(q, k, v, offs, dq_accum="bf16")
    with pytest.raises(TypeError, match="int32 or int64"):
        f(q, k, v, offs.float())
    with pytest.raises(ValueError, match="must start at 0"):
        f(q, k, v, offs + 1)
    with pytest.raises(ValueError, match="non-decreasing"):
        f(q, k, v, torch.tensor([0, 9, 5, 12]))
    with pytest.raises(ValueError, match="must end at the number of rows of q"):
        f(q, k, v, torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match="same number of sequences"):
        f(q, k, v, offs, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="kv_offsets is required"):
        f(q, k, v, None, broadcast_q=True)
    with pytest.raises(ValueError, match=r"None or \[0, Lq\]"):
        f(q, k, v, offs, offs, broadcast_q=True)
    with pytest.raises(ValueError, match="self-attention"):
        f(q, randn(10, 1, 64), randn(10, 1, 64), offs)


# ----------------------------------------------------------------------------- GPU (larger shapes)


def _gpu_batch(lengths, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = offsets_of(lengths)
    t = int(offs[-1])
    return [torch.randn(t, heads, dim, generator=g).bfloat16().cuda() for _ in range(3)], offs.cuda()


GPU_LENGTHS = [0, 1, 31, 33, 127, 129, 500, 1023, 257, 64, 2000]


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
def test_gpu_forward_against_tile_model_and_reference(dim, causal, p_quant):
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 3, dim)
    o, lse = attention_forward(q, k, v, offs, offs, causal=causal, precision="mxfp8", p_quant=p_quant)
    cpu = [x.cpu() for x in (q, k, v)]
    o_model, lse_model = tile_model_forward(*cpu, offs.cpu(), offs.cpu(), causal=causal, broadcast_q=False,
                                            precision="mxfp8", p_quant=p_quant,
                                            block_n=FWD_CONFIGS[dim][1])
    off = (o.float().cpu() - o_model).abs() > 2.0**-8 * o_model.abs() + 1e-4  # exp2/log2 are approximate
    assert off.float().mean().item() <= 0.01, off.sum().item()
    o_ref, lse_ref = reference(q, k, v, offs, causal=causal, precision="mxfp8", p_quant=p_quant)
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], rtol=0, atol=1e-4)
    bound = output_bound(*cpu, offs.cpu(), offs.cpu(), o_ref.cpu(), o.cpu(), causal=causal, broadcast_q=False,
                         precision="mxfp8")
    assert bool(((o.float().cpu() - o_ref.float().cpu()).abs() <= bound).all())


@pytest.mark.gpu
def test_gpu_hw_cast_equals_integer_rounding_and_variants():
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 2, 128, seed=1)
    for p_quant in ("const_p", "dynamic"):
        o_hw, lse_hw = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", p_quant=p_quant)
        o_int, lse_int = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", p_quant=p_quant,
                                           hw_cast=False)
        assert torch.equal(o_hw, o_int) and torch.equal(lse_hw, lse_int)
        o_loop, _ = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", p_quant=p_quant,
                                      variant="dequant_in_loop")
        assert rel_err(o_loop.float(), o_hw.float()) < 1e-3  # the same operand values
        o_fp8, _ = attention_forward(q, k, v, offs, offs, causal=True, precision="mxfp8", p_quant=p_quant,
                                     variant="fp8_qk")
        # Hopper's FP8 MMA may add its 32 products with less than FP32 precision: a few P elements round apart
        assert rel_err(o_fp8.float(), o_hw.float()) < 2.0**-6
        do = torch.randn_like(o_hw)
        g_hw = attention_backward(do, q, k, v, o_hw, lse_hw, offs, offs, causal=True, p_quant=p_quant)
        g_int = attention_backward(do, q, k, v, o_hw, lse_hw, offs, offs, causal=True, p_quant=p_quant,
                                   hw_cast=False)
        for a, b in zip(g_hw, g_int):  # dQ is summed by atomics in any order
            assert rel_err(a.float(), b.float()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [
    "bf16",
    # Triton 3.6's warp specialization asserts while compiling the mxfp8 loop (TaskIdPropagation.cpp:162,
    # visitBranchOperand); strict, so a Triton that compiles it makes this test fail until it is looked at
    pytest.param("mxfp8", marks=pytest.mark.xfail(raises=RuntimeError, strict=True,
                                                  reason="Triton 3.6 warp specialization fails to compile it")),
])
def test_gpu_warp_specialized_loop_matches(precision):
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 2, 128, seed=2)
    o, lse = attention_forward(q, k, v, offs, offs, precision=precision)
    o_ws, lse_ws = attention_forward(q, k, v, offs, offs, precision=precision, warp_specialize=True)
    assert torch.equal(o_ws, o) and torch.equal(lse_ws, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,p_quant", [("mxfp8", "const_p"), ("mxfp8", "dynamic"), ("bf16", "const_p")])
def test_gpu_backward_against_reference(precision, p_quant):
    (q, k, v), offs = _gpu_batch(GPU_LENGTHS, 2, 128, seed=3)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, offs, causal=True, precision=precision, p_quant=p_quant)
    do = torch.randn_like(o_ref)
    o_ref.backward(do)
    dq, dk, dv = attention_backward(do, q, k, v, o_ref.detach(), lse_ref.detach(), offs, offs, causal=True,
                                    precision=precision, p_quant=p_quant)
    for out, ref in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel_err(out.float(), ref.float()) <= 2.0**-9


@pytest.mark.gpu
def test_gpu_broadcast_q_and_compile():
    kv, offs = _gpu_batch([100, 0, 2000, 37] * 4, 2, 128, seed=4)
    k, v = kv[1], kv[2]
    q = torch.randn(64, 2, 128, device="cuda").bfloat16().requires_grad_()
    f = torch.compile(lambda q, k, v: jagged_attention_triton(q, k, v, None, offs, broadcast_q=True,
                                                               precision="mxfp8"), fullgraph=True)
    o = f(q, k, v)
    o.float().square().sum().backward()
    qr = q.detach().clone().requires_grad_()
    o_ref, _ = reference(qr, k, v, None, offs, broadcast_q=True, precision="mxfp8")
    o_ref.float().square().sum().backward()
    assert rel_err(o.float(), o_ref.float()) < 2.0**-5
    assert rel_err(q.grad.float(), qr.grad.float()) < 2.0**-4
