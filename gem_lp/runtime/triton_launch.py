"""Direct relaunch of compiled Triton kernels, for launches whose host time the GPU would wait for.

Triton's JIT spends tens of microseconds per launch binding and specializing the arguments, building the cache
key and checking globals. An op that launches the same kernel with the same non-tensor arguments again (a
`KernelLaunch`: grid, scalars and constexprs fixed by a plan the op caches) can skip that after the first
launch: the first launch of each (device, dtypes and 16-byte alignment of the tensors) goes through the JIT,
which finds or compiles the kernel; later ones call that compiled kernel's launcher directly with the same
arguments, as the JIT itself does (Triton 3.6's `CompiledKernel.run`). The interpreter, the JIT's debug mode and
instrumentation always go through the JIT.

The compiled kernels found are shared by every `KernelLaunch` of the same kernel and keyword arguments, keyed as the
JIT specializes: tensors by dtype and 16-byte alignment, integers by being 1, divisible by 16 and their integer
type, constexpr parameters passed by position by their value. A plan made for a new token count (a new grid and M)
then launches the build an earlier count of the same class found, instead of going through the JIT again.
"""
from __future__ import annotations

import inspect
import weakref

import torch
from triton import knobs as _knobs
from triton.runtime import driver as _driver

def constexpr_values(kernel, n_args: int, kwargs: dict) -> tuple:
    """The values of `kernel`'s parameters after the first `n_args` (passed by keyword, else their defaults), in
    parameter order: what a compiled kernel's launcher takes after the positional arguments."""
    params = getattr(kernel, "params", None)  # a JITFunction's; the interpreter's function has its signature
    if params is None and hasattr(kernel, "fn"):
        params = inspect.signature(kernel.fn).parameters.values()
    defaults = {} if params is None else {p.name: p.default for p in params}
    out = []
    for name in kernel.arg_names[n_args:]:
        if name in kwargs:
            out.append(kwargs[name])
        elif defaults.get(name, inspect.Parameter.empty) is not inspect.Parameter.empty:
            out.append(defaults[name])
        else:
            raise TypeError(f"{name} of {kernel.arg_names} is neither given nor defaulted")
    return tuple(out)


class KernelLaunch:
    """A launch of `kernel` with its grid, keyword arguments (constexprs and launch options) and positional
    non-tensor arguments fixed: calls differ only in their tensors. Its compiled kernels (one per build the
    arguments select) are shared with the other launches of the same kernel and keywords, for direct relaunch."""

    __slots__ = ("kernel", "grid", "kwargs", "constexprs", "compiled", "by_value")

    def __init__(self, kernel, grid: tuple[int, ...], n_args: int, kwargs: dict):
        self.kernel, self.grid, self.kwargs = kernel, tuple(grid), kwargs
        # made once per kernel and keywords: a plan for a new token count (a new grid) reuses them
        self.constexprs, self.compiled, self.by_value = _launch_setup(kernel, n_args, kwargs)

    def __call__(self, args: tuple, on_gpu: bool) -> None:
        """Launch on `args` (positional; their non-tensor values and which of them are None must be the ones this
        launch was planned for). `on_gpu`: a compiled kernel runs (CUDA tensors, not the interpreter)."""
        relaunch(self.kernel, self.grid, args, self.kwargs, self.constexprs, self.compiled, on_gpu, self.by_value)


def positional_constexprs(kernel, n_args: int) -> tuple[int, ...]:
    """Positions among the first `n_args` parameters of `kernel` that are `tl.constexpr`: a build is made for each
    of their values."""
    params = getattr(kernel, "params", None) or ()
    return tuple(i for i, p in enumerate(params[:n_args]) if getattr(p, "is_constexpr", False))


def relaunch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, constexprs: tuple, compiled: dict,
             on_gpu: bool, by_value: tuple[int, ...] = ()) -> None:
    """Launch `kernel[grid](*args, **kwargs)`, directly through the compiled kernel recorded in `compiled` when
    there is one for the build these arguments select (see the module's docs). `constexprs`: `constexpr_values` of
    `kwargs`; `compiled`: the cache of the launches of `kernel` with these `kwargs`, keyed here; `by_value`:
    `positional_constexprs` of the kernel (their values select builds)."""
    if (not on_gpu or _knobs.runtime.debug or _knobs.compilation.instrumentation_mode
            or getattr(kernel, "debug", False)):  # the JIT's business
        kernel[grid](*args, **kwargs)
        return
    device = _driver.active.get_current_device()
    key = (device, *map(_specialization, args), *(args[i] for i in by_value))
    compiled_kernel = compiled.get(key)
    if compiled_kernel is None:
        compiled_kernel = kernel[grid](*args, **kwargs)
        if _relaunchable(compiled_kernel):
            compiled[key] = compiled_kernel
        return
    stream = _driver.active.get_current_stream(device)
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    # the launch metadata only feeds the enter hooks (profilers): built when one is registered, as the JIT does
    metadata = (compiled_kernel.launch_metadata(grid, stream, *args, *constexprs) if getattr(enter, "calls", True)
                else None)
    n = len(grid)
    compiled_kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled_kernel.function,
                        compiled_kernel.packed_metadata, metadata, enter, leave, *args, *constexprs)


def _specialization(a) -> object:
    """What of an argument selects the JIT's build: a tensor's dtype and 16-byte alignment; an integer's being 1,
    being divisible by 16 and its type (i32, u64 or i64); nothing else (floats and bools are not specialized).
    Positions keep None, tensors and numbers apart."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        return a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= (1 << 63)
    return None


# kernel -> {(n_args, keyword arguments): (constexprs, {relaunch key: compiled kernel}, by_value)}; weak on the kernel
_BUILDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _launch_setup(kernel, n_args: int, kwargs: dict) -> tuple[tuple, dict, tuple[int, ...]]:
    """(`constexpr_values`, the compiled-kernel cache shared by the launches of `kernel` with these keyword
    arguments, `positional_constexprs`), made once per kernel and keywords (made afresh, with a private cache, when
    a keyword value cannot be hashed or the kernel cannot be weakly referenced)."""
    try:
        per_kernel = _BUILDS.get(kernel)
        if per_kernel is None:
            per_kernel = _BUILDS[kernel] = {}
        key = (n_args, tuple(sorted(kwargs.items())))
        setup = per_kernel.get(key)
        if setup is None:
            setup = per_kernel[key] = (constexpr_values(kernel, n_args, kwargs), {},
                                       positional_constexprs(kernel, n_args))
        return setup
    except TypeError:
        return constexpr_values(kernel, n_args, kwargs), {}, positional_constexprs(kernel, n_args)


def _relaunchable(kernel) -> bool:
    """A compiled kernel whose launcher `relaunch` knows how to call (Triton 3.6's `CompiledKernel`)."""
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
