"""MXFP8 quantize on the GPU: our Triton casts (rowwise, colwise, dual, square) beside torchao and the
compiled reference, with the copy ceiling of the same run.

Run from the project root: `python -m benchmarks.bench_quantize` (JSON under $OUT, else ./.bench_out).
Ours use `rceil`; torchao's `to_mx` uses its default FLOOR rule (the cost of a cast does not depend on it).
Every variant of ours runs a few tile configurations (BLOCK_M, BLOCK_K, num_warps); the best is printed.
Effective bytes = the bf16 input read once + every payload and scale byte written. Every output of ours
is compared byte for byte with the reference (run on the GPU) on the benchmarked tensor: PASS/FAIL.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Bench  # noqa: E402
from gem_lp.mx import quantize_reference, to_blocked  # noqa: E402
from gem_lp.mx.triton_quantize import mx_cast_2d  # noqa: E402

SHAPES = ((65536, 2048), (32768, 4096))
SCALING = "rceil"
# (BLOCK_M, BLOCK_K, num_warps) tried per variant.
CONFIGS = {
    "rowwise": ((64, 128, 4), (32, 128, 4), (64, 128, 8), (32, 256, 4), (128, 128, 8), (32, 64, 2)),
    "colwise": ((128, 64, 8), (64, 64, 4), (128, 64, 4), (128, 32, 4), (256, 64, 8), (128, 128, 8)),
    "dual": ((128, 64, 8), (64, 64, 4), (128, 64, 4), (32, 128, 4), (128, 32, 4), (128, 128, 16)),
    "square": ((64, 64, 4), (64, 128, 4), (128, 128, 8), (32, 256, 4)),
}
FLAGS = {
    "rowwise": dict(rowwise=True, colwise=False, square=False, blocked_scales=True),
    "colwise": dict(rowwise=False, colwise=True, square=False, blocked_scales=True),
    "dual": dict(rowwise=True, colwise=True, square=False, blocked_scales=True),
    "square": dict(rowwise=False, colwise=False, square=True, blocked_scales=False),
}


def out_bytes(outs) -> int:
    return sum(t.numel() * t.element_size() for t in outs)


def reference_outputs(x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The reference's bytes for every variant, in `mx_cast_2d`'s output order."""
    row = quantize_reference(x, axis=1, scaling=SCALING)
    col = quantize_reference(x.t(), axis=1, scaling=SCALING, allow_partial=True)
    sq = quantize_reference(x, block="square", scaling=SCALING)
    row_pair = [row.data.view(torch.uint8), to_blocked(row.scale)]
    col_pair = [col.data.view(torch.uint8), to_blocked(col.scale)]
    del row, col
    return dict(rowwise=row_pair, colwise=col_pair, dual=row_pair + col_pair,
                square=[sq.data.view(torch.uint8), sq.scale])


def same_bytes(outs, expected) -> bool:
    return len(outs) == len(expected) and all(
        torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(outs, expected))


def bench_ours(bench: Bench, x: torch.Tensor, tag: str, expected: dict, checks: dict, best: dict) -> None:
    x_bytes = x.numel() * x.element_size()
    for variant, configs in CONFIGS.items():
        group = f"{tag} {variant}"
        timed = []
        for bm, bk, nw in configs:
            name = f"ours {variant} {bm}x{bk} w{nw}"

            def run(bm=bm, bk=bk, nw=nw):
                return mx_cast_2d(x, scaling=SCALING, block_m=bm, block_k=bk, num_warps=nw, **FLAGS[variant])

            try:
                outs = run()
                ok = same_bytes(outs, expected[variant])
                nbytes = x_bytes + out_bytes(outs)
                del outs
            except Exception as e:
                print(f"  [{group}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=2)
                bench.rows.append(dict(group=group, name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            checks[f"{group} {name}"] = ok
            print(f"  [{group}] {name}: bytes vs reference {'PASS' if ok else 'FAIL'}", flush=True)
            ms = bench.time(group, name, run, nbytes=nbytes, config=(bm, bk, nw), bit_identical=ok)
            if ms is not None and ok:  # only a bit-identical configuration can be the best
                timed.append((ms, (bm, bk, nw)))
        if timed:
            ms, cfg = min(timed)
            best[group] = dict(config=cfg, ms=ms)
            print(f"  [{group}] best config (BLOCK_M, BLOCK_K, num_warps) = {cfg}: {ms:.4f} ms", flush=True)
            if variant == "dual":  # the integer E4M3 rounding, once, for comparison with the hardware cast
                bm, bk, nw = cfg
                name = f"ours dual {bm}x{bk} w{nw} HW_CAST=False"

                def run_sw():
                    return mx_cast_2d(x, scaling=SCALING, block_m=bm, block_k=bk, num_warps=nw, hw_cast=False,
                                      **FLAGS["dual"])

                try:
                    ok = same_bytes(run_sw(), expected["dual"])
                except Exception as e:
                    print(f"  [{group}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    bench.rows.append(dict(group=group, name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    continue
                checks[f"{group} {name}"] = ok
                print(f"  [{group}] {name}: bytes vs reference {'PASS' if ok else 'FAIL'}", flush=True)
                bench.time(group, name, run_sw, nbytes=x_bytes + out_bytes(expected["dual"]), config=cfg,
                           bit_identical=ok)


def bench_peer(bench: Bench, group: str, name: str, fn, x_bytes: int, **info) -> None:
    """Run `fn` once (compilation, first call), then time it; a failure is recorded, never raised."""
    try:
        outs = fn()
        flat = [t for t in (outs if isinstance(outs, (list, tuple)) else [outs]) if isinstance(t, torch.Tensor)]
        nbytes = x_bytes + out_bytes(flat)
        del outs, flat
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  [{group}] {name}: FAILED {msg}", flush=True)
        traceback.print_exc(limit=2)
        bench.rows.append(dict(group=group, name=name, error=msg, peer=True))
        return
    bench.time(group, name, fn, nbytes=nbytes, peer=True, **info)


def bench_peers(bench: Bench, x: torch.Tensor, tag: str) -> None:
    x_bytes = x.numel() * x.element_size()

    def ref_rowwise(t):
        mx = quantize_reference(t, axis=1, scaling=SCALING)
        return mx.data, mx.scale

    ref_row_c = torch.compile(ref_rowwise, dynamic=False)
    bench_peer(bench, f"{tag} rowwise", "torch.compile(reference) rowwise", lambda: ref_row_c(x), x_bytes)

    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as e:  # torchao is optional on the GPU host
        print(f"  torchao unavailable ({type(e).__name__}: {e}); its rows are skipped", flush=True)
        bench.extra["torchao"] = f"unavailable: {type(e).__name__}: {e}"
        return
    import torchao

    bench.extra["torchao"] = torchao.__version__
    to_mx_row = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32), dynamic=False)
    bench_peer(bench, f"{tag} rowwise", "torchao to_mx compiled", lambda: to_mx_row(x), x_bytes)

    col_fn, col_name = None, None
    try:
        from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim1

        triton_to_mxfp8_dim1(x, 32)
        col_fn, col_name = (lambda: triton_to_mxfp8_dim1(x, 32)), "torchao triton_to_mxfp8_dim1 (RCEIL)"
    except Exception as e:
        print(f"  torchao triton_to_mxfp8_dim1 not usable here ({type(e).__name__}: {str(e)[:200]}); "
              f"colwise peer = compiled to_mx(x.t().contiguous())", flush=True)
        to_mx_col = torch.compile(lambda t: to_mx(t.t().contiguous(), torch.float8_e4m3fn, 32), dynamic=False)
        col_fn, col_name = (lambda: to_mx_col(x)), "torchao to_mx(x.t().contiguous()) compiled"
    bench.extra["torchao_colwise_peer"] = col_name
    bench_peer(bench, f"{tag} colwise", col_name, col_fn, x_bytes)

    def two_casts():
        return (*to_mx_row(x), *col_fn())

    bench_peer(bench, f"{tag} dual", "two torchao casts (rowwise + colwise above)", two_casts, x_bytes)


def main(shapes=SHAPES, device: str = "cuda") -> None:
    bench = Bench("bench_quantize")
    bench.copy_bandwidth()
    checks: dict[str, bool] = {}
    best: dict[str, dict] = {}
    for M, K in shapes:
        tag = f"{M}x{K}"
        g = torch.Generator(device=device).manual_seed(M + K)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
        expected = reference_outputs(x)
        bench_ours(bench, x, tag, expected, checks, best)
        del expected
        if device == "cuda":
            torch.cuda.empty_cache()
        bench_peers(bench, x, tag)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    bench.extra.update(best_configs={k: v["config"] for k, v in best.items()}, checks=checks)
    print("\nbest tile configurations (BLOCK_M, BLOCK_K, num_warps):")
    for group, b in best.items():
        print(f"  {group:24s} {b['config']}  {b['ms']:.4f} ms")
    n_fail = sum(not ok for ok in checks.values())
    print(f"bit-identity vs reference: {len(checks) - n_fail} PASS, {n_fail} FAIL"
          + "".join(f"\n  FAIL {k}" for k, ok in checks.items() if not ok))
    bench.finish()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench_quantize needs a CUDA device")
    main()
