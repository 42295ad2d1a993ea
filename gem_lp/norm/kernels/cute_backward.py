"""RMSNorm backward on the CuTe DSL: quack's `RMSNormBackward` kernel (imported, not copied), built here once per
(dtypes, K, arch) with a dynamic token count and launched through TVM FFI.

quack's own entry point (`quack.rmsnorm.rmsnorm_bwd`) also keys its builds by the power of two above the token count;
a jagged batch's token count changes every step, so a batch that crossed a power of two would build mid-run. The
launch here is quack's analytical choice for the arch given no token count (on Hopper it never reads one).
Faster than the Triton backward at the MX linears' shapes (docs/PERF.md): the dispatch table gives it the RMSNorm
backward on sm_90 and sm_100 (sm_100a: compile-checked, self-checked on first use; no Blackwell GPU here).
"""
from __future__ import annotations

import math

import torch

import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.rmsnorm import RMSNormBackward
from quack.rmsnorm_config import RmsNormBwdConfig, get_sm_count

from gem_lp.runtime.builds import register_cache
from gem_lp.runtime.device import build_arch, fake_mode

_COMPILED: dict[tuple, object] = register_cache("norm.backward", {})
# dW partial rows (one per CTA of the persistent grid) in a build without a GPU
_FAKE_PARTIALS = 1


def _vector(K: int, *dtypes) -> int:
    """Elements per 16-byte access the build assumes of every row (rows start that many elements apart)."""
    return math.gcd(K, *(128 // d.width for d in dtypes))


def _build(x_dtype: torch.dtype, dy_dtype: torch.dtype, w_dtype: torch.dtype, K: int, arch: str):
    key = (x_dtype, dy_dtype, w_dtype, K, arch)
    fn = _COMPILED.get(key)
    if fn is None:
        xdt, dydt, wdt = (torch2cute_dtype_map[d] for d in (x_dtype, dy_dtype, w_dtype))
        vec = _vector(K, xdt, dydt)
        m, parts = cute.sym_int(), cute.sym_int()
        x, dx = make_fake_tensor(xdt, (m, K), vec), make_fake_tensor(xdt, (m, K), vec)
        dy = make_fake_tensor(dydt, (m, K), vec)
        w = make_fake_tensor(wdt, (K,), vec)
        rstd = make_fake_tensor(cutlass.Float32, (m,))
        dw = make_fake_tensor(cutlass.Float32, (parts, K), vec)
        major = int(arch.removeprefix("sm_").rstrip("a")) // 10
        config = RmsNormBwdConfig.from_analytical_heuristic(K, xdt.width, dydt.width, arch_major=major, T_hint=0)
        kernel = RMSNormBackward(xdt, K, dout_dtype=dydt, num_acc=1, config=config)
        fn = _COMPILED[key] = cute.compile(
            kernel, x, w, dy, None, rstd, None, dx, dw, None, None, 0,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    return fn


def _rows_as_built(t: torch.Tensor, vec: int) -> torch.Tensor:
    """t itself when its rows are what the build assumes (contiguous last dim, rows `vec`-element aligned), else a
    contiguous copy."""
    if fake_mode():
        return t
    ok = t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) % vec == 0) and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def rms_norm_backward_cute(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *,
                           arch: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_backward`'s result on the CuTe kernel: `dx [M, K]` in x's dtype and `dweight [K]` FP32.

    Args as `gem_lp.mx.kernels.triton_cast.rms_norm_backward`'s, not checked here (the MX norm linears pass tensors of
    their own making): x `[M, K]` float, weight `[K]`, rstd `[M]` FP32 contiguous, dy `[M, K]` float; arch: the
    build's target (default: the device's), for builds without a GPU.
    """
    M, K = x.shape
    arch = arch or build_arch(x.device)
    fn = _build(x.dtype, dy.dtype, weight.dtype, K, arch)
    dx = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M == 0:
        return dx, torch.zeros(K, dtype=torch.float32, device=x.device)
    vec = _vector(K, torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[dy.dtype])
    parts = _FAKE_PARTIALS if fake_mode() else get_sm_count(K, x.device)
    dw_partial = torch.empty((parts, K), dtype=torch.float32, device=x.device)
    if not fake_mode():
        fn(_rows_as_built(x.detach(), vec), weight.detach().contiguous(), _rows_as_built(dy.detach(), vec), None,
           rstd, None, dx, dw_partial, None, None, parts)
    return dx, dw_partial.sum(0)
