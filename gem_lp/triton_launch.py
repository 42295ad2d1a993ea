"""Direct relaunch of compiled Triton kernels, for launches whose host time the GPU would wait for.

Triton's JIT spends tens of microseconds per launch binding and specializing the arguments, building the cache
key and checking globals. An op that launches the same kernel with the same non-tensor arguments again (a
`KernelLaunch`: grid, scalars and constexprs fixed by a plan the op caches) can skip that after the first
launch: the first launch of each (device, dtypes and 16-byte alignment of the tensors) goes through the JIT,
which finds or compiles the kernel; later ones call that compiled kernel's launcher directly with the same
arguments, as the JIT itself does (Triton 3.6's `CompiledKernel.run`). The interpreter, the JIT's debug mode and
instrumentation always go through the JIT.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs as _knobs
from triton.runtime import driver as _driver

# False sends every launch through the JIT (kept for measuring what direct relaunch saves).
DIRECT_RELAUNCH = True


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
    non-tensor arguments fixed: calls differ only in their tensors. Holds the compiled kernel of each
    (device, tensor dtypes and alignment) it met, for direct relaunch."""

    __slots__ = ("kernel", "grid", "kwargs", "constexprs", "compiled")

    def __init__(self, kernel, grid: tuple[int, ...], n_args: int, kwargs: dict):
        self.kernel, self.grid, self.kwargs = kernel, tuple(grid), kwargs
        self.constexprs = constexpr_values(kernel, n_args, kwargs)
        self.compiled: dict = {}

    def __call__(self, args: tuple, on_gpu: bool) -> None:
        """Launch on `args` (positional; their non-tensor values and which of them are None must be the ones this
        launch was planned for). `on_gpu`: a compiled kernel runs (CUDA tensors, not the interpreter)."""
        relaunch(self.kernel, self.grid, args, self.kwargs, self.constexprs, self.compiled, on_gpu)


def relaunch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, constexprs: tuple, compiled: dict,
             on_gpu: bool) -> None:
    """Launch `kernel[grid](*args, **kwargs)`, directly through the compiled kernel recorded in `compiled` when
    there is one for this device and these tensors (see the module's docs). `constexprs`: `constexpr_values` of
    `kwargs`; `compiled`: the caller's cache, keyed here; the caller guarantees that everything in `args` but the
    tensors is the same on every call with the same `compiled`."""
    if (not DIRECT_RELAUNCH or not on_gpu or _knobs.runtime.debug or _knobs.compilation.instrumentation_mode
            or getattr(kernel, "debug", False)):  # the JIT's business
        kernel[grid](*args, **kwargs)
        return
    device = _driver.active.get_current_device()
    # a tensor's dtype and 16-byte alignment select the build; positions keep None and tensors apart
    key = (device, *((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else None for a in args))
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


def _relaunchable(kernel) -> bool:
    """A compiled kernel whose launcher `relaunch` knows how to call (Triton 3.6's `CompiledKernel`)."""
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
