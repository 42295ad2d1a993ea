"""A small CuTe kernel that applies the MX device helpers of the attention kernels (`gem_lp.attention.cute.
mx_device`) to rows of 32 FP32 values, one row per thread, so their bits can be checked against the reference."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from flash_attn.cute.cute_dsl_utils import to_cute_tensor

from gem_lp.attention.cute.mx_device import abs_bits_max, const_p_bf16x2, e4m3_bf16x2, mx_bf16x2, mx_scales

MODES = ("const_p", "e4m3", "block_signed", "block_p")


class Probe:
    """mode: `const_p` (each pair through `const_p_bf16x2`), `e4m3` (`e4m3_bf16x2`), `block_signed` (the row is
    one MX block: scales by `mx_scales(single_step=False)`, pairs by signed `mx_bf16x2`; dS's path), `block_p`
    (single-step, unsigned; dynamic P's path)."""

    def __init__(self, mode: str):
        self.mode = mode

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, sums: cute.Tensor, stream: cuda.CUstream = None):
        rows = x.shape[0]
        self.kernel(x, y, sums).launch(grid=[(rows + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, y: cute.Tensor, sums: cute.Tensor):
        row = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        if row < x.shape[0]:
            if cutlass.const_expr(self.mode in ("const_p", "e4m3")):
                total = cutlass.Float32(0.0)
                convert = const_p_bf16x2 if cutlass.const_expr(self.mode == "const_p") else e4m3_bf16x2
                for j in cutlass.range_constexpr(16):
                    y[row, j], s = convert(x[row, 2 * j], x[row, 2 * j + 1], ret_sum=True)
                    total += s
                sums[row] = total
            else:
                amax = Int32(0)
                for j in cutlass.range_constexpr(32):
                    amax = abs_bits_max(amax, x[row, j])
                single = cutlass.const_expr(self.mode == "block_p")
                inv_scale, dequant = mx_scales(amax, single_step=single)
                total = cutlass.Float32(0.0)
                for j in cutlass.range_constexpr(16):
                    y[row, j], s = mx_bf16x2(x[row, 2 * j], x[row, 2 * j + 1], inv_scale, dequant,
                                             signed=not single, single_step=single, ret_sum=True)
                    total += s
                sums[row] = total


_COMPILED = {}


def run_probe(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [n, 32]` FP32 CUDA -> (the BF16 values `[n, 32]`, FP32 row sums of them `[n]`)."""
    y = torch.empty(x.shape[0], 16, dtype=torch.int32, device=x.device)
    sums = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if mode not in _COMPILED:
        _COMPILED[mode] = cute.compile(Probe(mode), to_cute_tensor(x), to_cute_tensor(y),
                                       to_cute_tensor(sums, assumed_align=4, leading_dim=0),
                                       cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                                       options="--enable-tvm-ffi")
    _COMPILED[mode](x, y, sums)
    return y.view(torch.bfloat16), sums
