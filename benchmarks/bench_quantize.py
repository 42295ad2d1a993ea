"""MXFP8 quantize on the GPU: our Triton casts (rowwise, colwise, dual, square) beside torchao and the
compiled reference, with the copy ceiling of the same run.

Run from the project root: `python -m benchmarks.bench_quantize` (JSON under $OUT, else ./.bench_out).
Ours use `rceil`; torchao's `to_mx` uses its default FLOOR rule (the cost of a cast does not depend on it).
Every variant of ours runs the launch configurations of `cast_candidates.QUANTIZE_CANDIDATE_CONFIGS` on the
first shape (the default first); later shapes run the default and the first shape's best. Effective bytes = the bf16 input
read once + every payload and scale byte written. The input is randn with NaN, +-Inf, zeros and block
maxima at the E4M3 boundary sprinkled in, and every output of ours is compared byte for byte with the
reference (run on the GPU) on it: PASS/FAIL.

`python -m benchmarks.bench_quantize --compile-only` (no GPU needed) builds every configuration for sm_90
as the GPU run would and prints its registers, spills and vector loads/stores; it fails if one does not build.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cast_candidates import QUANTIZE_CANDIDATE_CONFIGS as CANDIDATE_CONFIGS  # noqa: E402
from benchmarks.common import Bench  # noqa: E402
from gem_lp.mx import quantize_reference, to_blocked  # noqa: E402
from gem_lp.mx.kernels.triton_quantize import DEFAULT_CONFIGS, CastConfig, mx_cast_2d  # noqa: E402

SHAPES = ((65536, 2048), (32768, 4096))  # then the GPU trainer's first token count at K 256 and 1024 (`main`)
SCALING = "rceil"


def configs_of(variant: str) -> list[CastConfig]:
    """The default configuration first, then the other candidates."""
    default = DEFAULT_CONFIGS[variant]
    return [default] + [c for c in CANDIDATE_CONFIGS[variant] if c != default]


def config_kwargs(config: CastConfig) -> dict:
    bm, bk, nw, tr, rb = config
    return dict(block_m=bm, block_k=bk, num_warps=nw, thread_rows=tr, row_blocks_in_thread=rb)
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


def bench_config(bench: Bench, x: torch.Tensor, group: str, variant: str, config: CastConfig, expected: dict,
                 checks: dict, *, hw_cast: bool | None = None) -> float | None:
    """Check one configuration's bytes against the reference, then time it; None if it failed or differs."""
    name = f"ours {variant} {config!r}" + ("" if hw_cast is None else f" HW_CAST={hw_cast}")

    def run():
        return mx_cast_2d(x, scaling=SCALING, hw_cast=hw_cast, **config_kwargs(config), **FLAGS[variant])

    try:
        outs = run()
        ok = same_bytes(outs, expected[variant])
        nbytes = x.numel() * x.element_size() + out_bytes(outs)
        del outs
    except Exception as e:
        print(f"  [{group}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        traceback.print_exc(limit=2)
        bench.rows.append(dict(group=group, name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        return None
    checks[f"{group} {name}"] = ok
    print(f"  [{group}] {name}: bytes vs reference {'PASS' if ok else 'FAIL'}", flush=True)
    ms = bench.time(group, name, run, nbytes=nbytes, config=list(config), bit_identical=ok)
    return ms if ok else None  # only a bit-identical configuration can be the best


def bench_ours(bench: Bench, x: torch.Tensor, tag: str, expected: dict, checks: dict, best: dict,
               sweep: dict[str, list[CastConfig]]) -> None:
    for variant, configs in sweep.items():
        group = f"{tag} {variant}"
        timed = []
        for config in configs:
            ms = bench_config(bench, x, group, variant, config, expected, checks)
            if ms is not None:
                timed.append((ms, config))
        if timed:
            ms, cfg = min(timed)
            best[group] = dict(config=cfg, ms=ms, variant=variant)
            print(f"  [{group}] best config {cfg!r}: {ms:.4f} ms", flush=True)
            if variant == "dual":  # the integer E4M3 rounding, once, for comparison with the hardware cast
                # on the best configuration whose integer build does not spill (thread_rows <= 8 on sm_90)
                no_spill = [c for _, c in sorted(timed) if c[3] <= 8]
                if no_spill:
                    bench_config(bench, x, group, variant, no_spill[0], expected, checks, hw_cast=False)


def special_values(x: torch.Tensor, seed: int) -> torch.Tensor:
    """`x` with NaN, +-Inf, zeros and values at the E4M3 / scale boundaries at random positions, so the
    byte check covers the non-finite and saturating paths of every configuration."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (96,), device=x.device, generator=g)
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, 448.0, 480.0, -464.0, 2.0 ** -126, 3.0e38, 1e-40, -1.0]
    for i, v in enumerate(specials):
        flat[idx[8 * i:8 * i + 8]] = v
    return x


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
    for i, (M, K) in enumerate(shapes):
        tag = f"{M}x{K}"
        g = torch.Generator(device=device).manual_seed(M + K)
        x = special_values(torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g), M + K)
        expected = reference_outputs(x)
        if i == 0:  # the whole tuning space on the first shape
            sweep = {v: configs_of(v) for v in FLAGS}
        else:  # the default and the first shape's best
            first = f"{shapes[0][0]}x{shapes[0][1]}"
            sweep = {v: list(dict.fromkeys([DEFAULT_CONFIGS[v]] + ([best[f"{first} {v}"]["config"]]
                                                                   if f"{first} {v}" in best else [])))
                     for v in FLAGS}
        bench_ours(bench, x, tag, expected, checks, best, sweep)
        del expected
        if device == "cuda":
            torch.cuda.empty_cache()
        bench_peers(bench, x, tag)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    bench.extra.update(best_configs={k: list(v["config"]) for k, v in best.items()}, checks=checks,
                       default_configs={k: list(v) for k, v in DEFAULT_CONFIGS.items()})
    print("\nbest launch configurations (block_m x block_k, warps, thread_rows, row blocks in thread):")
    for group, b in best.items():
        is_default = b["config"] == DEFAULT_CONFIGS[b["variant"]]
        print(f"  {group:24s} {b['config']!r:28s} {b['ms']:.4f} ms" + ("  (the default)" if is_default else ""))
    n_fail = sum(not ok for ok in checks.values())
    print(f"bit-identity vs reference: {len(checks) - n_fail} PASS, {n_fail} FAIL"
          + "".join(f"\n  FAIL {k}" for k, ok in checks.items() if not ok))
    bench.finish()


def compile_only(shapes=SHAPES) -> int:
    """Build every configuration the GPU run times for sm_90, on this machine (no GPU); 1 if one fails."""
    from gem_lp.mx.kernels.triton_quantize import (_mx_cast_2d_kernel, cast_2d_launch, compile_for_target, output_specs,
                                           ptxas_usage)

    failed = 0
    for M, K in shapes:
        x = torch.empty(M, K, dtype=torch.bfloat16)
        for variant, flags in FLAGS.items():
            flag_tuple = (flags["rowwise"], flags["colwise"], flags["square"])
            outs = [torch.empty(shape, dtype=dtype)
                    for shape, dtype, _ in output_specs(M, K, *flag_tuple, flags["blocked_scales"])]
            for hw_cast in (True, False) if variant == "dual" else (True,):
                # the integer rounding runs on a dual configuration with thread_rows <= 8 (see bench_ours)
                for config in [c for c in configs_of(variant) if hw_cast or c[3] <= 8]:
                    grid, args, kwargs = cast_2d_launch(x, outs, *flag_tuple, flags["blocked_scales"], True, config,
                                                        hw_cast)
                    try:
                        ptx = compile_for_target(_mx_cast_2d_kernel, args, kwargs).asm["ptx"]
                        regs, spills = ptxas_usage(ptx)
                    except Exception as e:
                        failed += 1
                        print(f"  {M}x{K} {variant} {config!r} hw_cast={hw_cast}: FAILED {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    print(f"  {M}x{K} {variant:8s} {config!r:26s} hw_cast={hw_cast!s:5s} registers {regs:3d}  "
                          f"spill bytes {spills}  16-byte loads {ptx.count('ld.global.v4')}  16-byte stores "
                          f"{ptx.count('st.global.v4')}", flush=True)
    print(f"sm_90 builds: {'all built' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true",
                        help="build every configuration for sm_90 without a GPU (TRITON_INTERPRET must be unset)")
    if parser.parse_args().compile_only:
        sys.exit(compile_only())
    if not torch.cuda.is_available():
        sys.exit("bench_quantize needs a CUDA device (or --compile-only)")
    from benchmarks.common import trainer_token_counts
    m = trainer_token_counts(1)[0]
    main(SHAPES + ((m, 256), (m, 1024)))
