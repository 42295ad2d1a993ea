"""Public MX linear ops: each validates its arguments and dispatches to the implementation the table gives it
(`gem_lp.runtime.dispatch`: the reference, or a GPU route of `gem_lp.linear.gemm`)."""
from __future__ import annotations

import torch

from gem_lp.linear.reference import MXLinearReference, RMSNormMXLinearReference
from gem_lp.checks import check_float, check_norm, check_same_device
from gem_lp.mx.formats import BLOCK, check_scaling
from gem_lp.mx.reference import INPUT_ACTIVATIONS, check_input_activation
from gem_lp.runtime import dispatch


def _linear_backend(backend: str) -> str:
    """The linears' GPU routes are reached with `backend="triton"` (their casts' toolchain) or "auto"."""
    if backend == "cute":
        raise ValueError("backend='cute' is not available for the MX linears (they have: reference, triton; their "
                         "casts take the CuTe kernel where the table says so)")
    return backend


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float(x, "x", what=" [..., K]")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    check_float(weight, "weight", 2, " [N, K]")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim must equal weight's K={k}, got x of shape {tuple(x.shape)}")
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"mx_linear needs K and N to be multiples of {BLOCK} (the MX contraction blocks of the "
                         f"forward and of dX), got weight of shape [N={n}, K={k}]")
    if bias is not None:
        check_float(bias, "bias", 1, " [N]")
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    check_same_device(x, weight=weight, bias=bias)


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, scaling: str = "rceil",
              input_activation: str | None = None, backend: str = "auto") -> torch.Tensor:
    """`act(x) [..., K] @ weight[N, K]^T + bias [N]` by the MXLinear recipe (see reference.py), differentiable.

    K and N must be multiples of 32. Output `[..., N]` in x's dtype; gradients in each input's dtype.
    `input_activation`: None (act the identity) or a key of `INPUT_ACTIVATIONS`, e.g. an MLP's down-projection
    taking the up-projection's pre-activation. The result is that of `mx_linear(F.silu(x), ...)`; the GPU routes
    compute the activation inside its casts, so act(x) is never stored (its backward keeps x, which autograd
    keeps for the activation anyway).
    """
    _check_linear(x, weight, bias)
    check_scaling(scaling)
    check_input_activation(input_activation)
    k = x.shape[-1]
    route = dispatch.choose("linear", "mxfp8", x.device, _linear_backend(backend))
    if route != dispatch.REFERENCE:
        from gem_lp.linear.functions import MXLinearFunction

        y = MXLinearFunction.apply(x.reshape(-1, k), weight, bias, scaling, route, input_activation)
    else:
        a = x if input_activation is None else INPUT_ACTIVATIONS[input_activation](x)
        y = MXLinearReference.apply(a.reshape(-1, k), weight, bias, scaling)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_mx_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, eps: float = 1e-6, *, scaling: str = "rceil",
                       backend: str = "auto") -> torch.Tensor:
    """`rms_norm(x, norm_weight, eps) @ weight^T + bias` with the normalized activation in MXFP8.

    One RMSNorm+quantize pass gives the forward operand and the saved (colwise) operand; differentiable
    in x, norm_weight, weight and bias. Output `[..., N]` in x's dtype.
    """
    check_norm(x, norm_weight, eps, "norm_weight")
    _check_linear(x, weight, bias)
    check_scaling(scaling)
    k = x.shape[-1]
    route = dispatch.choose("linear", "mxfp8", x.device, _linear_backend(backend))
    if route != dispatch.REFERENCE:
        from gem_lp.linear.functions import RMSNormMXLinearFunction

        y = RMSNormMXLinearFunction.apply(x.reshape(-1, k), norm_weight, weight, bias, float(eps), scaling, route)
    else:
        y = RMSNormMXLinearReference.apply(x.reshape(-1, k), norm_weight, weight, bias, float(eps), scaling)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_mx_mlp(x: torch.Tensor, norm_weight: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None,
                    w_down: torch.Tensor, b_down: torch.Tensor | None, eps: float = 1e-6, *, activation: str = "silu",
                    scaling: str = "rceil", backend: str = "auto") -> torch.Tensor:
    """A pre-norm MLP by the MXLinear recipe: `mx_linear(act(rms_norm_mx_linear(x, norm_weight, w_up, b_up, eps)),
    w_down, b_down)`, differentiable in every tensor. `activation`: a key of `INPUT_ACTIVATIONS`.

    The same values as those two ops composed with `input_activation=activation`; on the GPU routes the
    activation's backward is computed inside the up-projection's dY casts, so neither the hidden activation nor
    its gradient is ever stored. Output `[..., N]` in x's dtype (N = w_down's rows).
    """
    check_norm(x, norm_weight, eps, "norm_weight")
    _check_linear(x, w_up, b_up)
    check_input_activation(activation)
    if activation is None:
        raise ValueError(f"activation must be one of {sorted(INPUT_ACTIVATIONS)}, got None")
    check_float(w_down, "w_down", 2, " [N, hidden]")
    hidden = w_up.shape[0]
    if w_down.shape[1] != hidden or w_down.shape[0] % BLOCK:
        raise ValueError(f"w_down must be [N, hidden={hidden}] (w_up's output features), N a multiple of {BLOCK}, "
                         f"got {tuple(w_down.shape)}")
    if b_down is not None:
        check_float(b_down, "b_down", 1, " [N]")
        if b_down.shape[0] != w_down.shape[0]:
            raise ValueError(f"b_down must be [N={w_down.shape[0]}], got {tuple(b_down.shape)}")
    check_same_device(x, w_down=w_down, b_down=b_down)
    check_scaling(scaling)
    k = x.shape[-1]
    route = dispatch.choose("linear", "mxfp8", x.device, _linear_backend(backend))
    if route != dispatch.REFERENCE:
        from gem_lp.linear.functions import RMSNormMXMLPFunction

        y = RMSNormMXMLPFunction.apply(x.reshape(-1, k), norm_weight, w_up, b_up, w_down, b_down, float(eps),
                                       scaling, route, activation)
    else:
        h = RMSNormMXLinearReference.apply(x.reshape(-1, k), norm_weight, w_up, b_up, float(eps), scaling)
        y = MXLinearReference.apply(INPUT_ACTIVATIONS[activation](h), w_down, b_down, scaling)
    return y.reshape(*x.shape[:-1], w_down.shape[0])
