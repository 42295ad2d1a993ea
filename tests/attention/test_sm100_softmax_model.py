"""A CPU model of the sm_100a forward's softmax state (`MXSoftmaxSm100`) and of what FA4's correction warps do with
it, against the reference recipe: the online algorithm over key tiles (last tile first, as FA4 walks them) with the
snapped max, power-of-two O rescales, O divided by the rounded-P sum and the LSE carried in FA4's row-max slot.
This checks the algebra of the kernel's state, not the kernel (which has not run on a Blackwell GPU)."""
import math

import pytest
import torch

from gem_lp.attention.reference import LOG2E, normalize, quantize_p_forward, snapped_softmax_parts

TILE = 128
FA4_P_OFFSET = 8  # FA4's FP8 P is 2^8 p; its correction warps take the 8 out of the LSE


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def _model(s: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, scale_log2: float, p_quant: str, rescaled: list):
    """The kernel's per-row state over key tiles (n tiles, processed last to first); returns O and LSE as the
    correction warps write them; counts the rows' O rescales below 1 in `rescaled[0]`. const_p: P = e4m3(2^8 p);
    dynamic: p in MX blocks of 32 keys (the reference's rounding of a block stands for the kernel's)."""
    offset = FA4_P_OFFSET if p_quant == "const_p" else 0
    rows, keys = s.shape
    scale_log2 = torch.tensor(scale_log2, dtype=torch.float32)
    max_log2 = torch.full((rows,), -math.inf)
    l = torch.zeros(rows)
    lq = torch.zeros(rows)
    row_max_slot = torch.full((rows,), -math.inf)
    o = torch.zeros(rows, v.shape[1])
    n_tiles = (keys + TILE - 1) // TILE
    for i, n in enumerate(reversed(range(n_tiles))):
        first = i == 0
        cols = slice(n * TILE, min((n + 1) * TILE, keys))
        st = s[:, cols].masked_fill(~mask[:, cols], -math.inf)
        m_new = torch.ceil(st.amax(-1) * scale_log2)  # update_row_max
        if not first:
            m_new = torch.maximum(m_new, max_log2)
        m_safe = torch.where(m_new == -math.inf, torch.zeros(()), m_new)
        acc_scale = torch.zeros(rows) if first else torch.exp2(max_log2 - m_safe)
        if not first:
            assert torch.all((acc_scale == 0) | (torch.frexp(acc_scale).mantissa == 0.5))  # powers of two
            rescaled[0] += int((acc_scale < 1).sum())
        max_log2 = m_new
        p = torch.exp2(st * scale_log2 + (offset - m_safe)[:, None])  # scale_subtract_rowmax, exp2
        if p_quant == "const_p":
            pq = _e4m3(p)  # FA4's conversion; the P.V operand
        else:  # blocks of 32 keys from the tile start (tiles start on 128-key boundaries of the sequence)
            pad = (-p.shape[1]) % 32
            pq = quantize_p_forward(torch.nn.functional.pad(p, (0, pad)), "dynamic")[:, :p.shape[1]]
        o = (o * acc_scale[:, None] if not first else o) + pq @ v[cols]  # correction rescale, MMA
        l = (l * acc_scale if not first else 0) + p.sum(-1)  # update_row_sum
        lq = (lq * acc_scale if not first else 0) + pq.sum(-1)
        row_max_slot = torch.where(lq > 0, (max_log2 + (torch.log2(l) - torch.log2(lq)) + (FA4_P_OFFSET - offset))
                                   * (1.0 / scale_log2),
                                   torch.full((), -math.inf))
    # correction warps: O / row_sum, LSE = (row_max * scale_log2 + log2(row_sum) - 8) ln 2
    empty = (lq == 0) | torch.isnan(lq)
    o = o / torch.where(empty, torch.ones(()), lq)[:, None]
    lse = torch.where(empty, torch.full((), -math.inf),
                      (row_max_slot * scale_log2 + (torch.log2(lq) - FA4_P_OFFSET)) * math.log(2.0))
    return o, lse


@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys", [100, 128, 300, 512])
def test_model_matches_reference(causal, keys, p_quant):
    gen = torch.Generator().manual_seed(keys + causal)
    rows, dim = 128, 64
    scale = dim**-0.5
    s = torch.randn(rows, keys, generator=gen) * 4.0
    s[:, -7:] += 9.0  # large scores in the last tile, which FA4 processes first
    s[::2, :5] += 14.0  # and larger ones in the first tile (processed last): O rescaled by 2^(m'_old - m'_new) < 1
    s[5, :] -= 40.0  # a row whose weights are far below 1 before snapping
    v = _e4m3(torch.randn(keys, dim, generator=gen))
    q_pos = torch.arange(rows)[:, None] + (keys - rows)
    mask = (torch.arange(keys)[None, :] <= q_pos) if causal else torch.ones(rows, keys, dtype=torch.bool)
    mask[7] = False  # a row without a visible key
    scale_log2 = float(torch.tensor(scale * LOG2E, dtype=torch.float32))

    rescaled = [0]
    o, lse = _model(s, mask, v, scale_log2, p_quant, rescaled)

    t = s * torch.tensor(scale_log2, dtype=torch.float32)
    p, m, l = snapped_softmax_parts(t, mask)
    pad = (-keys) % 32
    pq = quantize_p_forward(torch.nn.functional.pad(p, (0, pad)), p_quant)[:, :keys]
    o_ref, lse_ref = normalize(pq @ v, m, l, weight_sum=pq.sum(-1, keepdim=True))
    assert rescaled[0] > 0 or keys <= TILE
    torch.testing.assert_close(o, o_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=2e-6, atol=2e-6)
    assert torch.all(o[7] == 0) and lse[7] == -math.inf
