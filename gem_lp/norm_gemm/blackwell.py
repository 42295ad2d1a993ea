"""Blackwell (sm_100) build of the MX GEMM: compile-checked, not run.

`triton_gemm._mx_gemm_kernel` with `OPERANDS=1` feeds `tl.dot_scaled` E4M3 tiles and their E8M0 scale
tiles. On sm_90 Triton decomposes that into a BF16 upcast and a BF16 dot; compiled for sm_100 it becomes
the native block-scaled tensor-core MMA, `tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale`, which
applies the scales inside the MMA (exact MX, no promotion or dequantization in registers).

No sm_100 device is available to this project: `blackwell_mx_gemm_ptx` compiles the kernel on any machine
(no GPU needed, `triton.compile` with `GPUTarget("cuda", 100, 32)`) and the tests check that its PTX holds
that instruction. Run `python -m gem_lp.norm_gemm.blackwell` to print the MMA lines of the PTX.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from .triton_gemm import GemmConfig

BLACKWELL = ("cuda", 100, 32)
BLOCK_SCALED_MMA = re.compile(r"tcgen05\.mma\S*\.block_scale")
# Tile for sm_100: one warp group drives the tensor-core MMA; the accumulator lives in tensor memory.
BLACKWELL_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)


def _signature(out_plain: bool, row_mx: bool, col_mx: bool, bias: bool) -> tuple[dict, dict]:
    """(signature, constexprs) of `_mx_gemm_kernel` for E4M3 operands with blocked scales."""
    sig = dict(a_ptr="*fp8e4nv", a_scale_ptr="*u8", b_ptr="*fp8e4nv", b_scale_ptr="*u8",
               bias_ptr="*fp32" if bias else "constexpr", y_ptr="*bf16" if out_plain else "constexpr",
               yr_data_ptr="*u8" if row_mx else "constexpr", yr_scale_ptr="*u8" if row_mx else "constexpr",
               yc_data_ptr="*u8" if col_mx else "constexpr", yc_scale_ptr="*u8" if col_mx else "constexpr",
               M="i32", N="i32", Kc="i32", stride_am="i32", stride_ak="constexpr", stride_bn="i32",
               stride_bk="constexpr")
    consts = dict(stride_ak=1, stride_bk=1)
    for name, ptr_on in (("bias_ptr", bias), ("y_ptr", out_plain), ("yr_data_ptr", row_mx),
                         ("yr_scale_ptr", row_mx), ("yc_data_ptr", col_mx), ("yc_scale_ptr", col_mx)):
        if not ptr_on:
            consts[name] = None
    return sig, consts


def compile_mx_gemm(target: tuple = BLACKWELL, config: GemmConfig = BLACKWELL_CONFIG, *, out_plain: bool = True,
                    row_mx: bool = True, col_mx: bool = False, bias: bool = False) -> dict[str, str]:
    """Compile the `dot_scaled` MX GEMM for `target` (backend, arch, warp size); returns its `asm` dict.

    Needs compiled (not interpreted) kernels: call it with TRITON_INTERPRET unset or 0.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .triton_gemm import _OPERANDS_SCALED, _mx_gemm_kernel

    sig, consts = _signature(out_plain, row_mx, col_mx, bias)
    flags = dict(OPERANDS=_OPERANDS_SCALED, A_BLOCKED=True, B_BLOCKED=True, EVEN_K=True, HAS_BIAS=bias,
                 OUT_PLAIN=out_plain, OUT_ROW_MX=row_mx, OUT_COL_MX=col_mx, BLOCKED_OUT=True, RCEIL=True,
                 HW_CAST=True, INTERPRET=False, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 BLOCK_K=config.block_k, GROUP_M=config.group_m)
    sig.update({name: "constexpr" for name in flags})
    consts.update(flags)
    kernel = triton.compile(ASTSource(_mx_gemm_kernel, sig, consts), target=GPUTarget(*target),
                            options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return dict(kernel.asm)


def blackwell_mx_gemm_ptx(*, row_mx: bool = True, col_mx: bool = False, timeout: float = 600) -> str:
    """PTX of the sm_100 `dot_scaled` MX GEMM (with the requested MX epilogue outputs).

    Under TRITON_INTERPRET=1 the kernels of this process are interpreted objects, so the compilation runs in
    a child Python with TRITON_INTERPRET=0.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return compile_mx_gemm(row_mx=row_mx, col_mx=col_mx)["ptx"]
    env = dict(os.environ, TRITON_INTERPRET="0")
    args = [sys.executable, "-m", "gem_lp.norm_gemm.blackwell", "--json", json.dumps(dict(row_mx=row_mx,
                                                                                          col_mx=col_mx))]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the sm_100 compilation failed:\n{done.stderr[-4000:]}")
    return done.stdout


def block_scaled_mma_lines(ptx: str) -> list[str]:
    """The PTX lines that issue a block-scaled `tcgen05.mma`."""
    return [line.strip() for line in ptx.splitlines() if BLOCK_SCALED_MMA.search(line)]


def _main(argv: list[str]) -> None:
    if argv[:1] == ["--json"]:  # child mode: the whole PTX on stdout
        sys.stdout.write(compile_mx_gemm(**json.loads(argv[1]))["ptx"])
        return
    ptx = blackwell_mx_gemm_ptx()
    lines = block_scaled_mma_lines(ptx)
    print(f"sm_100 MX GEMM: {len(lines)} block-scaled tcgen05.mma instructions in {len(ptx.splitlines())} PTX lines")
    for line in lines[:4]:
        print("  ", line)


if __name__ == "__main__":
    _main(sys.argv[1:])
