"""`jagged_attention(backend="triton")` runs the Triton kernels and agrees with the reference recipe."""
import pytest
import torch

from gem_lp.attention import jagged_attention
from gem_lp.numerics import sqnr_db

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("causal", [False, True])
def test_mxfp8_triton_matches_reference(causal):
    lengths = torch.tensor([0, 33, 1, 40])
    offs = torch.zeros(5, dtype=torch.int64)
    offs[1:] = lengths.cumsum(0)
    T, H, D = int(offs[-1]), 2, 64
    q, k, v = (torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)

    def run(backend):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = jagged_attention(qq, kk, vv, offs.to(DEV), causal=causal, precision="mxfp8", backend=backend)
        o.backward(do)
        return [o, qq.grad, kk.grad, vv.grad]

    for name, t, r in zip(("O", "dQ", "dK", "dV"), run("triton"), run("reference")):
        assert torch.isfinite(t.float()).all(), name
        # the kernel quantizes p against the running row max, the reference against the final one
        assert sqnr_db(t, r) > 25, name
