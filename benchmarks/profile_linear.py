"""Where an MXLinear layer's time goes on the GPU host at the token counts of jagged batches (GPU).

Run from the project root: `python -m benchmarks.profile_linear [--sections kernels,cublas_host,calls]`
(JSON `profile_linear.json` under $OUT, else ./.bench_out). Diagnostics behind docs/PERF.md's MXLinear notes:

* kernels: GPU time per kernel of one MX linear fwd+bwd (cuBLAS route) beside `nn.Linear` BF16's, from
  torch.profiler, at the GPU trainer's token count (1024 -> 256, 256 -> 256) and 32768 x 1024 -> 3072 (`--shapes`),
  and the backward pieces alone (the dY operand cast, the saved colwise operand of X, the dW GEMM, a copy of X).
* cublas_host: host microseconds per cuBLAS call as the layer issues them (mm, mm with an FP32 output, addmm with
  a bias, F.linear) with the same M on every call and with a new M on every call (cuBLAS plans once per shape).
* calls: host and wall milliseconds per fwd+bwd call of the MX linear / RMSNorm + MX linear (cuBLAS route, the
  autograd Functions of `gem_lp.linear.functions`) beside `nn.Linear` (and `F.rms_norm` + `nn.Linear`) at the
  model shapes, odd and aligned M.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import host_us_per_call  # noqa: E402
from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction  # noqa: E402
from gem_lp.linear.operands import saved_col_operand  # noqa: E402
from gem_lp.mx.kernels.triton_cast import rms_norm_mx  # noqa: E402

SECTIONS = ("kernels", "cublas_host", "calls")
DEV = "cuda"


def _bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=50, rep=300)


def _per_kernel_ms(step, reps: int = 5) -> dict[str, float]:
    """GPU milliseconds per call of `step` by kernel name (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = {e.key: e.device_time_total / reps / 1e3 for e in p.key_averages() if e.device_time_total > 0}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def kernels(out: dict, shapes: list[tuple[int, int, int]]) -> None:
    for M, K, N in shapes:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(N, K, device=DEV) / K**0.5).requires_grad_()
        b = torch.randn(N, device=DEV).requires_grad_()
        dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
        w16, b16 = (t.detach().bfloat16().requires_grad_() for t in (w, b))

        def step():
            return torch.autograd.grad(MXLinearFunction.apply(x, w, b, "rceil", "cublas", None), (x, w, b), dy)

        def peer():
            return torch.autograd.grad(F.linear(x, w16, b16), (x, w16, b16), dy)

        res = {}
        for name, fn in (("ours", step), ("nn.Linear bf16", peer)):
            rows = _per_kernel_ms(fn)
            res[name] = dict(per_kernel_ms=rows, gpu_ms=sum(rows.values()), ms=_bench(fn))
            print(f"=== M={M} {K}->{N} {name}: {res[name]['ms']:.3f} ms per fwd+bwd (GPU {res[name]['gpu_ms']:.3f});"
                  " by kernel:")
            for kname, ms in list(rows.items())[:10]:
                print(f"  {kname[:90]:90s} {ms:8.3f}")
        cast = rms_norm_mx(dy, None, rowwise=False, colwise=False, row_operand=True, col_operand=True,
                           column_sums=True)
        col = rms_norm_mx(x.detach(), None, rowwise=False, colwise=True).colwise
        x_op = saved_col_operand(col.data, col.scale, "rceil", "cublas", torch.bfloat16)
        pieces = {
            "dY operand cast": lambda: rms_norm_mx(dy, None, rowwise=False, colwise=False, row_operand=True,
                                                   col_operand=True, column_sums=True),
            "saved colwise operand of X": lambda: saved_col_operand(col.data, col.scale, "rceil", "cublas",
                                                                    torch.bfloat16),
            "dW GEMM": lambda: torch.mm(cast.col_operand.t(), x_op.t(), out_dtype=torch.float32),
            "copy of X": lambda: x.detach().clone(),
        }
        alone = {name: _bench(fn) for name, fn in pieces.items()}
        for name, ms in alone.items():
            print(f"  {name} alone: {ms:.3f} ms")
        res["alone_ms"] = alone
        res["ours / bf16"] = res["nn.Linear bf16"]["ms"] / res["ours"]["ms"]
        out[f"kernels {M}x{K}->{N}"] = res


def cublas_host(out: dict) -> None:
    K, N, top = 1024, 3072, 40000
    a = torch.randn(top, K, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(top, N, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(N, device=DEV, dtype=torch.bfloat16)
    cases = {
        "mm dX": lambda m: torch.mm(g[:m], w),
        "mm dX, FP32 output": lambda m: torch.mm(g[:m], w, out_dtype=torch.float32),
        "mm dW": lambda m: torch.mm(g[:m].t(), a[:m]),
        "mm dW, FP32 output": lambda m: torch.mm(g[:m].t(), a[:m], out_dtype=torch.float32),
        "addmm forward with bias": lambda m: torch.addmm(bias, a[:m], w.t()),
        "mm forward": lambda m: torch.mm(a[:m], w.t()),
    }
    res = {}
    for new_m in (False, True):
        for i, (name, fn) in enumerate(cases.items()):
            # a fresh range of M per case, so that no case meets shapes another one planned
            ms = [30000 - 7 * (200 * i + j) for j in range(200)] if new_m else [32767] * 200
            for m in ms[:5]:
                fn(m)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for m in ms[5:]:
                fn(m)
            host_us = (time.perf_counter() - t) / (len(ms) - 5) * 1e6
            torch.cuda.synchronize()
            key = f"{name} ({'a new M every call' if new_m else 'the same M'})"
            res[key] = host_us
            print(f"  {key:60s} host {host_us:7.1f} us/call", flush=True)
    out["cublas_host_us_per_call"] = res


def calls(out: dict) -> None:
    res = {}
    for M, K, N, norm in ((32767, 512, 1536, False), (32768, 512, 1536, False), (32767, 1024, 3072, False),
                          (32767, 4096, 1024, False), (32767, 1024, 3072, True), (8191, 256, 768, True)):
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(N, K, device=DEV) / K**0.5).requires_grad_()
        b = torch.randn(N, device=DEV).requires_grad_()
        gw = torch.ones(K, device=DEV, requires_grad=True)
        dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
        w16, b16, gw16 = (t.detach().bfloat16().requires_grad_() for t in (w, b, gw))
        if norm:
            def ours():
                y = RMSNormMXLinearFunction.apply(x, gw, w, b, 1e-6, "rceil", "cublas")
                return torch.autograd.grad(y, (x, gw, w, b), dy)

            def peer():
                y = F.linear(F.rms_norm(x, (K,), gw16, 1e-6), w16, b16)
                return torch.autograd.grad(y, (x, gw16, w16, b16), dy)
        else:
            def ours():
                return torch.autograd.grad(MXLinearFunction.apply(x, w, b, "rceil", "cublas", None), (x, w, b), dy)

            def peer():
                return torch.autograd.grad(F.linear(x, w16, b16), (x, w16, b16), dy)
        row = {name: dict(host_ms=host_us_per_call(fn, calls=100) / 1e3, ms=_bench(fn))
               for name, fn in (("ours", ours), ("bf16", peer))}
        row["ours / bf16"] = row["bf16"]["ms"] / row["ours"]["ms"]
        key = f"{M}x{K}->{N}{' with RMSNorm' if norm else ''}"
        res[key] = row
        print(f"  {key:28s} {json.dumps(row)}", flush=True)
    out["fwd_bwd_calls"] = res


def main(sections: tuple[str, ...], shapes: list[tuple[int, int, int]]) -> None:
    out: dict = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name()))
    for name, fn in (("kernels", lambda o: kernels(o, shapes)), ("cublas_host", cublas_host), ("calls", calls)):
        if name in sections:
            print(f"--- {name}", flush=True)
            fn(out)
    folder = os.environ.get("OUT") or ".bench_out"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "profile_linear.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"json: {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of "
                        + ",".join(SECTIONS))
    parser.add_argument("--shapes", default=None, help="kernels section: MxKxN, comma-separated (default: the GPU "
                        "trainer's first token count with 1024x256 and 256x256, then 32768x1024x3072)")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; expected a subset of {','.join(SECTIONS)}")
    if not torch.cuda.is_available():
        sys.exit("profile_linear needs a CUDA device")
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        from benchmarks.common import trainer_token_counts
        m = trainer_token_counts(1)[0]
        shapes = [(m, 1024, 256), (m, 256, 256), (32768, 1024, 3072)]
    main(tuple(args.sections.split(",")), shapes)
