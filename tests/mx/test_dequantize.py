"""The dequantize pass (`gem_lp.mx.kernels.triton_dequantize`): exact values of MX operands in FP32 and BF16."""
import math

import pytest
import torch
from byte_checks import u8

from gem_lp.mx import MXTensor, dequantize, quantize_reference, to_blocked
from gem_lp.mx.kernels.triton_dequantize import mx_dequantize_operand

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def generic_mx(rows, cols, seed, blocked=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-10, 11, (rows, 1), generator=g).float())
    mx = quantize_reference(x.to(DEVICE), axis=1, allow_partial=True)
    if not blocked:
        return mx
    return MXTensor(mx.data, to_blocked(mx.scale), "1d", 1, mx.scaling, mx.orig_dtype, "blocked")


@pytest.mark.parametrize("rows,cols,blocked", [(1, 32, False), (33, 100, True), (129, 64, True), (40, 96, False)])
def test_dequantize_operand_is_exact(rows, cols, blocked):
    mx = generic_mx(rows, cols, rows + cols, blocked=blocked)
    u8(mx.data)[0, :3] = 0x7F  # NaN payloads stay NaN
    want = dequantize(mx)
    for dtype in (torch.float32, torch.bfloat16):
        got = mx_dequantize_operand(mx, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0, equal_nan=True)
    assert math.isnan(float(mx_dequantize_operand(mx, torch.float32)[0, 0]))


def test_plain_scales_of_any_strides():
    """Plain scales given as a transposed view (the CuTe cast's colwise scales) dequantize as the contiguous ones;
    blocked scales must be contiguous."""
    mx = generic_mx(70, 96, 5)
    viewed = MXTensor(mx.data, mx.scale.t().contiguous().t(), "1d", 1, mx.scaling, mx.orig_dtype)
    assert not viewed.scale.is_contiguous()
    torch.testing.assert_close(mx_dequantize_operand(viewed, torch.float32), mx_dequantize_operand(mx, torch.float32),
                               rtol=0, atol=0, equal_nan=True)
    blocked = generic_mx(70, 96, 5, blocked=True)
    every_other = torch.stack([blocked.scale, blocked.scale], 1)[:, 0]  # the same bytes, stride 2
    with pytest.raises(ValueError, match="contiguous when blocked"):
        mx_dequantize_operand(MXTensor(blocked.data, every_other, "1d", 1, mx.scaling, mx.orig_dtype, "blocked"))
