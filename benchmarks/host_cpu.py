"""Python host time of the MX linears' calls on their GPU routes, on a CPU with every Triton launch replaced by a
no-op.

Run from the project root on any machine: `python -m benchmarks.host_cpu [--profile]`. The kernels run nowhere
(TRITON_INTERPRET=1, launches mocked), so what is timed is the Python and the torch ops around them: a relative
measure of host-side changes without a GPU (a GPU host's Python is slower, and its launches cost more). Rows: the
public `mx_linear`, `rms_norm_mx_linear` and `rms_norm_mx_mlp` fwd+bwd with `backend="triton"` (the cuBLAS route
here; argument checks and dispatch included, torch's CPU matmuls too) beside `F.linear`.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before gem_lp imports triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gem_lp.linear import mx_linear, rms_norm_mx_linear, rms_norm_mx_mlp  # noqa: E402
from gem_lp.mx.kernels import triton_cast as tn  # noqa: E402
from gem_lp.mx.kernels import triton_dequantize  # noqa: E402
from gem_lp.norm.kernels import triton_backward  # noqa: E402


class _NoLaunch:
    """A kernel whose launches do nothing (keeps the names and signature the launch code reads)."""

    def __init__(self, kernel):
        self.arg_names, self.fn = kernel.arg_names, kernel.fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _mock_launches() -> None:
    for module in (tn, triton_dequantize, triton_backward):
        for name in dir(module):
            obj = getattr(module, name)
            if name.endswith("_kernel") and hasattr(obj, "arg_names") and hasattr(obj, "fn"):
                setattr(module, name, _NoLaunch(obj))
    tn._compile_token_count_variants = lambda *args, **kwargs: None


def _us_per_call(fn, calls: int = 300) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def cases() -> dict:
    M, K, N = 64, 64, 96
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(N, K, requires_grad=True), torch.randn(N, requires_grad=True)
    gw = torch.ones(K, requires_grad=True)
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    out = {}
    w_down, b_down = torch.randn(K, N, requires_grad=True), torch.randn(K, requires_grad=True)
    dy_mlp = torch.randn(M, K, dtype=torch.bfloat16)
    out["mx_linear fwd+bwd"] = lambda: torch.autograd.grad(mx_linear(x, w, b, backend="triton"), (x, w, b), dy)
    out["rms_norm_mx_linear fwd+bwd"] = lambda: torch.autograd.grad(
        rms_norm_mx_linear(x, gw, w, b, 1e-6, backend="triton"), (x, gw, w, b), dy)
    out["rms_norm_mx_mlp fwd+bwd"] = lambda: torch.autograd.grad(
        rms_norm_mx_mlp(x, gw, w, b, w_down, b_down, 1e-6, backend="triton"), (x, gw, w, b, w_down, b_down), dy_mlp)
    out["F.linear bf16 fwd+bwd (peer)"] = lambda: torch.autograd.grad(
        F.linear(x, w.bfloat16(), b.bfloat16()), (x, w, b), dy)
    return out


def main(profile: bool) -> None:
    _mock_launches()
    rows = cases()
    for name, fn in rows.items():
        print(f"{name:40s} {_us_per_call(fn):8.1f} us per call", flush=True)
    if profile:
        for name in ("mx_linear fwd+bwd", "rms_norm_mx_linear fwd+bwd", "rms_norm_mx_mlp fwd+bwd"):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                rows[name]()
            pr.disable()
            print(f"--- cProfile of 200 calls: {name}")
            pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    main(parser.parse_args().profile)
