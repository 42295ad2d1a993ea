"""nn.Modules of the norm/linear ops. The recipe picks the math; the backend is passed through untouched.

Recipes: `"bf16"` (plain `F.linear` and the BF16 recipe's RMSNorm, `gem_lp.norm.rms_norm(precision="bf16")`, in the
input dtype; parameters cast to it), `"fp32"`
(the same in FP32, output in the input dtype) and `"mxfp8"` (the MXLinear recipe, reference.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


from gem_lp.runtime import dispatch
from gem_lp.runtime.dispatch import BACKENDS
from gem_lp.mx.formats import BLOCK
from gem_lp.linear.ops import mx_linear, rms_norm_mx_linear
from gem_lp.mx.reference import INPUT_ACTIVATIONS, check_input_activation

RECIPES = ("bf16", "fp32", "mxfp8")


def _rms_norm(x, weight, eps, **kw):
    """The BF16 / FP32 recipes' norm: `gem_lp.norm.rms_norm`, reached through the table (ops do not import each
    other). It has no Triton kernel: the module's `backend="triton"` (a model's backend, passed to every op) takes its
    reference, torch's norm."""
    if kw.get("backend") == "triton":
        kw = dict(kw, backend=dispatch.REFERENCE)
    return dispatch.entry("gem_lp.norm.ops:rms_norm")(x, weight, eps, **kw)


def _check_recipe(recipe: str, backend: str, in_features: int, out_features: int) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"in_features and out_features must be positive, got {in_features} and {out_features}")
    if recipe == "mxfp8" and (in_features % BLOCK or out_features % BLOCK):
        raise ValueError(f"recipe='mxfp8' needs in_features and out_features to be multiples of {BLOCK}, "
                         f"got {in_features} and {out_features}")


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _check_rotation(rotated_rows: int, rotation_block: int, out_features: int) -> None:
    if rotated_rows == 0:
        return
    b = rotation_block
    if b < 1 or b & (b - 1) or not 0 < rotated_rows <= out_features or rotated_rows % b:
        raise ValueError(f"rotated_rows must be 0 or a multiple of rotation_block (a power of two) up to out_features="
                         f"{out_features}, got rotated_rows={rotated_rows}, rotation_block={rotation_block}")


def rotate_output_rows(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, block: int):
    """(weight, bias) of the layer whose output features `[0, rows)` are those of `(weight, bias)` times the
    orthonormal Hadamard matrix H `[block, block]`, block by block: `y[:, blk] H = x (H W_blk)^T + b_blk H` (H is
    symmetric). Differentiable; computed in FP32 (as `hadamard_transform`), rounded once to the parameters' dtype."""
    from gem_lp.rotation import hadamard_transform

    if rows == 0:
        return weight, bias
    head = weight[:rows].reshape(rows // block, block, -1).transpose(1, 2)  # [blocks, in, block]: W_blk^T
    rotated = hadamard_transform(head).transpose(1, 2).reshape(rows, -1)
    weight = rotated if rows == weight.shape[0] else torch.cat([rotated, weight[rows:]])
    if bias is not None:
        b = hadamard_transform(bias[:rows].reshape(-1, block)).reshape(rows)
        bias = b if rows == bias.shape[0] else torch.cat([b, bias[rows:]])
    return weight, bias


class _LinearParams(nn.Module):
    """weight `[out, in]` and optional bias `[out]`, initialized as `nn.Linear` does.

    `rotated_rows` > 0: the layer's first `rotated_rows` outputs are multiplied by the orthonormal Hadamard matrix
    over blocks of `rotation_block` features (`rotate_output_rows`, applied to the weight and bias in every forward;
    the parameters stay unrotated). An attention's `qk_rotation` folded into the projections that make Q and K:
    the rotated Q and K come out of the GEMM itself, with no pass over them.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, rotated_rows: int = 0,
                 rotation_block: int = 1):
        super().__init__()
        _check_rotation(rotated_rows, rotation_block, out_features)
        self.in_features, self.out_features = in_features, out_features
        self.rotated_rows, self.rotation_block = rotated_rows, rotation_block
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_linear_parameters()

    def effective_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) the forward uses: the parameters, with the output rotation applied."""
        return rotate_output_rows(self.weight, self.bias, self.rotated_rows, self.rotation_block)

    def _rotation_repr(self) -> str:
        return f", rotated_rows={self.rotated_rows}, rotation_block={self.rotation_block}" if self.rotated_rows else ""

    def reset_linear_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)


class MXLinear(_LinearParams):
    """Linear layer `y = act(x) W^T + b` with `x [..., in_features]`, output in x's dtype.

    `input_activation`: None (act the identity) or a key of `ops.INPUT_ACTIVATIONS` ("silu"), applied in x's dtype
    as the torch function would be; with `recipe="mxfp8"` on the GPU it is computed inside the layer's casts (an MLP's
    hidden activation is then never stored).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: str = "mxfp8",
                 backend: str = "auto", rotated_rows: int = 0, rotation_block: int = 1,
                 input_activation: str | None = None):
        _check_recipe(recipe, backend, in_features, out_features)
        check_input_activation(input_activation)
        super().__init__(in_features, out_features, bias, rotated_rows, rotation_block)
        self.recipe, self.backend, self.input_activation = recipe, backend, input_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_parameters()
        if self.recipe == "mxfp8":
            return mx_linear(x, weight, bias, input_activation=self.input_activation, backend=self.backend)
        if self.input_activation is not None:
            x = INPUT_ACTIVATIONS[self.input_activation](x)
        if self.recipe == "fp32":
            return F.linear(x.float(), weight.float(), _cast(bias, torch.float32)).to(x.dtype)
        return F.linear(x, weight.to(x.dtype), _cast(bias, x.dtype))

    def extra_repr(self) -> str:
        act = "" if self.input_activation is None else f", input_activation={self.input_activation!r}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}, backend={self.backend!r}{act}{self._rotation_repr()}")


class RMSNormMXLinear(_LinearParams):
    """`y = RMSNorm(x) W^T + b`: RMSNorm (weight `norm_weight [in]`, ones at init) fused with a linear layer.

    With `recipe="mxfp8"`, the normalized activation is produced once in MXFP8 in both layouts (forward
    operand and saved operand); the RMSNorm backward runs in FP32 from the saved rstd, on dYn in x's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, eps: float = 1e-6, *,
                 recipe: str = "mxfp8", backend: str = "auto", rotated_rows: int = 0, rotation_block: int = 1):
        _check_recipe(recipe, backend, in_features, out_features)
        super().__init__(in_features, out_features, bias, rotated_rows, rotation_block)
        self.norm_weight = nn.Parameter(torch.ones(in_features))
        self.eps, self.recipe, self.backend = eps, recipe, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_parameters()
        if self.recipe == "mxfp8":
            return rms_norm_mx_linear(x, self.norm_weight, weight, bias, self.eps, backend=self.backend)
        dtype = torch.float32 if self.recipe == "fp32" else x.dtype
        h = _rms_norm(x.to(dtype), self.norm_weight.to(dtype), self.eps, precision="bf16", backend=self.backend)
        return F.linear(h, weight.to(dtype), _cast(bias, dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"eps={self.eps}, recipe={self.recipe!r}, backend={self.backend!r}{self._rotation_repr()}")
