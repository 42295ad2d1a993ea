"""RMSNorm forward and backward (no MX cast) on the CuTe DSL, as one autograd op: the BF16 recipe's norm.

The forward is quack's `RMSNorm` kernel (imported, not copied), built here once per (dtypes, K, arch) with a dynamic
token count and quack's analytical launch for the arch; the backward is `backward.rms_norm_backward_cute` (quack's
`RMSNormBackward`, the MX linears' norm backward). Both compute in FP32: `y = x * rstd * weight`, rounded to x's dtype,
as torch's `F.rms_norm` on a 16-bit x does (its kernel's order of the two multiplies may differ by one rounding).
No Blackwell GPU here: sm_100a is compile-checked only.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.rmsnorm import RMSNorm
from quack.rmsnorm_config import RmsNormFwdConfig

from gem_lp.runtime.builds import register_cache
from gem_lp.runtime.device import build_arch, fake_mode
from gem_lp.norm.kernels.cute_backward import _rows_as_built, _vector, rms_norm_backward_cute

_COMPILED: dict[tuple, object] = register_cache("norm.forward", {})
DTYPES = (torch.bfloat16, torch.float16)
MAX_K = 8192


def _build(x_dtype: torch.dtype, w_dtype: torch.dtype, K: int, arch: str):
    key = (x_dtype, w_dtype, K, arch)
    fn = _COMPILED.get(key)
    if fn is None:
        xdt, wdt = torch2cute_dtype_map[x_dtype], torch2cute_dtype_map[w_dtype]
        vec = _vector(K, xdt, wdt)
        m = cute.sym_int()
        x, y = make_fake_tensor(xdt, (m, K), vec), make_fake_tensor(xdt, (m, K), vec)
        w = make_fake_tensor(wdt, (K,), vec)
        rstd = make_fake_tensor(cutlass.Float32, (m,))
        major = int(arch.removeprefix("sm_").rstrip("a")) // 10
        config = RmsNormFwdConfig.from_analytical_heuristic(K, xdt.width, arch_major=major)
        kernel = RMSNorm(xdt, K, config=config)
        fn = _COMPILED[key] = cute.compile(
            kernel, x, w, None, None, y, None, rstd, None, cutlass.Float32(0),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    return fn


def rms_norm_forward_cute(x: torch.Tensor, weight: torch.Tensor, eps: float, *, arch: str | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`y [M, K]` in x's dtype and `rstd [M]` FP32 of x `[M, K]` (BF16 / FP16) and weight `[K]`; not checked here."""
    M, K = x.shape
    arch = arch or build_arch(x.device)
    fn = _build(x.dtype, weight.dtype, K, arch)
    y = torch.empty((M, K), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and not fake_mode():
        vec = _vector(K, torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[weight.dtype])
        fn(_rows_as_built(x, vec), weight.contiguous(), None, None, y, None, rstd, None, float(eps))
    return y, rstd


class RMSNormCute(torch.autograd.Function):
    """RMSNorm of `x [M, K]` with `weight [K]` on the CuTe kernels; gradients in x's and weight's dtypes."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward_cute(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward_cute(x, weight, rstd, dy.contiguous())
        return dx, dw.to(weight.dtype), None


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `RMSNormCute` takes these shapes and dtypes (the device is the caller's check, `cute_unavailable`):
    16-bit x and weight of one dtype, K a multiple of 8 up to `MAX_K`."""
    K = x.shape[-1]
    return x.dtype in DTYPES and weight.dtype == x.dtype and K % 8 == 0 and K <= MAX_K
