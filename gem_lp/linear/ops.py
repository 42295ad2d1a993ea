"""Public RMSNorm / MX linear ops: each validates its arguments and dispatches to a backend."""
from __future__ import annotations

import math

import torch

from gem_lp.runtime.dispatch import resolve_backend
from gem_lp.mx.formats import BLOCK, INPUT_DTYPES, MXTensor, check_scaling
from gem_lp.linear.reference import (
    INPUT_ACTIVATIONS,
    MXLinearFunction,
    RMSNormMXLinearFunction,
    RMSNormQuantized,
    check_input_activation,
    rms_norm_fp32,
    rms_norm_quantize_reference,
)


def _check_float(t: torch.Tensor, name: str, dims: int | None = None, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{what}, got {type(t).__name__}")
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D{what}, got shape {tuple(t.shape)}")


def _check_same_device(x: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def _check_eps(eps: float) -> None:
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _check_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_name: str = "weight") -> None:
    _check_float(x, "x", what=" [..., K]")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    _check_float(weight, weight_name, 1, " [K]")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{weight_name} must be [K={x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    _check_same_device(x, **{weight_name: weight})
    _check_eps(eps)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_float(x, "x", what=" [..., K]")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    _check_float(weight, "weight", 2, " [N, K]")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim must equal weight's K={k}, got x of shape {tuple(x.shape)}")
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"mx_linear needs K and N to be multiples of {BLOCK} (the MX contraction blocks of the "
                         f"forward and of dX), got weight of shape [N={n}, K={k}]")
    if bias is not None:
        _check_float(bias, "bias", 1, " [N]")
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    _check_same_device(x, weight=weight, bias=bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim in FP32, `x [..., K]`, `weight [K]`; output in x's dtype (autograd)."""
    _check_norm(x, weight, eps)
    y, _ = rms_norm_fp32(x, weight, eps)
    return y.to(x.dtype)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, scaling: str = "rceil",
                      backend: str = "auto") -> RMSNormQuantized:
    """RMSNorm of `x [..., K]` (flattened to `[M, K]`, K a multiple of 32) quantized to MXFP8.

    `y = fp32(x) * rstd * fp32(weight)` is quantized from FP32, rowwise (1x32 along K of `y [M, K]`) and
    colwise (`y^T [K, M]` along M, partial last block allowed); `rstd [M]` float32; scales plain. Not
    differentiable. `backend`: "auto" (cute on sm_90 / sm_100 with the CuTe DSL stack, triton on other GPUs, the
    reference on the CPU), "reference", "triton" or "cute" (K at most 8192). The kernels' colwise payload is a
    `[K, M]` view with rows padded to a multiple of 16 bytes (not contiguous unless M is a multiple of 16; the
    reference's is contiguous): compare values, not layouts.
    """
    _check_norm(x, weight, eps)
    check_scaling(scaling)
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"rms_norm_quantize needs x's last dim K to be a multiple of {BLOCK}, got K={k}")
    x2 = x.reshape(-1, k)
    chosen = resolve_backend(backend, x, weight, kernels=("triton", "cute"))
    if chosen == "cute":
        from gem_lp.mx.kernels.cute_cast_launch import unsupported

        why = unsupported(x2)
        if why is not None:
            if backend == "cute":
                raise ValueError(f"backend='cute' cannot run rms_norm_quantize: {why}")
            chosen = "triton"
    if chosen == "cute":
        from gem_lp.mx.kernels.cute_cast_launch import norm_mx_cast

        out = norm_mx_cast(x2, weight, eps, scaling=scaling, blocked_scales=False)
        return RMSNormQuantized(MXTensor(out.row_data, out.row_scale, "1d", 1, scaling, torch.float32),
                                MXTensor(out.col_data, out.col_scale, "1d", 1, scaling, torch.float32), out.rstd)
    if chosen == "triton":
        from gem_lp.mx.kernels.triton_cast import rms_norm_quantize_triton

        return rms_norm_quantize_triton(x2, weight, eps, scaling)
    return rms_norm_quantize_reference(x2, weight, eps, scaling)


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, scaling: str = "rceil",
              input_activation: str | None = None, backend: str = "auto") -> torch.Tensor:
    """`act(x) [..., K] @ weight[N, K]^T + bias [N]` by the MXLinear recipe (see reference.py), differentiable.

    K and N must be multiples of 32. Output `[..., N]` in x's dtype; gradients in each input's dtype.
    `input_activation`: None (act the identity) or a key of `INPUT_ACTIVATIONS`, e.g. an MLP's down-projection
    taking the up-projection's pre-activation. The result is that of `mx_linear(F.silu(x), ...)`; the Triton path
    computes the activation inside its casts, so act(x) is never stored (its backward keeps x, which autograd
    keeps for the activation anyway).
    """
    _check_linear(x, weight, bias)
    check_scaling(scaling)
    check_input_activation(input_activation)
    k = x.shape[-1]
    if resolve_backend(backend, x, weight) == "triton":
        from gem_lp.linear.functions import MXLinearTritonFunction

        y = MXLinearTritonFunction.apply(x.reshape(-1, k), weight, bias, scaling, "cublas", input_activation)
    else:
        a = x if input_activation is None else INPUT_ACTIVATIONS[input_activation](x)
        y = MXLinearFunction.apply(a.reshape(-1, k), weight, bias, scaling)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_mx_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, eps: float = 1e-6, *, scaling: str = "rceil",
                       backend: str = "auto") -> torch.Tensor:
    """`rms_norm(x, norm_weight, eps) @ weight^T + bias` with the normalized activation in MXFP8.

    One RMSNorm+quantize pass gives the forward operand and the saved (colwise) operand; differentiable
    in x, norm_weight, weight and bias. Output `[..., N]` in x's dtype.
    """
    _check_norm(x, norm_weight, eps, "norm_weight")
    _check_linear(x, weight, bias)
    check_scaling(scaling)
    k = x.shape[-1]
    if resolve_backend(backend, x, weight) == "triton":
        from gem_lp.linear.functions import RMSNormMXLinearTritonFunction

        y = RMSNormMXLinearTritonFunction.apply(x.reshape(-1, k), norm_weight, weight, bias, float(eps), scaling,
                                                "cublas")
    else:
        y = RMSNormMXLinearFunction.apply(x.reshape(-1, k), norm_weight, weight, bias, float(eps), scaling)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_mx_mlp(x: torch.Tensor, norm_weight: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None,
                    w_down: torch.Tensor, b_down: torch.Tensor | None, eps: float = 1e-6, *, activation: str = "silu",
                    scaling: str = "rceil", backend: str = "auto") -> torch.Tensor:
    """A pre-norm MLP by the MXLinear recipe: `mx_linear(act(rms_norm_mx_linear(x, norm_weight, w_up, b_up, eps)),
    w_down, b_down)`, differentiable in every tensor. `activation`: a key of `INPUT_ACTIVATIONS`.

    The same values as those two ops composed with `input_activation=activation`; on the Triton path the
    activation's backward is computed inside the up-projection's dY casts, so neither the hidden activation nor
    its gradient is ever stored. Output `[..., N]` in x's dtype (N = w_down's rows).
    """
    _check_norm(x, norm_weight, eps, "norm_weight")
    _check_linear(x, w_up, b_up)
    check_input_activation(activation)
    if activation is None:
        raise ValueError(f"activation must be one of {sorted(INPUT_ACTIVATIONS)}, got None")
    _check_float(w_down, "w_down", 2, " [N, hidden]")
    hidden = w_up.shape[0]
    if w_down.shape[1] != hidden or w_down.shape[0] % BLOCK:
        raise ValueError(f"w_down must be [N, hidden={hidden}] (w_up's output features), N a multiple of {BLOCK}, "
                         f"got {tuple(w_down.shape)}")
    if b_down is not None:
        _check_float(b_down, "b_down", 1, " [N]")
        if b_down.shape[0] != w_down.shape[0]:
            raise ValueError(f"b_down must be [N={w_down.shape[0]}], got {tuple(b_down.shape)}")
    _check_same_device(x, w_down=w_down, b_down=b_down)
    check_scaling(scaling)
    k = x.shape[-1]
    if resolve_backend(backend, x, w_up) == "triton":
        from gem_lp.linear.functions import RMSNormMXMLPTritonFunction

        y = RMSNormMXMLPTritonFunction.apply(x.reshape(-1, k), norm_weight, w_up, b_up, w_down, b_down, float(eps),
                                             scaling, "cublas", activation)
    else:
        h = RMSNormMXLinearFunction.apply(x.reshape(-1, k), norm_weight, w_up, b_up, float(eps), scaling)
        y = MXLinearFunction.apply(INPUT_ACTIVATIONS[activation](h), w_down, b_down, scaling)
    return y.reshape(*x.shape[:-1], w_down.shape[0])
