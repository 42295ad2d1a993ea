"""The direct inverse scale of the jagged kernel's `direct_inverse` launches (`triton_kernel._payload`, LEAN),
emulated bit for bit in PyTorch, against the reference's scale bytes and payloads. The kernel path itself needs
the hardware E4M3 conversion, so it runs only in the GPU tests; this checks its integer arithmetic on every
amax class: zero, FP32 subnormals on both sides of d = amax / 448 = 2^-127, every exponent with the mantissa
edges, the largest finite, Inf and NaN."""
import torch

from gem_lp.mx.reference import encode_payload, scale_bytes

MASK32 = 0xFFFFFFFF


def _u32(t: torch.Tensor) -> torch.Tensor:
    """int64 of the uint32 bits of an int32/float32 tensor."""
    return t.view(torch.int32).to(torch.int64) & MASK32


def _f32(bits: torch.Tensor) -> torch.Tensor:
    """float32 whose bits are the low 32 bits of an int64 tensor."""
    b = bits & MASK32
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def direct_payload(x: torch.Tensor, amax_bits: torch.Tensor) -> torch.Tensor:
    """The kernel's LEAN payload (uint8): inverse scale from d = amax * fp32(1/448) rounded up to a power of two,
    y = fma(x, inv, -(amax - amax)), then the saturating E4M3 conversion (NaN -> 0x7F, as the GPU's)."""
    af = amax_bits.view(torch.float32)
    d = _u32(af * torch.tensor(0.0022321429569274187, dtype=torch.float32))
    up = torch.where(d > 0x400000, (d + 0x7FFFFF) & 0xFF800000, torch.zeros_like(d))
    inv = _f32(0x7F000000 - up)
    y = x * inv + (-(af - af))  # x * inv is exact (a power-of-two scaling); adding -0 keeps it, -0 included
    q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(q, 0x7F), q)


def _amax_classes() -> torch.Tensor:
    sub_edge = int(torch.tensor(448 * 2.0**-127, dtype=torch.float32).view(torch.int32))  # d = 2^-127
    bits = [0, 1, 0x3FFFFF, 0x400000, 0x7FFFFF, sub_edge - 1, sub_edge, sub_edge + 1, 0x7F7FFFFF,
            0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0x7F800001]
    for exp in range(1, 255):
        for mant in (0, 1, 0x400000, 0x7FFFFF):
            bits.append((exp << 23) | mant)
    g = torch.Generator().manual_seed(0)
    bits += torch.randint(0, 0x7F800000, (4000,), generator=g).tolist()
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32)


def test_direct_inverse_matches_the_reference():
    amax_bits = _amax_classes()
    amax = amax_bits.view(torch.float32)
    g = torch.Generator().manual_seed(1)
    # x: the amax itself (both signs), fractions of it, zeros of both signs, tiny values
    fractions = torch.cat([torch.tensor([1.0, -1.0, 0.0, -0.0, 0.5, -0.75, 2.0**-10, 2.0**-20, -2.0**-30]),
                           torch.rand(23, generator=g) * 2 - 1])
    finite = torch.isfinite(amax)
    x = torch.where(finite[:, None], amax[:, None] * fractions[None, :], fractions[None, :].expand(len(amax), -1))
    want = encode_payload(x, scale_bytes(amax_bits, "rceil")[:, None]).view(torch.uint8)
    got = direct_payload(x, amax_bits[:, None])
    bad = (got != want).nonzero()
    assert bad.numel() == 0, [(hex(int(amax_bits[i])), float(x[i, j]), int(got[i, j]), int(want[i, j]))
                              for i, j in bad[:8].tolist()]
