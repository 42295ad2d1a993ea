"""The producer pass (`gem_lp.attention.producer`): MX-exact BF16 operands equal to the reference quantization,
per sequence, bit for bit. Runs the Triton kernel on the GPU when there is one, else in Triton's interpreter."""
import pytest
import torch

from gem_lp.attention.producer import ORIENT_HDIM, ORIENT_SEQ, ORIENT_SQUARE, mx_operands
from gem_lp.attention.reference import mx_hdim, mx_seq, mx_square

from byte_checks import assert_same_values

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offsets_of(lengths) -> torch.Tensor:
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offs.to(DEV)


def randn(rows, heads, dim, dtype=torch.bfloat16, outliers=False):
    x = torch.randn(rows, heads, dim)
    if outliers:  # a few channels x20, as activations with outlier features have
        x[:, :, torch.randperm(dim)[:3]] *= 20.0
    return x.to(dtype).to(DEV)


def per_sequence(x, offs, fn):
    """`fn` on each sequence of `x [T, H, D]` as `[H, L padded to 32, D]` (zeros never raise a max)."""
    out = torch.empty(x.shape)
    o = offs.tolist()
    for s, e in zip(o[:-1], o[1:]):
        if e > s:
            xs = torch.nn.functional.pad(x[s:e].float().cpu().transpose(0, 1), (0, 0, 0, (-(e - s)) % 32))
            out[s:e] = fn(xs)[:, : e - s].transpose(0, 1)
    return out


@pytest.mark.parametrize("dim", [64, 128])
def test_operands_match_reference_quantization(dim):
    """One launch over four tensors with their own offsets (odd lengths, an empty sequence), in BF16 and FP32."""
    q_offs, kv_offs = offsets_of([5, 0, 70, 33, 1]), offsets_of([64, 1, 0, 100, 127])
    q, do = randn(int(q_offs[-1]), 3, dim, outliers=True), randn(int(q_offs[-1]), 3, dim)
    k, v = randn(int(kv_offs[-1]), 3, dim, dtype=torch.float32), randn(int(kv_offs[-1]), 3, dim)
    q_h, k_s, v_h, do_sq = mx_operands([(q, q_offs, ORIENT_HDIM), (k, kv_offs, ORIENT_SEQ), (v, kv_offs, ORIENT_HDIM),
                                        (do, q_offs, ORIENT_SQUARE)])
    assert all(t.dtype == torch.bfloat16 for t in (q_h, k_s, v_h, do_sq))
    assert torch.equal(q_h.float().cpu(), per_sequence(q, q_offs, mx_hdim))
    assert torch.equal(k_s.float().cpu(), per_sequence(k, kv_offs, mx_seq))
    assert torch.equal(v_h.float().cpu(), per_sequence(v, kv_offs, mx_hdim))
    assert torch.equal(do_sq.float().cpu(), per_sequence(do, q_offs, mx_square))


def test_nan_blocks_and_empty_batches():
    offs = offsets_of([40])
    x = randn(40, 1, 64)
    x[3, 0, 5] = float("nan")
    (sq,) = mx_operands([(x, offs, ORIENT_SQUARE)])
    assert torch.isnan(sq[:32, 0, :32]).all()
    assert not torch.isnan(sq[32:]).any() and not torch.isnan(sq[:, :, 32:]).any()
    for lengths in ([], [0, 0]):
        o = offsets_of(lengths)
        (out,) = mx_operands([(torch.zeros(0, 2, 64, device=DEV), o, ORIENT_HDIM)])
        assert out.shape == (0, 2, 64)


def test_argument_errors():
    offs = offsets_of([4])
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_operands([(randn(4, 1, 48), offs, ORIENT_HDIM)])
    with pytest.raises(ValueError, match="orient"):
        mx_operands([(randn(4, 1, 64), offs, 7)])
    with pytest.raises(ValueError, match="1 to 4"):
        mx_operands([(randn(4, 1, 64), offs, ORIENT_HDIM)] * 5)


def test_strided_token_rows_are_read_in_place():
    """q, k, v as views of a fused [T, 3, H, D] projection give the same operands as contiguous copies."""
    offs = offsets_of([33, 0, 64])
    qkv = randn(97, 3 * 2, 64).view(97, 3, 2, 64)
    views = qkv.unbind(1)
    got = mx_operands([(views[0], offs, ORIENT_HDIM), (views[1], offs, ORIENT_SQUARE), (views[2], offs, ORIENT_SEQ)])
    want = mx_operands([(views[0].contiguous(), offs, ORIENT_HDIM), (views[1].contiguous(), offs, ORIENT_SQUARE),
                        (views[2].contiguous(), offs, ORIENT_SEQ)])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contiguous heads and features"):
        mx_operands([(qkv.permute(0, 2, 1, 3)[:, 0], offs, ORIENT_HDIM)])


def test_empty_inputs_with_any_strides():
    """An empty gradient may come with strides (0, 0, 0) (an expanded zero); nothing is read or written."""
    offs = offsets_of([0, 0])
    empty = torch.zeros(1, 2, 64, device=DEV).expand(0, 2, 64)
    (out,) = mx_operands([(empty, offs, ORIENT_SQUARE)])
    assert out.shape == (0, 2, 64)


_NAMES = {ORIENT_HDIM: "hdim", ORIENT_SEQ: "seq", ORIENT_SQUARE: "square"}


@pytest.mark.parametrize("dim,packs", [(64, (ORIENT_SQUARE, ORIENT_SQUARE, ORIENT_HDIM)),
                                       (128, (ORIENT_SQUARE, ORIENT_SQUARE, ORIENT_HDIM)),
                                       (64, (ORIENT_SEQ, ORIENT_HDIM, ORIENT_SQUARE))])
def test_packed_tensors_decode_to_the_operands_and_hold_the_mx_payload(dim, packs):
    """What the forward packs for the backward: the same pass writes each orientation's payload (the reference
    quantization's bytes at the packed positions) and scales; a later pass decodes the operand bit for bit as if it
    had quantized x itself. Odd lengths, an empty sequence, a strided view, NaN and all-zero blocks."""
    from gem_lp.jagged import quantize_jagged

    offs = offsets_of([31, 0, 1, 33, 127, 128, 129, 5])
    t = int(offs[-1])
    qkv = randn(t, 3 * 2, dim, outliers=True).view(t, 3, 2, dim)
    q, k, v = qkv.unbind(1)  # token stride 3 * H * D, as the attention reads a fused projection's output
    q[40, 1, 7] = float("nan")
    k[100:132].zero_()
    specs = [(q, offs, ORIENT_HDIM), (k, offs, ORIENT_HDIM), (v, offs, ORIENT_SEQ)]
    ops, packed = mx_operands(specs, pack=list(packs))
    for got, want in zip(ops, mx_operands(specs)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # packing leaves the operands alone
    for x, p in zip((q, k, v), packed):
        assert p.payload.dtype == torch.uint8 and p.payload.shape == x.shape
        ref = quantize_jagged(x.contiguous(), offs, (_NAMES[p.orient],), backend="reference").payload(_NAMES[p.orient])
        assert torch.equal(p.payload.cpu(), ref.view(torch.uint8).cpu())
        (decoded,) = mx_operands([(p, offs, p.orient)])
        (direct,) = mx_operands([(x, offs, p.orient)])
        assert_same_values(decoded, direct, f"operand decoded from orientation {p.orient}")
    nan_block = {ORIENT_SQUARE: (slice(32, 64), 1, slice(0, 32)), ORIENT_SEQ: (slice(32, 64), 1, 7),
                 ORIENT_HDIM: (40, 1, slice(0, 32))}[packs[0]]
    assert torch.isnan(mx_operands([(packed[0], offs, packs[0])])[0][nan_block]).all()


def test_packed_spec_errors():
    offs = offsets_of([40])
    _, (p,) = mx_operands([(randn(40, 1, 64), offs, ORIENT_HDIM)], pack=[ORIENT_SQUARE])
    with pytest.raises(ValueError, match="decodes its own orientation"):
        mx_operands([(p, offs, ORIENT_HDIM)])
    with pytest.raises(ValueError, match="one entry per spec"):
        mx_operands([(randn(40, 1, 64), offs, ORIENT_HDIM)], pack=[])
    with pytest.raises(ValueError, match="pack None or one of them"):
        mx_operands([(randn(40, 1, 64), offs, ORIENT_HDIM)], pack=[9])


_HOPPER_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gem_lp.attention import producer as pr
sig, consts = {}, {}
for i, (x, pack, from_pack) in enumerate((("*bf16", 3, False), ("*bf16", 3, False), ("*fp32", 1, False),
                                          ("*u8", 0, True))):
    sig.update({f"x{i}": x, f"rs{i}": "i64", f"out{i}": "*bf16", f"seq{i}": "*i32", f"offs{i}": "*i64",
                f"coffs{i}": "*i64", f"pk{i}": "*u8", f"ps{i}": "*u8"})
    consts.update({f"ORIENT{i}": (1, 1, 2, 3)[i], f"PACK{i}": pack, f"FROM_PACK{i}": from_pack})
sig["H"] = "i32"
rows, thread_rows, blocks_in_thread, warps = pr.STRIPS_LAUNCH
consts.update(D=128, ROWS=rows, THREAD_ROWS=thread_rows, ROW_BLOCKS_IN_THREAD=blocks_in_thread, HW_CAST=True,
              INTERPRET=False)
sig.update({n: "constexpr" for n in consts})
k = triton.compile(ASTSource(pr._producer_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps))
print("RESULT", json.dumps(dict(cvt=k.asm["ptx"].count("e4m3x2"))))
"""


def test_producer_compiles_for_hopper():
    """sm_90 build (no GPU needed) of a launch that quantizes and packs, and decodes a packed tensor: the hardware
    E4M3 conversions are used."""
    import json
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(re.search(r"RESULT (.*)", done.stdout).group(1))["cvt"] > 0
