"""Jagged test batches: the fixed mix of lengths, outliers and non-finite values, as factory fixtures."""
import pytest
import torch

# Triton tests run on the GPU when there is one (hardware E4M3 cast), else in the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# every boundary of the 32-token blocks and 128-row tiles, a zero-length sequence, and a multi-tile one
MIXED_LENGTHS = (0, 1, 31, 32, 33, 127, 128, 129, 300)


def offsets_of(lengths, dtype=torch.int64) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dtype)


def make_values(lengths, heads: int, dim: int, dtype=torch.float32, *, specials: bool = True,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """`[T, H, D]` randn values with a different power-of-two magnitude per (sequence, head); with
    `specials`, NaN, +-Inf, huge, FP32-subnormal, zero and -0 blocks placed in distinct sequences."""
    g = generator or torch.Generator().manual_seed(1234)
    t = int(sum(lengths))
    offs = offsets_of(lengths).tolist()
    x = torch.randn(t, heads, dim, generator=g)
    for b in range(len(lengths)):
        exps = torch.randint(-20, 20, (heads,), generator=g).float()
        x[offs[b]:offs[b + 1]] *= torch.exp2(exps)[None, :, None]
    if specials and t:
        def at(seq: int, tok: int) -> int:  # token `tok` of the seq-th non-empty sequence (wrapping)
            nonempty = [b for b in range(len(lengths)) if lengths[b] > 0]
            b = nonempty[seq % len(nonempty)]
            return offs[b] + tok % lengths[b]

        h_last = heads - 1
        x[at(0, 0), 0, 0] = float("nan")  # a length-1 sequence: its only token
        x[at(3, 32), h_last, dim - 1] = float("inf")  # length 33: the partial last token block
        x[at(4, 5), 0, 3] = float("-inf")
        x[at(5, 10), 0, :32] = 3.0e38  # near FP32's largest finite
        x[at(6, 128), h_last, :] = 480.0  # length 129: a lone token in the last tile; floor saturates
        x[at(7, 64):at(7, 96), 0, :32] = 1.0e-40  # an FP32-subnormal 32x32 block
        x[at(7, 0):at(7, 32), h_last, -32:] = 0.0  # an all-zero 32x32 block
        x[at(2, 3), 0, 1] = -0.0
        x[at(7, 200), 0, 5] = -2.0 ** -126  # the smallest normal
    return x.to(dtype)


@pytest.fixture
def mixed_lengths():
    return list(MIXED_LENGTHS)


@pytest.fixture
def mixed_batch():
    """Factory: `(values [T, H, D], offsets [B+1])` of the MIXED_LENGTHS batch, on the test device."""
    def make(heads: int, dim: int, dtype=torch.float32, offsets_dtype=torch.int64, lengths=MIXED_LENGTHS,
             specials: bool = True, device=DEVICE):
        values = make_values(lengths, heads, dim, dtype, specials=specials)
        return values.to(device), offsets_of(lengths, offsets_dtype).to(device)

    return make
