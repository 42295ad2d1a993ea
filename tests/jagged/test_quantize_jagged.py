"""quantize_jagged: the Triton kernel (interpreter on CPU) byte for byte against the per-sequence reference,
the reference against independent dense oracles, dequantization, transpose invariance and edge cases."""
import math

import pytest
import torch

from gem_lp.jagged import JaggedLayout, dequantize_jagged, quantize_jagged, quantize_jagged_reference
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import launch
from gem_lp.mx.formats import BLOCK, PAYLOAD_DTYPE
from gem_lp.mx.layout import from_blocked
from gem_lp.mx.reference import dequantize, quantize_reference

# NaN/Inf inputs make numpy warn inside the Triton interpreter; the bytes are what is checked
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as the mixed_batch fixture
ALL = ("hdim", "seq", "square")
OUTPUTS = ("payload_hdim", "payload_seq", "payload_square", "scale_hdim", "scale_seq", "scale_square_hdim",
           "scale_square_seq")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bytes(ours, ref, names=OUTPUTS):
    for name in names:
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        diff = (u8(a) != u8(b)).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


def triton_into_garbage(values, layout, scaling, **launch_options):
    """Run the kernel into output buffers pre-filled with 0xA5, so that every byte must be written."""
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, d)
    dev = values.device
    payloads = {o: torch.full((t, h, d), 0xA5, dtype=torch.uint8, device=dev).view(PAYLOAD_DTYPE) for o in ALL}
    scales = {n: torch.full((h, nb), 0xA5, dtype=torch.uint8, device=dev) for n, nb in
              (("hdim", hdim_bytes), ("seq", seq_bytes), ("square_hdim", hdim_bytes), ("square_seq", seq_bytes))}
    launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
           scaling == "rceil", tile_tokens=layout.tile_tokens, **launch_options)
    ref = quantize_jagged_reference(values, layout, ALL, scaling)
    out = type(ref)(layout, scaling, values.dtype, h, d, payloads["hdim"], payloads["seq"], payloads["square"],
                    scales["hdim"], scales["seq"], scales["square_hdim"], scales["square_seq"])
    return out, ref


# H in {1, 4}, D in {32, 64, 128}, plus D = 96 (3 scale columns: one padding column per 128x4 tile)
# and D = 160 (5 columns, 2 column blocks; 2 row blocks in the seq form, the second mostly padding)
SHAPES = [(1, 32), (4, 64), (1, 128), (2, 96), (1, 160)]


@pytest.mark.parametrize("heads,dim", SHAPES)
@pytest.mark.parametrize("dtype,scaling", [(torch.bfloat16, "rceil"), (torch.float32, "floor")])
def test_triton_every_byte_matches_reference(mixed_batch, heads, dim, dtype, scaling):
    values, offsets = mixed_batch(heads, dim, dtype)
    ours, ref = triton_into_garbage(values, JaggedLayout.from_offsets(offsets, values), scaling)
    assert_same_bytes(ours, ref)


@pytest.mark.parametrize("dtype,scaling", [(torch.bfloat16, "floor"), (torch.float32, "rceil")])
def test_triton_other_dtype_scaling_pairs(mixed_batch, dtype, scaling):
    values, offsets = mixed_batch(4, 128, dtype)
    ours, ref = triton_into_garbage(values, JaggedLayout.from_offsets(offsets, values), scaling)
    assert_same_bytes(ours, ref)


@pytest.mark.parametrize("rows,thread_rows,row_blocks,chunk_d,num_warps",
                         [(32, 16, False, 32, 1), (64, 8, False, 64, 4), (128, 32, False, 128, 2),
                          (32, 1, True, 128, 2), (64, 2, True, 64, 1)])
def test_launch_options_give_the_same_bytes(mixed_batch, rows, thread_rows, row_blocks, chunk_d, num_warps):
    """The GPU's launch shapes (rows per program, thread strips, feature chunks, warps) in the interpreter,
    whose default is one 128-row program of 4-token strips. Programs past a sequence's end (rows=32, 64)
    write only zero scales."""
    values, offsets = mixed_batch(1, 128, torch.bfloat16)
    layout = JaggedLayout.from_offsets(offsets, values)
    ours, ref = triton_into_garbage(values, layout, "rceil", rows=rows, thread_rows=thread_rows,
                                    row_blocks_in_thread=row_blocks, chunk_d=chunk_d, num_warps=num_warps)
    assert_same_bytes(ours, ref)


def test_int64_offsets_give_the_same_bytes(mixed_batch, monkeypatch):
    """The int64 in-chunk offsets used for huge strides, forced on a small batch (D = 96: padding too)."""
    import gem_lp.jagged.kernels.triton_quantize as tk

    monkeypatch.setattr(tk, "_INT32_SPAN", 0)
    values, offsets = mixed_batch(2, 96, torch.bfloat16)
    ours, ref = triton_into_garbage(values, JaggedLayout.from_offsets(offsets, values), "floor", rows=64)
    assert_same_bytes(ours, ref)


def test_launch_option_errors(mixed_batch):
    values, offsets = mixed_batch(1, 96)
    layout = JaggedLayout.from_offsets(offsets, values)
    with pytest.raises(ValueError, match="chunk_d must be a power-of-two multiple of 32 dividing D = 96, got 64"):
        triton_into_garbage(values, layout, "rceil", chunk_d=64)
    with pytest.raises(ValueError, match="chunk_d must be a power-of-two multiple of 32 dividing D = 96, got 96"):
        triton_into_garbage(values, layout, "rceil", chunk_d=96)
    with pytest.raises(ValueError, match="rows must be 32, 64 or 128, got 16"):
        triton_into_garbage(values, layout, "rceil", rows=16)
    with pytest.raises(ValueError, match="thread_rows must be 1, 2, 4, 8, 16 or 32, got 3"):
        triton_into_garbage(values, layout, "rceil", thread_rows=3)
    with pytest.raises(ValueError, match="num_warps must be a power of two >= 1, got 6"):
        triton_into_garbage(values, layout, "rceil", num_warps=6)


@pytest.mark.parametrize("seed", [1, 2])
def test_triton_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
    lengths[torch.rand(lengths.shape, generator=g) < 0.25] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    heads, dim = int(torch.randint(1, 4, (1,), generator=g)), 32 * int(torch.randint(1, 6, (1,), generator=g))
    magnitude = 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
    values = torch.randn(int(lengths.sum()), heads, dim, generator=g) * magnitude
    values, offsets = values.to(DEVICE), offsets.to(DEVICE)
    ours, ref = triton_into_garbage(values, JaggedLayout.from_offsets(offsets, values), "rceil")
    assert_same_bytes(ours, ref)


def test_public_api_triton_equals_reference_per_orientation_set(mixed_batch):
    values, offsets = mixed_batch(2, 64, torch.bfloat16, offsets_dtype=torch.int32)
    for orientations in [("hdim",), ("seq", "hdim"), ("square",)]:
        ours = quantize_jagged(values, offsets, orientations, backend="triton")
        ref = quantize_jagged(values, offsets, orientations, backend="reference")
        assert ours.orientations == ref.orientations == tuple(o for o in ALL if o in orientations)
        assert_same_bytes(ours, ref)


def test_triton_noncontiguous_values(mixed_batch):
    values, offsets = mixed_batch(3, 64, torch.float32)
    strided = values.transpose(1, 2).contiguous().transpose(1, 2)  # [T, H, D] with stride(2) = H
    assert not strided.is_contiguous()
    ours = quantize_jagged(strided, offsets, ALL, backend="triton")
    assert_same_bytes(ours, quantize_jagged(values, offsets, ALL, backend="reference"))


# --- the reference against dense oracles that do not know about sequences ---------------------------


def padded_dense(values, lengths):
    """`[B, Lmax32, H, D]` zero-padded copy (the gather a padding-based pipeline pays for)."""
    lmax = max([math.ceil(n / BLOCK) * BLOCK for n in lengths] + [BLOCK])
    out = values.new_zeros(len(lengths), lmax, *values.shape[1:])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = values[start:start + n]
        start += n
    return out


def _dense_oracle_check(values, offsets, lengths, scaling):
    jmx = quantize_jagged(values, offsets, ALL, scaling=scaling, backend="reference")
    t, heads, d = values.shape
    so = jmx.layout.scale_offsets.tolist()
    # hdim ignores sequences: one dense quantization of all tokens
    dense = quantize_reference(values.reshape(t * heads, d), axis=1, scaling=scaling)
    assert torch.equal(u8(jmx.payload_hdim).reshape(t * heads, d), u8(dense.data))
    hdim_plain = jmx.plain_scale("hdim")  # [H, Tp, D/32]
    pad = padded_dense(values, lengths)  # [B, Lmax32, H, D]
    seq = quantize_reference(pad, axis=1, scaling=scaling)  # scale [B, Lmax32/32, H, D]
    sq = quantize_reference(pad.permute(0, 2, 1, 3), block="square", scaling=scaling)  # scale [B, H, Lmax32/32, D/32]
    seq_plain, sq_plain = jmx.plain_scale("seq"), jmx.plain_scale("square")
    sq_hdim = jmx.scale_square_hdim
    start = 0
    for b, n in enumerate(lengths):
        nb, row0 = math.ceil(n / BLOCK), so[b]
        dense_rows = dense.scale.reshape(t, heads, -1)[start:start + n]
        assert torch.equal(hdim_plain[:, row0:row0 + n].permute(1, 0, 2), dense_rows)
        assert torch.equal(u8(jmx.payload_seq[start:start + n]), u8(seq.data[b, :n]))
        assert torch.equal(seq_plain[:, :, row0 // BLOCK:row0 // BLOCK + nb], seq.scale[b, :nb].permute(1, 2, 0))
        assert torch.equal(u8(jmx.payload_square[start:start + n]), u8(sq.data[b].permute(1, 0, 2)[:n]))
        assert torch.equal(sq_plain[:, row0 // BLOCK:row0 // BLOCK + nb], sq.scale[b, :, :nb])
        start += n
    # every byte outside the sequences' real rows/blocks is 0
    real_rows = torch.zeros(jmx.layout.padded_total, dtype=torch.bool, device=values.device)
    real_blocks = torch.zeros(jmx.layout.padded_total // BLOCK, dtype=torch.bool, device=values.device)
    for b, n in enumerate(lengths):
        real_rows[so[b]:so[b] + n] = True
        real_blocks[so[b] // BLOCK:so[b] // BLOCK + math.ceil(n / BLOCK)] = True
    assert not hdim_plain[:, ~real_rows].any() and not seq_plain[:, :, ~real_blocks].any()
    sqh = torch.stack([from_blocked(sq_hdim[h], jmx.layout.padded_total, d // BLOCK) for h in range(heads)])
    assert not sqh[:, ~real_rows].any()
    # the square scales' two forms agree: hdim form row r = block (r // 32) on real rows
    assert torch.equal(sqh[:, real_rows], sq_plain.repeat_interleave(BLOCK, dim=1)[:, real_rows])
    blocked_total = sum(b.numel() for b in (jmx.scale_hdim, jmx.scale_seq, sq_hdim, jmx.scale_square_seq))
    padded_bytes = sum(scale_sizes(jmx.layout.padded_total, d)) * 2 * heads
    assert blocked_total == padded_bytes


@pytest.mark.parametrize("scaling", ["rceil", "floor"])
@pytest.mark.parametrize("heads,dim", [(1, 32), (4, 64), (2, 160)])
def test_reference_matches_dense_oracles(mixed_batch, mixed_lengths, scaling, heads, dim):
    values, offsets = mixed_batch(heads, dim, torch.bfloat16)
    _dense_oracle_check(values, offsets, mixed_lengths, scaling)


# --- dequantization, transpose invariance -------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["rceil", "floor"])
def test_dequantize_exact_per_sequence_and_bounded(mixed_batch, mixed_lengths, scaling):
    values, offsets = mixed_batch(2, 64, torch.float32)
    jmx = quantize_jagged(values, offsets, ALL, scaling=scaling, backend="triton")
    offs = offsets.tolist()
    for orientation in ALL:
        got = dequantize_jagged(jmx, orientation)
        assert got.shape == values.shape and got.dtype == torch.float32
        for b in range(len(mixed_lengths)):
            for h in range(values.shape[1] * (mixed_lengths[b] > 0)):
                x = values[offs[b]:offs[b + 1], h]
                if orientation == "hdim":
                    want = dequantize(quantize_reference(x, axis=1, scaling=scaling))
                elif orientation == "seq":
                    want = dequantize(quantize_reference(x, axis=0, scaling=scaling, allow_partial=True))
                else:
                    want = dequantize(quantize_reference(x, block="square", scaling=scaling, allow_partial=True))
                torch.testing.assert_close(got[offs[b]:offs[b + 1], h], want, rtol=0, atol=0, equal_nan=True)
        # error bound from the rules: half an E4M3 ulp (2^-4 relative, or 2^-10 of the scale in E4M3's
        # subnormal range), plus the saturation at 448 that only `floor` reaches
        finite_blocks = torch.isfinite(got)
        scale = _scale_of(jmx, orientation)
        x = values.float()
        bound = x.abs() * 2.0 ** -4 + scale * 2.0 ** -10 + (x.abs() - 448.0 * scale).clamp(min=0)
        err = (got - x).abs()
        assert torch.all(err[finite_blocks] <= bound[finite_blocks])
        # a block holding NaN or Inf dequantizes to NaN throughout; finite blocks stay finite
        assert torch.isnan(got[~finite_blocks]).all()
        assert not torch.isfinite(values).all() and (~finite_blocks).any()
        if scaling == "rceil":  # rceil never saturates
            assert torch.all(err[finite_blocks] <= (x.abs() * 2.0 ** -4 + scale * 2.0 ** -10)[finite_blocks])


def _scale_of(jmx, orientation):
    """FP32 scale 2^(byte-127) of every element: dequantize a payload of ones."""
    ones = type(jmx)(**{**jmx.__dict__})
    payload = torch.ones_like(jmx.payload(orientation), dtype=torch.float32).to(PAYLOAD_DTYPE)
    setattr(ones, f"payload_{orientation}", payload)
    return dequantize_jagged(ones, orientation).nan_to_num(nan=0.0)


def test_dequantize_relative_error_randn(mixed_batch):
    values, offsets = mixed_batch(1, 128, torch.bfloat16, specials=False)
    jmx = quantize_jagged(values, offsets, ALL, backend="triton")
    x = values.float()
    for orientation in ALL:
        rel = ((dequantize_jagged(jmx, orientation) - x).norm() / x.norm()).item()
        assert 0 < rel < 2.0 ** -4


@pytest.mark.parametrize("scaling", ["rceil", "floor"])
def test_square_is_transpose_invariant(mixed_batch, mixed_lengths, scaling):
    values, offsets = mixed_batch(2, 96, torch.bfloat16)
    jmx = quantize_jagged(values, offsets, ("square",), scaling=scaling, backend="triton")
    plain = jmx.plain_scale("square")  # [H, Tp/32, D/32]
    offs, so = offsets.tolist(), jmx.layout.scale_offsets.tolist()
    for b, n in enumerate(mixed_lengths):
        for h in range(values.shape[1] * (n > 0)):
            xt = values[offs[b]:offs[b + 1], h].T  # [D, L]: quantize the transpose
            mt = quantize_reference(xt, block="square", scaling=scaling, allow_partial=True)
            assert torch.equal(u8(jmx.payload_square[offs[b]:offs[b + 1], h]), u8(mt.data.T))
            col0 = so[b] // BLOCK
            assert torch.equal(plain[h, col0:col0 + math.ceil(n / BLOCK)], mt.scale.T)


# --- edge cases ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths", [[], [0, 0, 0]], ids=["empty_batch", "all_zero_lengths"])
def test_no_tokens(backend, offsets_dtype, lengths):
    offsets = torch.zeros(len(lengths) + 1, dtype=offsets_dtype, device=DEVICE)
    values = torch.empty(0, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    jmx = quantize_jagged(values, offsets, ALL, backend=backend)
    assert jmx.layout.total == jmx.layout.padded_total == jmx.layout.max_len == 0
    assert jmx.layout.batch_size == len(lengths)
    for o in ALL:
        assert jmx.payload(o).shape == (0, 3, 64) and jmx.payload(o).dtype == PAYLOAD_DTYPE
        assert dequantize_jagged(jmx, o).shape == (0, 3, 64)
    for s in (jmx.scale_hdim, jmx.scale_seq, jmx.scale_square_hdim, jmx.scale_square_seq):
        assert s.shape == (3, 0) and s.dtype == torch.uint8


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_offsets_dtypes_give_the_same_bytes(mixed_batch, offsets_dtype):
    values, offsets = mixed_batch(1, 32, torch.float32, offsets_dtype=offsets_dtype)
    ours = quantize_jagged(values, offsets, ALL, backend="triton")
    assert ours.layout.offsets.dtype == offsets_dtype and ours.layout.offsets is offsets
    assert_same_bytes(ours, quantize_jagged(values, offsets.to(torch.int64), ALL, backend="reference"))


def test_fp16_values(mixed_batch):
    values, offsets = mixed_batch(1, 64, torch.float16, specials=False)
    ours = quantize_jagged(values, offsets, ALL, backend="triton")
    assert ours.orig_dtype == torch.float16
    assert_same_bytes(ours, quantize_jagged(values, offsets, ALL, backend="reference"))


def test_sizes_and_nbytes(mixed_batch, mixed_lengths):
    values, offsets = mixed_batch(4, 64, torch.bfloat16)
    jmx = quantize_jagged(values, offsets, ALL, backend="reference")
    t, h, d = values.shape
    tp = sum(math.ceil(n / 128) * 128 for n in mixed_lengths)
    assert jmx.layout.padded_total == tp and jmx.layout.max_len == max(mixed_lengths)
    for o in ALL:  # payload bytes are exactly T*H*D: nothing padded
        assert jmx.payload(o).numel() * jmx.payload(o).element_size() == t * h * d
    hdim_bytes = (tp // 128) * math.ceil(d / 32 / 4) * 512
    seq_bytes = math.ceil(d / 128) * (tp // 128) * 512
    assert jmx.scale_hdim.shape == jmx.scale_square_hdim.shape == (h, hdim_bytes)
    assert jmx.scale_seq.shape == jmx.scale_square_seq.shape == (h, seq_bytes)
    assert jmx.nbytes() == 3 * t * h * d + 2 * h * (hdim_bytes + seq_bytes)


def test_layout_reuse_and_missing_orientation(mixed_batch):
    values, offsets = mixed_batch(1, 32)
    layout = JaggedLayout.from_offsets(offsets, values)
    jmx = quantize_jagged(values, layout, ("seq",), backend="triton")
    assert jmx.layout is layout and jmx.orientations == ("seq",)
    with pytest.raises(ValueError, match="orientation 'hdim' was not quantized"):
        dequantize_jagged(jmx, "hdim")
    with pytest.raises(ValueError, match="orientation must be one of"):
        jmx.plain_scale("rows")


# --- torch.library / torch.compile --------------------------------------------------------------------


def test_custom_op_opcheck():
    lengths = [3, 0, 40]
    values = torch.randn(43, 2, 32, device=DEVICE)
    layout = JaggedLayout.from_offsets(torch.tensor([0, 3, 3, 43], device=DEVICE), values)
    args = (values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.tile_tokens, layout.padded_total,
            True, True, True, True)
    torch.library.opcheck(torch.ops.gem_lp.jagged_mx_quantize.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    assert sum(lengths) == values.shape[0]


def test_composes_with_torch_compile(mixed_batch):
    values, offsets = mixed_batch(1, 64, torch.bfloat16, specials=False)
    layout = JaggedLayout.from_offsets(offsets, values)

    def fn(v):
        jmx = quantize_jagged(v * 2.0, layout, ("hdim", "seq"), backend="triton")
        return jmx.payload_hdim, jmx.scale_hdim, jmx.payload_seq, jmx.scale_seq

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = compiled(values)
    want = quantize_jagged(values * 2.0, layout, ("hdim", "seq"), backend="reference")
    for g, w in zip(got, (want.payload_hdim, want.scale_hdim, want.payload_seq, want.scale_seq)):
        assert torch.equal(u8(g), u8(w))


# --- the CUDA build (no GPU needed) -------------------------------------------------------------------

_HOPPER_COMPILE = """
import json, torch
from gem_lp.jagged.tensor import scale_sizes
import re
from gem_lp.jagged.kernels.triton_quantize import _jagged_mx_kernel, launch_args
from gem_lp.mx.formats import PAYLOAD_DTYPE
from gem_lp.mx.kernels.triton_quantize import compile_for_target, ptxas_usage
SETS = dict(hs=("hdim", "seq"), h=("hdim",), q=("square",), all=("hdim", "seq", "square"))
for name, heads, dim in (("hs", 16, 128), ("h", 16, 128), ("q", 4, 128), ("all", 2, 96)):
    t, tp = 1000, 1280
    values = torch.empty(t, heads, dim, dtype=torch.bfloat16)
    offsets, scale_offsets = torch.tensor([0, 600, 1000]), torch.tensor([0, 640, 1280])
    tile_seq = torch.zeros(tp // 128, dtype=torch.int32)
    tile_tokens = torch.zeros(tp // 128, 2, dtype=torch.int64)
    hb, sb = scale_sizes(tp, dim)
    payloads = {o: torch.empty(t, heads, dim, dtype=PAYLOAD_DTYPE) for o in SETS[name]}
    scales = {s: torch.empty(heads, hb if s.endswith("hdim") else sb, dtype=torch.uint8)
              for o in SETS[name] for s in ((o,) if o != "square" else ("square_hdim", "square_seq"))}
    # the GPU's default launch options (no interpreter here), the hardware cast
    grid, args, kwargs = launch_args(values, offsets, scale_offsets, tile_seq, tp, payloads, scales, True,
                                     tile_tokens=tile_tokens, hw_cast=True)
    ptx = compile_for_target(_jagged_mx_kernel, args, kwargs).asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    print(json.dumps(dict(name=name, regs=regs, spills=spills, cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                          ld_v4=ptx.count("ld.global.v4"), lean=kwargs["LEAN"],
                          neg_zero=len(re.findall(r"mul.f32[^;]*0f80000000;", ptx)))))
"""


def test_kernel_compiles_for_hopper():
    """sm_90 builds of the default launches (hdim+seq, hdim, square; D = 96 with every padding path):
    hardware E4M3 conversion, 16-byte loads, no register spills, a true -0 in the lean payload's addend."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")  # a compiled, not interpreted, kernel object
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [b["name"] for b in builds] == ["hs", "h", "q", "all"], done.stdout
    for b in builds:
        assert b["cvt"] > 0 and b["ld_v4"] > 0 and b["spills"] == 0, b
        # the lean payload's FMA addend is amax * -0.0 with a true -0 (Triton compiles a -0.0 literal and
        # -(a - a) to +0, which turns -0 inputs into +0 payloads)
        assert not b["lean"] or b["neg_zero"] > 0, b
