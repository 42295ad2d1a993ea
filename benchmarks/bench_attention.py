"""Jagged attention on one GPU: ours (mxfp8, bf16) beside FlashAttention-4 and torch `varlen_attn`, and accuracy.

Workloads (lengths lognormal, sigma 0.8, seed 0, D128; `benchmarks.common.lognormal_lengths`):
  A        32 sequences, mean 1024, in [32, 4096], H16
  B        4096 sequences, mean 200, in [1, 4096], H4 (short histories)
  long     8 sequences, mean 8192, in [4096, 16384], H16
  trainer  1024 sequences, mean 256, in [1, 2048], H2 (the GPU trainer's shape)
each non-causal and causal, forward and backward. FLOPs: forward 4 H D sum(visible pairs), backward 2.5x.

Rows per workload and pass: `ours mxfp8` (`jagged_attention(precision="mxfp8")` on the cute backend, producer
pass included), `ours bf16` (the cute backend: FA4 through our API), and the peers `FA4 bf16`
(`flash_attn_varlen_func`) and `torch varlen_attn bf16`; `xpeer` is the best peer's time over the row's. Backward
rows time `autograd.grad` of the op's output.

Accuracy: SQNR (dB) against the FP32 reference of O, dQ, dK, dV for ours mxfp8 (const_p, dynamic), the mxfp8
reference recipe, ours bf16, and ours mxfp8 against the reference recipe, on randn inputs.

Run on the GPU host from the repository root: `python -m benchmarks.bench_attention [--workloads A,trainer]
[--no-causal] [--no-accuracy]`. Prints the accuracy table, then the timing table last; JSON under $OUT.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench, host_us_per_call, lognormal_lengths, offsets_of  # noqa: E402
from gem_lp.attention import jagged_attention  # noqa: E402
from gem_lp.accuracy import sqnr_db  # noqa: E402

DEV = "cuda"
D = 128
WORKLOADS = {  # name: (sequences, mean, lo, hi, heads)
    "A": (32, 1024, 32, 4096, 16),
    "B": (4096, 200, 1, 4096, 4),
    "long": (8, 8192, 4096, 16384, 16),
    "trainer": (1024, 256, 1, 2048, 2),
}


def visible_pairs(lengths: torch.Tensor, causal: bool) -> float:
    l = lengths.double()
    return float((l * (l + 1) / 2).sum() if causal else (l * l).sum())


def workload(name: str):
    batch, mean, lo, hi, heads = WORKLOADS[name]
    lengths = lognormal_lengths(batch, mean, lo=lo, hi=hi)
    offs = offsets_of(lengths)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(int(offs[-1]), heads, D, device=DEV, generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    return lengths, offs, heads, q, k, v


def timing(bench: Bench, name: str, causal: bool) -> None:
    lengths, offs, heads, q, k, v = workload(name)
    flop = 4.0 * heads * D * visible_pairs(lengths, causal)
    tag = f"{name} {'causal' if causal else 'full'}"
    print(f"{tag}: B={len(lengths)} T={int(offs[-1])} max={int(lengths.max())} H={heads}", flush=True)
    offs_dev = offs.to(DEV)
    cu = offs.to(DEV, torch.int32)
    mx = int(lengths.max())

    def ours(precision):
        return lambda a, b, c: jagged_attention(a, b, c, offs_dev, causal=causal, precision=precision,
                                                backend="cute")

    def fa4(a, b, c):
        from flash_attn.cute import flash_attn_varlen_func

        out = flash_attn_varlen_func(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                                     causal=causal)
        return out[0] if isinstance(out, tuple) else out

    def varlen(a, b, c):
        from torch.nn.attention.varlen import varlen_attn

        kw = {"window_size": (-1, 0)} if causal else {}
        out = varlen_attn(a, b, c, cu, cu, mx, mx, **kw)
        return out[0] if isinstance(out, tuple) else out

    rows = [("ours mxfp8", ours("mxfp8"), False), ("ours bf16", ours("bf16"), False), ("FA4 bf16", fa4, True),
            ("torch varlen_attn bf16", varlen, True)]
    for label, fn, peer in rows:
        try:
            with torch.no_grad():
                bench.time(f"{tag} fwd", label, lambda: fn(q, k, v), flop=flop, peer=peer)
            if label == "ours mxfp8":
                with torch.no_grad():
                    bench.extra[f"{tag} ours mxfp8 fwd host us/call"] = host_us_per_call(lambda: fn(q, k, v))
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)
            do = torch.randn_like(o)
            bench.time(f"{tag} bwd", label, lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True),
                       flop=2.5 * flop, peer=peer)
            del o, do, qg, kg, vg
        except Exception as e:
            print(f"  {tag} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=2)
        torch.cuda.empty_cache()


def accuracy(bench: Bench) -> None:
    """Eight sequences of workload A's distribution, H4."""
    lengths = lognormal_lengths(8, 1024, lo=32, hi=4096)
    offs = offsets_of(lengths).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(int(offs[-1]), 4, D, device=DEV, generator=g) for _ in range(3))
    d_out = torch.randn(q.shape, device=DEV, generator=g)
    table = {}

    def grads(precision, backend, p_quant="const_p", causal=False):
        qg, kg, vg = (t.clone().to(torch.float32 if precision == "fp32" else torch.bfloat16).requires_grad_()
                      for t in (q, k, v))
        o = jagged_attention(qg, kg, vg, offs, causal=causal, precision=precision, backend=backend,
                             p_quant=p_quant)
        return [o] + list(torch.autograd.grad(o, (qg, kg, vg), d_out.to(o.dtype)))

    for causal in (False, True):
        exact = grads("fp32", "reference", causal=causal)
        recipe = grads("mxfp8", "reference", causal=causal)
        entries = {"ours mxfp8 const_p": grads("mxfp8", "cute", causal=causal),
                   "ours mxfp8 dynamic": grads("mxfp8", "cute", "dynamic", causal=causal),
                   "mxfp8 reference recipe": recipe, "ours bf16": grads("bf16", "cute", causal=causal)}
        for label, got in entries.items():
            key = f"{'causal' if causal else 'full'} {label} vs fp32"
            table[key] = [round(sqnr_db(a, b), 1) for a, b in zip(got, exact)]
        key = f"{'causal' if causal else 'full'} ours mxfp8 const_p vs recipe"
        table[key] = [round(sqnr_db(a, b), 1) for a, b in zip(entries["ours mxfp8 const_p"], recipe)]
    bench.extra["accuracy_sqnr_db_O_dQ_dK_dV"] = table
    print("\naccuracy (SQNR dB: O, dQ, dK, dV)")
    for key, vals in table.items():
        print(f"  {key:48s} " + "  ".join(f"{x:6.1f}" for x in vals), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {list(WORKLOADS)}")
    ap.add_argument("--no-causal", action="store_true", help="non-causal rows only")
    ap.add_argument("--no-accuracy", action="store_true")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"--workloads: unknown {unknown}; expected names from {list(WORKLOADS)}")
    bench = Bench("bench_attention")
    if not args.no_accuracy:
        accuracy(bench)
    for name in names:
        for causal in ((False,) if args.no_causal else (False, True)):
            timing(bench, name, causal)
    bench.finish()


if __name__ == "__main__":
    main()
