"""An elementwise activation that keeps for its backward its derivative as MXFP8, not its input.

`mx_activation(x, "silu")` returns `silu(x)` exactly; what autograd keeps is `silu'(x)` (in x's dtype) quantized 1x32
along the last dim (E4M3 payload + E8M0 scales, 1.03 bytes per element against BF16's 2), and the backward is
`dx = dy * deq(silu'(x))` (docs/numerics.md, "Activations"). In an MLP `down(act(up(x)))` under the MXFP8 recipe the
activation's input is the largest tensor the layer keeps: the linears around it already keep theirs as MX.

Why the derivative and not x: the derivatives of SiLU, GELU and ReLU are bounded (in [-0.1, 1.1]), so a block's
rounding error stays a small fraction of the values that matter; x quantized per block loses its small entries next to a
large one (they round to a few levels or to zero), and the derivative taken there was measurably worse in training
(CPU default: eval NE +0.36% against BF16, against +0.03% for the BF16 input kept).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import resolve_backend
from ..mx.formats import MXTensor
from ..mx.ops import dequantize, quantize

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _derivative(x: torch.Tensor, name: str) -> torch.Tensor:
    """d activation / dx at x, in x's dtype (ATen's backward kernels with a gradient of ones: one pass each)."""
    ones = torch.ones_like(x)
    if name == "silu":
        return torch.ops.aten.silu_backward(ones, x)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(ones, x)
    return torch.ops.aten.threshold_backward(ones, x, 0)


class _MXActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, backend: str) -> torch.Tensor:
        slope = _derivative(x, name).reshape(-1, x.shape[-1])
        saved = quantize(slope, axis=-1, backend=backend)
        ctx.save_for_backward(saved.data, saved.scale)
        ctx.shape, ctx.dtype, ctx.scaling = x.shape, x.dtype, saved.scaling
        return ACTIVATIONS[name](x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        data, scale = ctx.saved_tensors
        saved = MXTensor(data, scale, "1d", 1, ctx.scaling, ctx.dtype)
        if data.is_cuda and ctx.dtype in (torch.bfloat16, torch.float32):
            from .triton_gemm import mx_dequantize_operand

            slope = mx_dequantize_operand(saved, ctx.dtype)  # one pass, no FP32 copy of a BF16 tensor
        else:
            slope = dequantize(saved).to(ctx.dtype)
        return dy * slope.view(ctx.shape), None, None


def mx_activation(x: torch.Tensor, activation: str, *, backend: str = "auto") -> torch.Tensor:
    """`activation(x)` (`"silu"`, `"gelu"` or `"relu"`), keeping its derivative for the backward as MXFP8.

    Args:
        x: float32/bfloat16/float16 `[..., K]`, K a multiple of 32.
        activation: the function's name.
        backend: of the quantization: `"auto"` (Triton on CUDA, else the reference), `"reference"` or `"triton"`
            (`"cute"` is taken as `"auto"`: the op has no CuTe kernel).
    Returns:
        `activation(x)`, exactly as the plain function gives it. Its gradient is the incoming gradient times the
        derivative at x (in x's dtype) rounded to MXFP8 (rceil scales, 1x32 blocks along the last dim).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] % 32:
        raise ValueError(f"x must be [..., K] with K a multiple of 32 (the MX block), got shape {tuple(x.shape)}")
    backend = resolve_backend("auto" if backend == "cute" else backend, x)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return ACTIVATIONS[activation](x)
    return _MXActivation.apply(x, activation, backend)
