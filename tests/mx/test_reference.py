"""The MXFP8 reference against the rules: corner cases, an independent oracle, torchao, properties."""
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_lp.mx import dequantize, quantize, quantize_reference, scale_bytes
from gem_lp.mx.reference import abs_bits

import mx_oracle

F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _block(first, fill=0.0):
    return torch.tensor([first] + [fill] * 31, dtype=torch.float32)


# (block values, expected floor (byte, first payload), expected rceil (byte, first payload))
CORNERS = [
    ("all zeros", torch.zeros(32), (0, 0x00), (0, 0x00)),
    ("all -0", torch.full((32,), -0.0), (0, 0x80), (0, 0x80)),
    ("all 2^-126", torch.full((32,), 2.0**-126), (0, 0x40), (0, 0x40)),   # payload 2.0
    ("max 448", _block(448.0, 1.0), (127, 0x7E), (127, 0x7E)),
    ("max 480", _block(480.0, 1.0), (127, 0x7E), (128, 0x77)),           # floor saturates to 448; rceil 240
    ("max 512", _block(512.0, 1.0), (128, 0x78), (128, 0x78)),           # 256 both
    ("max 464", _block(464.0), (127, 0x7E), (128, 0x76)),                 # floor: 464 saturates to 448
    ("fp32 max", _block(F32_MAX), (246, 0x7E), (247, 0x78)),              # floor: ~512 saturates; rceil: 256
    ("-fp32 max", _block(-F32_MAX), (246, 0xFE), (247, 0xF8)),
    ("NaN", _block(float("nan"), 1.0), (255, 0x7F), (255, 0x7F)),
    ("+Inf", _block(float("inf"), 1.0), (255, 0x7F), (255, 0x7F)),
    ("-Inf", _block(1.0, float("-inf")), (255, 0x7F), (255, 0x7F)),
    ("subnormal 1e-40", torch.full((32,), 1e-40), (0, None), (0, None)),
    ("smallest subnormal", _block(2.0**-149), (0, 0x00), (0, 0x00)),     # 2^-22 in payload: rounds to 0
    ("tiny normal 2^-120", _block(2.0**-120), (0, 0x70), (0, 0x70)),            # payload 128
]


@pytest.mark.parametrize("scaling", ["floor", "rceil"])
@pytest.mark.parametrize("case", CORNERS, ids=[c[0] for c in CORNERS])
def test_corner_cases(case, scaling):
    name, block, exp_floor, exp_rceil = case
    expected = exp_floor if scaling == "floor" else exp_rceil
    mx = quantize_reference(block.view(1, 32), scaling=scaling)
    byte, payload = int(mx.scale[0, 0]), _u8(mx.data)[0]
    ob, op = mx_oracle.quantize_block(block.tolist(), scaling)
    assert byte == ob and payload.tolist() == op, name
    if expected is not None:
        assert byte == expected[0], name
        if expected[1] is not None:
            assert int(payload[0]) == expected[1], name
    if byte == 255:
        assert torch.isnan(dequantize(mx)).all()


def test_design_examples():
    """The worked examples of docs/numerics.md (section 1), spelled out."""
    q = lambda v, s: quantize_reference(v.view(1, 32), scaling=s)  # noqa: E731
    z = q(torch.zeros(32), "rceil")
    assert z.scale.item() == 0 and _u8(z.data).eq(0).all()
    t = q(torch.full((32,), 2.0**-126), "rceil")
    assert t.scale.item() == 0 and t.data.float().eq(2.0).all()
    f, r = q(_block(480.0), "floor"), q(_block(480.0), "rceil")
    assert (f.scale.item(), f.data.float()[0, 0].item()) == (127, 448.0)
    assert (r.scale.item(), r.data.float()[0, 0].item()) == (128, 240.0)
    assert q(_block(F32_MAX), "floor").scale.item() == 246
    assert q(_block(F32_MAX), "rceil").scale.item() == 247


def test_rceil_thresholds():
    """rceil boundaries: exact 448*2^k keeps the exponent, one ulp above rounds the scale up, and the
    FP32-subnormal branch of d (byte 1 iff d > 2^-127)."""
    for k in (-20, 0, 7, 100):
        exact = 448.0 * 2.0**k
        above = math.nextafter(exact, math.inf)
        above = struct.unpack("<f", struct.pack("<f", above))[0]
        if above == exact:  # nextafter in double can round back to the same fp32
            above = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", exact))[0] + 1))[0]
        assert scale_bytes(abs_bits(torch.tensor([exact])), "rceil").item() == 127 + k
        assert scale_bytes(abs_bits(torch.tensor([above])), "rceil").item() == 128 + k
    # d = amax/448 near 2^-127: amax = 448 * 2^-127 gives d == 2^-127 (byte 0); a little more gives byte 1
    at = torch.tensor([448.0 * 2.0**-127])
    assert scale_bytes(abs_bits(at), "rceil").item() == 0
    assert scale_bytes(abs_bits(at * 1.01), "rceil").item() == 1
    assert scale_bytes(abs_bits(torch.tensor([448.0 * 2.0**-126])), "rceil").item() == 1


def _random_blocks(n_blocks, *, lo_exp=-100, hi_exp=100, gen=None):
    """FP32 blocks whose magnitudes span many decades, with zeros, -0 and subnormals mixed in."""
    g = gen or torch.Generator().manual_seed(1234)
    mag = torch.empty(n_blocks, 1).uniform_(lo_exp, hi_exp, generator=g)
    x = torch.randn(n_blocks, 32, generator=g) * torch.exp2(mag) * torch.exp2(torch.randn(n_blocks, 32, generator=g) * 3)
    x[torch.rand(n_blocks, 32, generator=g) < 0.05] = 0.0
    x[torch.rand(n_blocks, 32, generator=g) < 0.02] = -0.0
    sub = torch.rand(n_blocks, generator=g) < 0.05
    x[sub] = torch.randn(int(sub.sum()), 32, generator=g) * 1e-39
    return x.float()


@pytest.mark.parametrize("scaling", ["floor", "rceil"])
def test_against_independent_oracle(scaling):
    x = _random_blocks(600)
    x[5, 3] = float("nan")
    x[9, 0] = float("-inf")
    x[11, 31] = F32_MAX
    mx = quantize_reference(x, scaling=scaling)
    got_s, got_p = mx.scale[:, 0].tolist(), _u8(mx.data).tolist()
    for i in range(x.shape[0]):
        byte, codes = mx_oracle.quantize_block(x[i].tolist(), scaling)
        assert got_s[i] == byte, (i, x[i])
        assert got_p[i] == codes, (i, x[i])
    deq = dequantize(mx)
    for i in range(0, x.shape[0], 7):
        for j in range(32):
            want = mx_oracle.dequantize_value(got_p[i][j], got_s[i])
            have = deq[i, j].item()
            assert (math.isnan(want) and math.isnan(have)) or want == have


def test_torch_fp8_cast_is_rne():
    """The reference relies on torch's fp32->e4m3fn cast: check it on every code, every midpoint and its
    neighbours against the table oracle."""
    vals = torch.tensor(mx_oracle.E4M3_VALUES, dtype=torch.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    cands = torch.cat([vals, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)]).float()
    cands = torch.cat([cands, -cands])
    got = cands.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    want = [mx_oracle.e4m3_code(v) for v in cands.tolist()]
    assert got == want


torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decade", [-30, -10, -1, 0, 3, 10, 30])
def test_floor_matches_torchao_to_mx(decade, dtype):
    """On finite inputs whose block maxima are FP32 normals, torchao's released FLOOR is byte-identical."""
    g = torch.Generator().manual_seed(100 + decade)
    x = (torch.randn(64, 256, generator=g) * 10.0**decade * torch.exp2(torch.randn(64, 1, generator=g) * 4)).to(dtype)
    scale, data = torchao_mx.to_mx(x, torch.float8_e4m3fn, 32)
    ours = quantize_reference(x, scaling="floor")
    assert torch.equal(scale.view(torch.uint8), ours.scale)
    assert torch.equal(data.view(torch.uint8), _u8(ours.data))


def test_axis_and_square_shapes():
    x = torch.randn(32, 64, 96)
    for axis in (0, 1, 2, -1):
        mx = quantize(x, axis=axis)
        moved = quantize(x.movedim(axis, -1).contiguous())
        assert torch.equal(_u8(mx.data.movedim(axis, -1)), _u8(moved.data))
        assert torch.equal(mx.scale.movedim(axis, -1), moved.scale)
    sq = quantize(x, block="square")
    assert sq.scale.shape == (32, 2, 3) and sq.data.shape == x.shape
    # every element of a 32x32 tile shares the tile's scale: the tile max rules
    tile = x[1, 32:64, 64:96]
    assert sq.scale[1, 1, 2] == scale_bytes(abs_bits(tile.float()).amax(), "rceil")


def test_partial_blocks_only_on_request():
    x = torch.randn(4, 33)
    with pytest.raises(ValueError, match="x.shape\\[1\\] has size 33.*multiple of 32"):
        quantize(x)
    mx = quantize_reference(x, allow_partial=True)
    assert mx.scale.shape == (4, 2) and mx.data.shape == (4, 33)
    # the partial block takes its max over its one real element
    assert torch.equal(mx.scale[:, 1], scale_bytes(abs_bits(x[:, 32:].float()).amax(-1), "rceil"))
    assert torch.allclose(dequantize(mx), x, rtol=2**-4, atol=0)


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        quantize(torch.ones(32, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be float32"):
        quantize(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scaling must be one of"):
        quantize(torch.ones(32), scaling="ceil")
    with pytest.raises(ValueError, match="block must be one of"):
        quantize(torch.ones(32), block="2d")
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        quantize(torch.ones(32, 32), axis=3)
    with pytest.raises(ValueError, match="needs at least 2 dims"):
        quantize(torch.ones(32), block="square")
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize(torch.ones(32), backend="cuda")
    with pytest.raises(TypeError, match="mx must be an MXTensor"):
        dequantize(torch.ones(3))


finite_f32 = st.floats(min_value=-3.0000000054977558e38, max_value=3.0000000054977558e38, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite_f32, min_size=32, max_size=32), st.integers(-60, 60))
def test_rceil_round_trip_bound(vals, shift):
    """|x - deq(q(x))| <= max(2^-4 |x|, 2^-10 s): half an E4M3 ulp, relative in the normal range and absolute
    (s = the block scale) in the subnormal range. rceil never saturates, so the bound holds for every finite
    block whose scaled max does not round up past FP32: a block max >= 248 * 2^120 gets byte 247 and a payload
    that rounds to 256, and 256 * 2^120 = 2^128 dequantizes to inf (a property of the rules: excluded)."""
    x = torch.tensor(vals, dtype=torch.float32) * 2.0**shift
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).view(1, 32)
    if abs_bits(x).amax() >= 0x7F780000:  # 248 * 2^120 = 1.9375 * 2^127
        return
    mx = quantize_reference(x, scaling="rceil")
    s = torch.exp2(mx.scale.float() - 127)
    err = (dequantize(mx) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    assert (err <= bound).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from(["rceil", "floor"]), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_square_transpose_invariance(rb, cb, scaling, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 32 * rb, 32 * cb, generator=g) * torch.exp2(torch.randn(2, rb * 32, 1, generator=g) * 8)).to(dtype)
    a = quantize_reference(x, block="square", scaling=scaling)
    b = quantize_reference(x.transpose(-1, -2), block="square", scaling=scaling)
    assert torch.equal(_u8(a.data).transpose(-1, -2), _u8(b.data))
    assert torch.equal(a.scale.transpose(-1, -2), b.scale)


def test_dequantize_is_exact_for_extreme_bytes():
    """byte 0 (2^-127, an FP32 subnormal) and byte 254 dequantize without rounding."""
    from gem_lp.mx import MXTensor

    payload = torch.tensor([[2.0**-9, 3 * 2.0**-9, 0.5, 448.0] * 8]).to(torch.float8_e4m3fn)
    lo = dequantize(MXTensor(payload, torch.tensor([[0]], dtype=torch.uint8)))
    assert lo[0, :4].tolist() == [2.0**-136, 3 * 2.0**-136, 2.0**-128, 448 * 2.0**-127]
    hi = dequantize(MXTensor(payload[:, :3].repeat(1, 11)[:, :32], torch.tensor([[254]], dtype=torch.uint8)))
    assert hi[0, 2].item() == 2.0**126


@pytest.mark.parametrize("shape,block", [((0, 64), "1d"), ((3, 0), "1d"), ((0, 64, 32), "square"), ((64, 0), "square")])
def test_empty_inputs(shape, block):
    mx = quantize_reference(torch.empty(*shape), block=block)
    assert mx.data.shape == shape and mx.data.numel() == 0
    assert dequantize(mx).shape == shape
